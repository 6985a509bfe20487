"""Which experts real routing activates, against the uniform N(t), and the fitted correlation.

Every MoE block in mlx-lm's MoE architectures (qwen2_moe, qwen3_moe, mixtral, olmoe, deepseek_v2,
gpt_oss, ...) hands its chosen top-k indices to one switch module (``SwitchGLU``/``SwitchMLP``)
as ``switch(x, indices)``. ``controlled_switches`` swaps each such module's class for a subclass
that hands the indices to a ``SwitchControl`` first: capture records them (the model's output stays
bit-identical), and the sweep's routing control replaces them (``routing_control.py``). A class
whose call is no longer mlx-lm 0.32's ``(x, indices)`` is refused before any swap
(``mlxlm_compat.check_switch_call``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mac_moesd import mlxlm_compat
from mac_moesd.inputs import zoo
from mac_moesd.inputs.prompts import load_tokenizer
from mac_moesd.inputs.texts import load_text, prompt_rows, token_source
from mac_moesd.machine import memory
from mac_moesd.units import human_bytes
from mac_moesd.analysis import expert_reads, theory
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.results import ResultsStore, keys, schema
from mac_moesd.measure.experts import routing_trace
from mac_moesd.measure.experts.gather import check_sortable, sorted_switch_call

if TYPE_CHECKING:
    from mac_moesd.inputs.models import ModelSource

__all__ = ["SwitchControl", "analyse_windows", "capture_routing", "controlled_switches", "count_windows",
           "reanalyse", "routing_document"]

SWITCH_TYPES = (SwitchGLU, SwitchMLP)
_controlled_classes: dict[tuple[type, bool], type] = {}


class SwitchControl:
    """What one controlled switch module does with the top-k indices its router chose: replace
    them with ``forced`` when set (the router has run all the same), then append what the experts
    will receive to ``sink`` when set."""

    def __init__(self) -> None:
        self.forced: mx.array | None = None
        self.sink: list[mx.array] | None = None

    def __call__(self, indices: mx.array) -> mx.array:
        if self.forced is not None:
            if self.forced.shape != indices.shape:
                raise MacMoesdError(f"forced expert indices of shape {self.forced.shape} where the "
                                    f"router chose {indices.shape}")
            indices = self.forced
        if self.sink is not None:
            self.sink.append(indices)
        return indices


def _controlled_class(cls: type, always_sort: bool) -> type:
    """A subclass of ``cls`` whose call passes the indices through ``self._switch_control``, then
    runs the original call, or mlx-lm's sorted path at every size with ``always_sort``."""
    key = (cls, always_sort)
    if key not in _controlled_classes:
        def __call__(self, x, indices, *args, **kwargs):
            indices = self._switch_control(indices)
            if always_sort:
                return sorted_switch_call(self, x, indices)
            return cls.__call__(self, x, indices, *args, **kwargs)

        prefix = "SortedControlled" if always_sort else "Controlled"
        _controlled_classes[key] = type(f"{prefix}{cls.__name__}", (cls,), {"__call__": __call__})
    return _controlled_classes[key]


def switch_modules(model: nn.Module) -> list[nn.Module]:
    """The routed-expert modules in layer order; empty for a dense model."""
    switches: list[nn.Module] = []
    seen = set()
    for _, module in model.named_modules():
        if isinstance(module, SWITCH_TYPES) and id(module) not in seen:
            seen.add(id(module))
            switches.append(module)
    return switches


@contextlib.contextmanager
def controlled_switches(model: nn.Module, always_sort: bool = False):
    """Within the block every MoE layer's switch consults its ``SwitchControl`` (yielded, one per
    layer in order). Re-entrant: inside another such block the outer controls are yielded."""
    switches = switch_modules(model)
    if not switches:
        raise MacMoesdError("this model has no MoE layers (no SwitchGLU/SwitchMLP modules)")
    if all(hasattr(m, "_switch_control") for m in switches):
        yield [m._switch_control for m in switches]
        return
    for module in switches:
        mlxlm_compat.check_switch_call(type(module), "counting and forcing the experts a model routes to")
        if always_sort:
            check_sortable(module)
    originals = [m.__class__ for m in switches]
    controls = [SwitchControl() for _ in switches]
    try:
        for module, control in zip(switches, controls):
            module._switch_control = control  # a plain object: an attribute, not a child module
            module.__class__ = _controlled_class(module.__class__, always_sort)
        yield controls
    finally:
        for module, cls in zip(switches, originals):
            module.__class__ = cls
            del module._switch_control


@contextlib.contextmanager
def capture_routing(model: nn.Module):
    """Within the block, each forward appends one (tokens..., k) index array per MoE layer to the
    yielded list of lists (one inner list per layer): what the experts received, so forced
    indices when a routing control is active around it."""
    with controlled_switches(model) as controls:
        sinks: list[list[mx.array]] = [[] for _ in controls]
        try:
            for control, sink in zip(controls, sinks):
                control.sink = sink
            yield sinks
        finally:
            for control in controls:
                control.sink = None


