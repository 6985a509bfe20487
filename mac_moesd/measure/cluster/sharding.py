"""Split a built model over the ranks of an ``mx.distributed`` group: pipeline, tensor or expert.

- ``pipeline``: mlx-lm's own ``model.model.pipeline(group)`` (``mlx_lm/models/pipeline.py``): each
  rank keeps a contiguous run of layers, hands its activations on with send/recv and the last
  stage's output is all-gathered. Architectures without it are refused.
- ``tensor``: mlx-lm's own ``model.shard(group)`` where the architecture has it (as
  ``mlx_lm.utils.sharded_load`` calls it). Elsewhere MLX's distributed layers do the same job:
  attention and dense MLPs through ``mlx.nn.layers.distributed.shard_linear``, every expert
  split along its width with ``shard_inplace``, and the MoE block's output summed over ranks.
- ``expert``: each rank holds E/n whole experts (the stacked expert weights split on their first
  axis); attention and dense layers are replicated. Every rank routes every token, runs the
  pairs routed to its own experts and zeroes the others, and the MoE block's output is summed
  over ranks (``all_sum``); shared experts are split along their width so that sum adds them once.

MLX arrays have static shapes, so a rank cannot drop the (token, expert) pairs routed elsewhere
before its gather: it runs them on its first local expert and zeroes them. Expert weights are
read as expert parallelism reads them (only the local ones); the compute of a rank covers all
B*t*K pairs, not about B*t*K/n. Every split is of the lazy model: nothing is allocated here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mac_moesd import mlxlm_compat
from mac_moesd.errors import BadInput

__all__ = ["MODES", "ExpertSlice", "SummedBlock", "shard", "supports"]

MODES = ("pipeline", "tensor", "expert")
SWITCHES = (SwitchGLU, SwitchMLP)
HEADS = ("n_heads", "num_heads", "num_attention_heads")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads")

if TYPE_CHECKING:
    _Switch = SwitchGLU  # what ExpertSlice is mixed into (SwitchMLP's call is the same)
else:
    _Switch = object


class ExpertSlice(_Switch):
    """Mixed into a SwitchGLU/SwitchMLP that holds a rank's experts ``_first .. _first+_count-1``.
    It still takes global expert indices, so what wraps a switch (routing capture and forcing,
    ``routing.controlled_switches``) sees the model's own; pairs routed to its experts run on
    them, the others on local expert 0, zeroed (static shapes)."""

    _first: int
    _count: int

    def __call__(self, x: mx.array, indices: mx.array, *args, **kwargs) -> mx.array:
        local = indices - self._first
        mine = (local >= 0) & (local < self._count)
        y = super().__call__(x, mx.where(mine, local, 0), *args, **kwargs)
        return y * mine[..., None].astype(y.dtype)


@functools.lru_cache(maxsize=None)
def _sliced_class(cls: type) -> type:
    return type(f"ExpertSlice{cls.__name__}", (ExpertSlice, cls), {})


class SummedBlock(nn.Module):
    """An MoE block whose ranks each compute part of the output; the parts are summed."""

    def __init__(self, block: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.block = block
        self.group = group

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return mx.distributed.all_sum(self.block(x, *args, **kwargs), group=self.group)


def _moe_blocks(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(layer, attribute, block, switch attribute) for every MoE block of the model's layers:
    a child of a decoder layer that has a SwitchGLU/SwitchMLP child."""
    found = []
    for layer in model.layers:
        if layer is None:
            continue
        for name, block in layer.children().items():
            if not isinstance(block, nn.Module):
                continue
            switch = [k for k, v in block.children().items() if isinstance(v, SWITCHES)]
            if switch:
                found.append((layer, name, block, switch[0]))
    return found


