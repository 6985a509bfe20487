"""The gather what-if of `sweep --gather sorted`: mlx-lm's sorted expert path at every size.

mlx-lm's ``SwitchGLU`` and ``SwitchMLP`` (``mlx_lm/models/switch_layers.py``) sort the (token,
expert) pairs by expert only when ``indices.size >= 64``; below that every pair is its own
gather. ``sorted_switch_call`` is the same call with that threshold at 0: the pairs are sorted
with mlx-lm's own ``_gather_sort``, the projections run with ``sorted_indices=True`` (where the
kernel can read each unique expert once), and ``_scatter_unsort`` restores the token order. Both
helpers are private to mlx-lm, so they come through ``mlxlm_compat``, which has twins of its own
for an mlx-lm without them; a switch whose parts have changed is refused there.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mac_moesd import mlxlm_compat
from mac_moesd.errors import MacMoesdError

__all__ = ["GATHERS", "check_sortable", "sorted_switch_call"]

GATHERS = ("mlx-lm", "sorted")  # as mlx-lm runs it; sorted at every size


def _base(module: nn.Module) -> type:
    return SwitchGLU if isinstance(module, SwitchGLU) else SwitchMLP


def check_sortable(module: nn.Module) -> None:
    """Refuse a switch class that replaces mlx-lm's call (its sorted path would not be ours), or
    one whose parts are no longer those the copied call reads."""
    base = _base(module)
    if not isinstance(module, base) or type(module).__call__ is not base.__call__:
        raise MacMoesdError(f"--gather sorted reproduces mlx-lm's {base.__name__}; "
                            f"{type(module).__name__} has a call of its own")
    mlxlm_compat.check_sorted_switch(module)


def sorted_switch_call(module: nn.Module, x: mx.array, indices: mx.array) -> mx.array:
    """``SwitchGLU.__call__`` / ``SwitchMLP.__call__`` of mlx_lm/models/switch_layers.py with
    ``do_sort`` always true. x: (..., D); indices: (..., k); returns (..., k, D)."""
    x = mx.expand_dims(x, (-2, -3))
    indices = mx.stop_gradient(indices)
    x, idx, inv_order = mlxlm_compat.gather_sort(x, indices)
    if isinstance(module, SwitchGLU):
        x_up = module.up_proj(x, idx, sorted_indices=True)
        x_gate = module.gate_proj(x, idx, sorted_indices=True)
        x = module.down_proj(module.activation(x_up, x_gate), idx, sorted_indices=True)
    else:
        x = module.fc1(x, idx, sorted_indices=True)
        x = module.fc2(module.activation(x), idx, sorted_indices=True)
    return mlxlm_compat.scatter_unsort(x, inv_order, indices.shape).squeeze(-2)