# ---- counting ----


def routed_indices(model: nn.Module, tokens: mx.array) -> np.ndarray:
    """(layers, B, L, k) expert indices for one forward over ``tokens`` (B, L)."""
    batch, length = tokens.shape
    with capture_routing(model) as sinks:
        model(tokens)  # lazy: evaluate only what the indices need, never the logits
        mx.eval([indices for sink in sinks for indices in sink])
    per_layer = []
    for sink in sinks:
        (indices,) = sink
        per_layer.append(np.array(indices).reshape(batch, length, -1))
    return np.stack(per_layer)


def count_windows(indices: np.ndarray, batch: int, tokens: int) -> schema.RoutingWindow:
    """Unique experts hit by ``batch`` sequences x ``tokens`` consecutive tokens, per layer.

    ``indices`` is (layers, S, L, k) for S >= batch sequences; windows tile the sequences
    (groups of ``batch`` sequences, non-overlapping spans of ``tokens``).
    """
    layers, sequences, length, _ = indices.shape
    counts: list[int] = []
    for first in range(0, sequences - batch + 1, batch):
        for start in range(0, length - tokens + 1, tokens):
            window = indices[:, first : first + batch, start : start + tokens, :]
            counts.extend(len(np.unique(window[layer])) for layer in range(layers))
    if not counts:
        raise BadInput(f"no window of B={batch} x t={tokens} fits {sequences} sequences of {length}")
    values = np.asarray(counts, dtype=float)
    return {"batch": batch, "tokens": tokens, "measured_unique": float(values.mean()),  # mean over windows, layers
            "std_unique": float(values.std(ddof=1)) if len(values) > 1 else 0.0,  # spread across both
            "windows": len(values) // layers}  # windows counted per layer


def routing_document(
    indices: np.ndarray,
    experts: int,
    top_k: int,
    batches: tuple[int, ...],
    tokens: tuple[int, ...],
    tau: float,
    gammas: tuple[int, ...] = theory.CANDIDATE_GAMMAS,
) -> schema.RoutingDocument:
    windows = [count_windows(indices, b, t) for b in batches for t in tokens]
    return analyse_windows(windows, experts, top_k, tau, gammas)


def analyse_windows(windows: list[schema.RoutingWindow], experts: int, top_k: int, tau: float,
                    gammas: tuple[int, ...] = theory.CANDIDATE_GAMMAS) -> schema.RoutingDocument:
    """Correlations, thresholds and verify-window saturation from counted windows (measured or
    stored in a results file; their ``uniform_unique`` is recomputed)."""
    rho = theory.sparsity(experts, top_k)
    measured = {(w["batch"], w["tokens"]): w["measured_unique"] for w in windows}
    batches = sorted({b for b, _ in measured})
    # The same estimator the time-model fit uses on a sweep's counts: both correlations jointly.
    form = expert_reads.fit_routing(measured,
                                    experts, top_k).form_only()
    correlation, batch_correlation = form.correlation, form.batch_correlation
    rows: list[schema.RoutingWindow] = [
        {**w, "uniform_unique": float(theory.activated_experts(w["batch"] * w["tokens"], experts, top_k))}
        for w in windows]
    # A verify window is B sequences x (gamma+1) tokens: measured where the grid has it, else
    # predicted with both anchored forms: B independent sequences act like 1 + c_batch*(B-1)
    # uniform ones, each sequence's gamma+1 consecutive tokens like 1 + c*gamma uniform ones.
    saturation: list[schema.Saturation] = []
    for b in batches:
        for g in gammas:
            if (b, g + 1) in measured:
                active, how = measured[(b, g + 1)], "measured"
            else:
                active, how = float(form.unique(b, g + 1, experts, top_k)), "predicted"
            saturation.append({"batch": b, "gamma": g, "verify_tokens": b * (g + 1), "unique": active,
                               "source": how, "saturated": active >= tau * experts})
    return {
        "experts": experts,
        "top_k": top_k,
        "rho": rho,
        "tau": tau,
        "windows": rows,
        "correlation": correlation,
        "batch_correlation": batch_correlation,
        "threshold_uniform": theory.saturation_threshold(rho, tau),
        # Within-sequence threshold (consecutive tokens of one sequence), not MoESD's batch one.
        "threshold_corrected": theory.correlated_threshold(rho, correlation, tau),
        "saturation": saturation,
    }


def reanalyse(document: dict) -> dict:
    """A stored routing document with its fits redone from its counted windows (no new routing)."""
    gammas = tuple(sorted({s["gamma"] for s in document["saturation"]})) or theory.CANDIDATE_GAMMAS
    return {**document, **analyse_windows(document["windows"], document["experts"], document["top_k"],
                                          document["tau"], gammas)}


@dataclass(frozen=True)
class RoutingConfig:
    model: str
    text: str | None = None  # a file or folder, "code", "prose", or None for random ids
    prompts: str | None = None  # a prompt set instead: code, chat or FILE, one sequence per prompt
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tokens: tuple[int, ...] = (1, 2, 4, 8)
    length: int = 64  # tokens per sequence
    layers: int | None = None  # None: all layers if they fit, else about half, a quarter, ... (zoo.smaller_slice)
    bits: int | None = None
    tau: float = 0.95
    seed: int = 0
    save_trace: Path | None = None  # also write the routed indices there (routing_trace.py)


def run_routing(cfg: RoutingConfig, available_bytes: int | None, store: ResultsStore | None = None,
                source: ModelSource | None = None) -> schema.RoutingDocument:
    """Route the token source through the model and count experts; the routing document, saved
    into ``store`` where one is given. ``source``: the model as the command resolved it (None:
    ``cfg.model`` resolved here)."""
    from mac_moesd.inputs import models

    if min(cfg.batches) < 1 or min(cfg.tokens) < 1 or cfg.length < max(cfg.tokens):
        raise BadInput("--batch and --tokens must be >= 1 and --length >= the largest --tokens")
    if cfg.save_trace is not None:
        routing_trace.check_writable(cfg.save_trace)
    if cfg.text is not None and cfg.prompts is not None:
        raise BadInput("--text and --prompts exclude each other")
    source = source or models.resolve(cfg.model)
    if store is not None:
        source.claim(store)
    shape = zoo_shape(source.config)
    if cfg.prompts is None:
        text, where = load_text(cfg.text)
        sequences = 2 * max(cfg.batches)
    else:
        from mac_moesd.inputs.prompts import load_prompts

        text, where = None, keys.prompt_set_text(cfg.prompts)
        sequences = len(load_prompts(cfg.prompts).prompts)  # every prompt long enough is routed
    build = functools.lru_cache(maxsize=None)(
        lambda layers: models.build(source, bits=cfg.bits, layers=layers, seed=cfg.seed))
    layers = cfg.layers or zoo.largest_slice(
        int(source.config["num_hidden_layers"]), zoo.slice_unit(source.config),
        lambda n: _fits(build(n), sequences, cfg.length, available_bytes))
    built = build(layers)
    need = memory.routing_estimate(built, sequences, cfg.length)
    if available_bytes is not None and not _fits(built, sequences, cfg.length, available_bytes):
        raise MacMoesdError(
            f"{source.name} with {built.layers} layers needs about {human_bytes(need['peak_bytes'])}; "
            f"{human_bytes(available_bytes)} is usable here: route a slice with --layers or --bits 4"
        )
    if not switch_modules(built.model):
        raise MacMoesdError(f"{source.name} has no MoE layers to route")
    memory.start_stage()
    built.materialise()
    tokenizer = _tokenizer(source)
    batches = cfg.batches
    if cfg.prompts is not None:
        rows, how = prompt_rows(cfg.prompts, tokenizer, source.config["vocab_size"], cfg.length)
        batches = tuple(b for b in cfg.batches if b <= len(rows))  # windows need b sequences
    else:
        ids, how = token_source(text, tokenizer, source.config["vocab_size"],
                                max(cfg.batches) * cfg.length, cfg.seed)
        sequences = min(sequences, len(ids) // cfg.length)
        # Independent sequences: spans spread evenly over the token stream.
        stride = len(ids) // sequences
        rows = [ids[i * stride : i * stride + cfg.length] for i in range(sequences)]
    sequences = len(rows)
    indices = routed_indices(built.model, mx.array(rows))
    document = routing_document(indices, *shape, batches, cfg.tokens, cfg.tau)
    if cfg.save_trace is not None:
        routing_trace.save_trace(cfg.save_trace, indices, *shape, source.name, where, how)
        document["trace"] = str(cfg.save_trace)
    document.update({
        "model": source.name,
        "text": where,
        "token_ids": how,
        "sequences": sequences,
        "length": cfg.length,
        "layers_measured": built.layers,
        "layers_full": built.layers_full,
        "moe_layers_measured": int(indices.shape[0]),
        "memory": memory.record(need, available_bytes),
    })
    del built
    memory.release()
    if store is not None:
        store.put("routing", keys.routing_document_key(document), document)
    return document


def _fits(built, sequences: int, length: int, available_bytes: int | None) -> bool:
    if available_bytes is None:
        return True
    return memory.routing_estimate(built, sequences, length)["peak_bytes"] <= available_bytes


def zoo_shape(config: dict) -> tuple[int, int]:
    from mac_moesd.inputs import zoo

    shape = zoo.expert_shape(config)
    if shape is None:
        raise MacMoesdError("this model has no MoE layers (no expert count in its config)")
    return shape


def _tokenizer(source):
    """mlx-lm's tokenizer for a local model folder that ships one; None otherwise."""
    if source.weights_dir is None:
        return None
    try:
        return load_tokenizer(source.weights_dir)
    except Exception:  # tokenizer files it cannot load: fall back to hashed ids, said in the document
        return None
