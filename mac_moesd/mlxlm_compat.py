"""Every private mlx-lm name the suite relies on, behind one door, each looked up when first used.

mlx-lm moves and renames its private helpers between minor releases, so none is imported when a
module loads (one missing name would stop every command). Where mlx-lm's helper is a few lines,
a local twin stands in when it is gone (the tests check the twin against mlx-lm's); where it is
not, ``MlxLmIncompatible`` names the tested mlx-lm range and the installed version, and the stage
that needed it is skipped with that message while the others run. ``PRIVATE_NAMES`` lists them
all for ``selftest``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import TYPE_CHECKING, Callable

import mlx.core as mx

from mac_moesd.errors import MacMoesdError

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.models.base import BaseModelArgs

__all__ = ["CACHE_LAYOUTS", "PRIVATE_NAMES", "TESTED_RANGE", "MlxLmIncompatible", "PrivateName", "cache_children",
           "check_sorted_switch", "check_switch_call", "gather_sort", "in_tested_range", "incompatible",
           "installed_version", "missing_names", "model_classes", "RECURRENCES", "recurrence_sites",
           "scatter_unsort"]

# The mlx-lm releases the suite is tested on (pyproject.toml's bound): private names move between
# minor versions, so the bound stops below the next one.
TESTED_FROM, TESTED_BELOW = (0, 32), (0, 33)
TESTED_RANGE = ">=0.32,<0.33"


class MlxLmIncompatible(MacMoesdError):
    """The installed mlx-lm lacks something a stage needs (a private name moved or changed)."""


def installed_version() -> str:
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return getattr(importlib.import_module("mlx_lm"), "__version__", "unknown")


def in_tested_range(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) is in ``TESTED_RANGE``."""
    parts = []
    for piece in (version or installed_version()).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            return False
        parts.append(int(digits))
    return len(parts) == 2 and TESTED_FROM <= tuple(parts) < TESTED_BELOW


def incompatible(what: str, missing: str) -> MlxLmIncompatible:
    """The error for ``what`` (a stage or option) when this mlx-lm lacks ``missing``."""
    return MlxLmIncompatible(
        f"{what} needs mlx-lm {TESTED_RANGE} ({missing} is not as it was there); you have mlx-lm "
        f"{installed_version()}: `pip install 'mlx-lm{TESTED_RANGE}'`")


def _lookup(module: str, name: str):
    """mlx-lm's ``module.name``, or None where this mlx-lm has no such name."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# ---- model classes from a config ----


def model_classes(config: dict) -> tuple[Callable[[BaseModelArgs], nn.Module], type[BaseModelArgs]]:
    """(Model, ModelArgs) for ``config``: mlx-lm's ``utils._get_classes``, else its twin."""
    get_classes = _lookup("mlx_lm.utils", "_get_classes")
    return get_classes(config) if get_classes is not None else _model_classes(config)


def _model_classes(config: dict) -> tuple[Callable[[BaseModelArgs], nn.Module], type[BaseModelArgs]]:
    """Twin of ``_get_classes``: the module ``mlx_lm.models.<model_type>``, after mlx-lm's renames
    (by architecture, then by model type) where this mlx-lm still publishes them."""
    model_type = config["model_type"]
    by_architecture = _lookup("mlx_lm.utils", "MODEL_ARCHITECTURE_REMAPPING") or {}
    architectures = config.get("architectures") or ()
    renamed = [by_architecture[(model_type, a)] for a in
               ((architectures,) if isinstance(architectures, str) else architectures)
               if (model_type, a) in by_architecture]
    model_type = renamed[0] if renamed else (_lookup("mlx_lm.utils", "MODEL_REMAPPING") or {}).get(model_type, model_type)
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        raise ValueError(f"model type {model_type} is not supported by mlx-lm {installed_version()}") from None
    return module.Model, module.ModelArgs


# ---- the sorted expert gather (mlx_lm/models/switch_layers.py) ----


def gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The (token, expert) pairs ordered by expert: mlx-lm's ``_gather_sort``, else its twin.
    x: (..., 1, 1, D); indices: (..., k). Returns x's row of each pair (P, 1, D), the pairs'
    experts in order (P,), and the permutation that puts them back (P,), where P = tokens x k."""
    helper = _lookup("mlx_lm.models.switch_layers", "_gather_sort")
    return helper(x, indices) if helper is not None else _gather_sort(x, indices)


def _gather_sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    k = indices.shape[-1]
    experts = indices.reshape(-1)
    by_expert = mx.argsort(experts)
    rows = x.reshape(-1, *x.shape[-2:])[by_expert // k]  # pair p belongs to token p // k
    return rows, experts[by_expert], mx.argsort(by_expert)


def scatter_unsort(x: mx.array, inv_order: mx.array, shape: tuple | None = None) -> mx.array:
    """``gather_sort`` undone: mlx-lm's ``_scatter_unsort``, else its twin. x: (P, ...) in expert
    order; returns it in token order, its first axis unflattened to ``shape`` when given."""
    helper = _lookup("mlx_lm.models.switch_layers", "_scatter_unsort")
    return helper(x, inv_order, shape) if helper is not None else _scatter_unsort(x, inv_order, shape)


def _scatter_unsort(x: mx.array, inv_order: mx.array, shape: tuple | None = None) -> mx.array:
    x = x[inv_order]
    return x if shape is None else x.reshape(*shape, *x.shape[1:])


# ---- the switch modules' call (SwitchGLU / SwitchMLP) ----

# What ``measure.experts.gather.sorted_switch_call`` reads of each switch class, as mlx-lm 0.32 builds them.
SORTED_PARTS = {"SwitchGLU": ("gate_proj", "up_proj", "down_proj", "activation"),
                "SwitchMLP": ("fc1", "fc2", "activation")}


def check_sorted_switch(module) -> None:
    """Refuse ``--gather sorted`` where the switch no longer has the parts its copied call uses,
    or its projections no longer take ``sorted_indices``."""
    base = next((c.__name__ for c in type(module).__mro__ if c.__name__ in SORTED_PARTS), type(module).__name__)
    for part in SORTED_PARTS.get(base, ()):
        if not hasattr(module, part):
            raise incompatible("--gather sorted", f"{base}.{part}")
        if part != "activation" and "sorted_indices" not in inspect.signature(type(getattr(module, part)).__call__).parameters:
            raise incompatible("--gather sorted", f"{type(getattr(module, part)).__name__}(..., sorted_indices=)")


def check_switch_call(cls: type, what: str) -> None:
    """Refuse to wrap a switch class whose call is no longer ``(x, indices, ...)``: the routing
    capture, forcing and expert slicing all take the second argument as the experts chosen."""
    params = list(inspect.signature(cls.__call__).parameters)
    if params[1:3] != ["x", "indices"]:
        raise incompatible(what, f"{cls.__name__}.__call__(x, indices)")


# ---- prompt caches (mlx_lm/models/cache.py) ----


def cache_children(cache) -> tuple:
    """The caches a ``CacheList`` holds."""
    children = getattr(cache, "caches", None)
    if not isinstance(children, (list, tuple)):
        raise incompatible("rolling back a CacheList (hybrid and some MoE models)", "CacheList.caches")
    return tuple(children)


# ---- recurrent layers (mlx_lm/models/gated_delta.py, ssm.py) ----

# The recurrence functions mlx-lm's linear-attention layers call by their module-level name:
# GatedDeltaNet's (Qwen3-Next, Qwen3.5/3.6, Kimi-Linear, OLMo-hybrid) and Mamba2's (Nemotron-H,
# Granite-MoE-hybrid, Falcon-H1). Each takes the running state as ``state`` and returns
# ``(output, new_state)``.
RECURRENCES = ("gated_delta_update", "ssm_update")


def recurrence_sites(model) -> list[tuple[ModuleType, str]]:
    """(module, name) of every recurrence function the model's layers call: a name of
    ``RECURRENCES`` bound in the module that defines one of the model's classes. Empty for a
    model whose recurrent layers compute their state another way (Jamba, Bailing-hybrid)."""
    sites, seen = [], set()
    for _, layer in model.named_modules():
        module = importlib.import_module(type(layer).__module__)
        for name in RECURRENCES:
            function = getattr(module, name, None)
            if callable(function) and (module.__name__, name) not in seen:
                seen.add((module.__name__, name))
                sites.append((module, name))
    return sites


def _recurrences_present() -> bool:
    for module, name in (("mlx_lm.models.qwen3_next", "gated_delta_update"), ("mlx_lm.models.nemotron_h", "ssm_update")):
        function = _lookup(module, name)
        if function is None or "state" not in inspect.signature(function).parameters:
            return False
    return True


# ---- what selftest reports ----


@dataclass(frozen=True)
class PrivateName:
    """One private mlx-lm name the suite uses: where, what uses it, and whether a twin stands in."""

    name: str
    used_by: str
    twin: bool
    present: Callable[[], bool]


def _has(module: str, name: str) -> Callable[[], bool]:
    return lambda: _lookup(module, name) is not None


def _switch_parts_present() -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    try:
        check_sorted_switch(SwitchGLU(4, 4, 2))
        check_sorted_switch(SwitchMLP(4, 4, 2))
    except MlxLmIncompatible:
        return False
    return True


def _switch_call_present() -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    try:
        check_switch_call(SwitchGLU, "")
        check_switch_call(SwitchMLP, "")
    except MlxLmIncompatible:
        return False
    return True


def _cache_list_present() -> bool:
    cache = importlib.import_module("mlx_lm.models.cache")
    try:
        return len(cache_children(cache.CacheList(cache.KVCache()))) == 1
    except (AttributeError, MlxLmIncompatible):
        return False


# The private state layout of each prompt-cache class (mlx_lm/models/cache.py), which
# measure/caches/cache_copy.py copies and rolls back. Each position of a class's ``state`` holds: "rows"
# an array (or None) with the batch on axis 0, "quantized" a tuple of such arrays (packed values, scales, biases), "row list" a list of
# them (ArraysCache's per-layer states), "setting" a number shared by every row.
CACHE_LAYOUTS = {
    "KVCache": ("rows", "rows", "setting"),  # keys, values, offset
    "ConcatenateKVCache": ("rows", "rows"),  # keys, values
    "QuantizedKVCache": ("quantized", "quantized", "setting", "setting", "setting"),  # + group_size, bits
    "RotatingKVCache": ("rows", "rows", "setting", "setting", "setting", "setting"),  # + keep, max_size, _idx
    "ChunkedKVCache": ("rows", "rows", "setting", "setting", "setting"),  # + chunk_size, start_position
    "ArraysCache": ("row list", "rows", "rows"),  # states, left_padding, lengths
}


def _cache_layouts_present() -> bool:
    """Every cache class this mlx-lm has keeps the state layout in ``CACHE_LAYOUTS`` (a class it
    no longer has cannot be met)."""
    cache = importlib.import_module("mlx_lm.models.cache")
    settings = {"RotatingKVCache": {"max_size": 4}, "ChunkedKVCache": {"chunk_size": 4}, "ArraysCache": {"size": 1}}
    try:
        return all(len(getattr(cache, name)(**settings.get(name, {})).state) == len(layout)
                   for name, layout in CACHE_LAYOUTS.items() if hasattr(cache, name))
    except TypeError:  # a constructor that changed
        return False


PRIVATE_NAMES = (
    PrivateName("mlx_lm.utils._get_classes", "building any model", True, _has("mlx_lm.utils", "_get_classes")),
    PrivateName("mlx_lm.models.switch_layers._gather_sort", "sweep --gather sorted", True,
                _has("mlx_lm.models.switch_layers", "_gather_sort")),
    PrivateName("mlx_lm.models.switch_layers._scatter_unsort", "sweep --gather sorted", True,
                _has("mlx_lm.models.switch_layers", "_scatter_unsort")),
    PrivateName("SwitchGLU/SwitchMLP parts and SwitchLinear(sorted_indices=)", "sweep --gather sorted", False,
                _switch_parts_present),
    PrivateName("SwitchGLU/SwitchMLP.__call__(x, indices)",
                "routing, every MoE sweep (its expert counts) and --parallel expert", False, _switch_call_present),
    PrivateName("CacheList.caches", "sweep and SD of models whose caches are CacheLists", False,
                _cache_list_present),
    PrivateName("the layers' module-level gated_delta_update / ssm_update(..., state)",
                "SD --rollback per-position and replay on hybrid models", False, _recurrences_present),
    PrivateName("the state layout of each prompt-cache class", "sweep and SD (copying and rolling back caches)",
                False, _cache_layouts_present),
)


def missing_names() -> list[PrivateName]:
    """The entries of ``PRIVATE_NAMES`` this mlx-lm lacks."""
    return [p for p in PRIVATE_NAMES if not p.present()]