def _dense_mlps(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children with gate/up/down projections (a SwiGLU MLP: shared experts, dense FFNs)."""
    return [(k, v) for k, v in module.children().items()
            if isinstance(v, nn.Module) and all(hasattr(v, p) for p in ("gate_proj", "up_proj", "down_proj"))
            and not isinstance(v, SWITCHES)]


def _split_width(mlp: nn.Module, group: mx.distributed.Group) -> None:
    """Split a SwiGLU MLP (dense or switch) along its hidden width, in place; the caller sums.
    A down-projection bias would be added on every rank, so each rank keeps 1/n of it."""
    shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
    shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
    shard_inplace(mlp.down_proj, "sharded-to-all", group=group)
    if "bias" in mlp.down_proj:
        mlp.down_proj.bias = mlp.down_proj.bias / group.size()


def _split_experts(switch: nn.Module, group: mx.distributed.Group, experts: int) -> None:
    """Keep this rank's E/n experts of ``switch``, in place: it stays a SwitchGLU/SwitchMLP."""
    n, rank = group.size(), group.rank()
    if experts % n:
        raise BadInput(f"--parallel expert needs the {experts} experts to divide over {n} ranks")
    mlxlm_compat.check_switch_call(type(switch), "--parallel expert")
    shard_inplace(switch, lambda path, weight: 0, group=group)  # stacked experts: axis 0
    switch._first, switch._count = rank * (experts // n), experts // n  # plain attributes
    switch.__class__ = _sliced_class(switch.__class__)


def _expert_count(switch: nn.Module) -> int:
    proj = next(v for v in switch.children().values() if isinstance(v, nn.Module))
    return int(proj.weight.shape[0])


def _shard_expert(model: nn.Module, group: mx.distributed.Group) -> None:
    blocks = _moe_blocks(model)
    if not blocks:
        raise BadInput("--parallel expert needs an MoE model (no SwitchGLU/SwitchMLP layers found)")
    for layer, name, block, switch_name in blocks:
        _split_experts(getattr(block, switch_name), group, _expert_count(getattr(block, switch_name)))
        for _, shared in _dense_mlps(block):
            _split_width(shared, group)
        setattr(layer, name, SummedBlock(block, group))


def _attention_generic(attn: nn.Module, group: mx.distributed.Group) -> None:
    """q/k/v split by heads, o summed, as mlx-lm's own shard methods do for Llama-like attention."""
    n = group.size()
    names = [k for k in (*HEADS, *KV_HEADS) if isinstance(getattr(attn, k, None), int)]
    if not names or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise BadInput(f"{type(attn).__name__} is not a q/k/v/o attention with a head count")
    head_dim = getattr(attn, "head_dim", None)
    for key, norm in attn.children().items():
        size = getattr(norm, "weight", None)
        if key.endswith("norm") and size is not None and size.shape[-1] != head_dim:
            raise BadInput(f"{type(attn).__name__}.{key} normalises across heads: splitting heads "
                           "would change it")
    for key in names:
        if getattr(attn, key) % n:
            raise BadInput(f"{type(attn).__name__}.{key} = {getattr(attn, key)} does not divide over {n} ranks")
    for p in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, p, shard_linear(getattr(attn, p), "all-to-sharded", group=group))
    attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
    for key in names:
        setattr(attn, key, getattr(attn, key) // n)


def _shard_tensor_generic(model: nn.Module, group: mx.distributed.Group) -> None:
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise BadInput(f"{type(layer).__name__} has no self_attn to split")
        _attention_generic(attn, group)
    for layer, name, block, switch_name in _moe_blocks(model):
        _split_width(getattr(block, switch_name), group)
        for _, shared in _dense_mlps(block):
            _split_width(shared, group)
        setattr(layer, name, SummedBlock(block, group))
    for layer in model.layers:  # dense FFNs (MoE blocks are SummedBlocks by now)
        for _, mlp in _dense_mlps(layer):
            mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
            mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
            mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def supports(model: nn.Module, mode: str) -> str:
    """How ``mode`` will split this model: 'mlx-lm' (its own method) or 'mlx.nn' (MLX's layers)."""
    if mode == "pipeline":
        return "mlx-lm" if hasattr(getattr(model, "model", None), "pipeline") else "none"
    if mode == "tensor":
        return "mlx-lm" if hasattr(model, "shard") else "mlx.nn"
    return "mlx.nn"


def shard(model: nn.Module, mode: str, group: mx.distributed.Group) -> str:
    """Split ``model`` (lazy) in place for ``mode``; returns who did it ('mlx-lm' or 'mlx.nn')."""
    if mode not in MODES:
        raise BadInput(f"--parallel must be one of {', '.join(MODES)}, got {mode!r}")
    how = supports(model, mode)
    if mode == "pipeline":
        if how == "none":
            raise BadInput(f"mlx-lm has no pipeline method for {type(model).__module__.split('.')[-1]}: "
                           "use --parallel tensor or expert")
        if len(model.layers) < group.size():
            raise BadInput(f"--parallel pipeline needs at least one layer per rank "
                           f"({len(model.layers)} layers, {group.size()} ranks)")
        model.model.pipeline(group)
    elif mode == "tensor" and how == "mlx-lm":
        model.shard(group)
    elif mode == "tensor":
        _shard_tensor_generic(model, group)
    else:
        _shard_expert(model, group)
    return how
