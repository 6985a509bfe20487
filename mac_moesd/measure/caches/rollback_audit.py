"""The rollback audit: after a decode, the caches must hold what plain decoding of the same tokens holds.

An SD loop forwards drafts and takes back the rejected ones; whatever the rollback did, the
caches it leaves must equal those of the target (and drafter) fed the prompt and then exactly the
tokens the decode emitted. The audit rebuilds them that way, in fresh caches (a prefill of the
prompt, then one forward of the emitted tokens), and compares leaf by leaf: a KV cache up to its
offset, a sliding window over the entries the next token attends to, a recurrent layer's every
state array. Offsets must be equal; values equal within a tolerance relative to the largest
value of each array, by dtype (``TOLERANCE``).

Why those tolerances: the two sides run the same arithmetic in different chunkings (a verify of
gamma+1 tokens against a prefill of all of them), so they differ by float rounding, which grows
with the number of layers a value has passed through: about 1e-6 relative in float32 on the
tiny models, a few units of the last place (2^-11 in float16, 2^-8 in bfloat16) on a GPU. A
rollback that did nothing leaves other tokens' keys, or a state advanced past rejected tokens:
differences of the order of the values themselves (relative 0.1 to 1), or offsets that differ.
"""

from __future__ import annotations

import mlx.core as mx

from mac_moesd.measure.caches.rolled_cache import PREFILL_CHUNK, RolledBackCache
from mac_moesd.inputs.cache_kinds import leaf_kind, leaves

__all__ = ["TOLERANCE", "audit_caches", "compare_caches"]

TOLERANCE = {mx.float32: 1e-3, mx.float16: 3e-2, mx.bfloat16: 6e-2}


def _window(leaf) -> tuple[mx.array, mx.array]:
    """A sliding window's keys and values in temporal order, its last ``max_size - 1`` entries
    (what the next token attends to beside itself)."""
    keys, values, offset, keep, max_size, idx = leaf.state

    def ordered(v):
        if idx == v.shape[2]:
            return v
        if idx < offset:  # rotated: the oldest entries start at idx
            return mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2)
        return v[..., :idx, :]

    held = min(offset, max_size - 1)
    return ordered(keys)[..., -held:, :], ordered(values)[..., -held:, :]


def _arrays(leaf) -> tuple[list, int | None]:
    """The arrays of a leaf the audit compares, and its offset (None for a recurrent state)."""
    kind = leaf_kind(leaf)
    if kind == "recurrent":
        return [a for a in leaf.cache], None
    if kind == "sliding":
        return list(_window(leaf)), leaf.offset
    if type(leaf).__name__ == "QuantizedKVCache":
        if leaf.keys is None:
            return [], leaf.offset
        keys, values = leaf.keys_and_values()
        deq = [mx.dequantize(w, scales, biases, group_size=leaf.group_size, bits=leaf.bits)
               for w, scales, biases in (keys, values)]
        return [a[..., : leaf.offset, :] for a in deq], leaf.offset
    if leaf.keys is None:
        return [], leaf.offset
    keys, values = leaf.keys_and_values()
    return [keys, values], leaf.offset


def compare_caches(measured: list, reference: list) -> dict:
    """``{"ok", "max_abs_diff", "tolerance"}`` over two cache lists of one model, with
    ``reason`` where they differ in structure or offsets. ``max_abs_diff`` is relative to each
    array's largest magnitude (see the module docstring); the worst leaf counts."""
    ours, theirs = leaves(measured), leaves(reference)
    if [type(c).__name__ for c in ours] != [type(c).__name__ for c in theirs]:
        return {"ok": False, "max_abs_diff": None, "tolerance": None, "reason": "cache classes differ"}
    worst, tolerance = 0.0, 0.0
    for position, (a, b) in enumerate(zip(ours, theirs)):
        arrays_a, offset_a = _arrays(a)
        arrays_b, offset_b = _arrays(b)
        if offset_a != offset_b or len(arrays_a) != len(arrays_b):
            return {"ok": False, "max_abs_diff": None, "tolerance": None,
                    "reason": f"cache {position} ({type(a).__name__}) holds {offset_a} tokens, plain decoding {offset_b}"}
        for x, y in zip(arrays_a, arrays_b):
            if (x is None) != (y is None):
                return {"ok": False, "max_abs_diff": None, "tolerance": None,
                        "reason": f"cache {position} ({type(a).__name__}) has a state plain decoding lacks"}
            if x is None:
                continue
            if x.shape != y.shape:
                return {"ok": False, "max_abs_diff": None, "tolerance": None,
                        "reason": f"cache {position} ({type(a).__name__}) shapes {x.shape} and {y.shape}"}
            x32, y32 = x.astype(mx.float32), y.astype(mx.float32)
            if not (mx.isfinite(x32).all() and mx.isfinite(y32).all()).item():  # max() would drop a NaN
                return {"ok": False, "max_abs_diff": None, "tolerance": None,
                        "reason": f"cache {position} ({type(a).__name__}) holds NaN or Inf"}
            scale = max(float(mx.abs(y32).max()), 1e-6)
            worst = max(worst, float(mx.abs(x32 - y32).max()) / scale)
            tolerance = max(tolerance, TOLERANCE.get(x.dtype, TOLERANCE[mx.float32]))
    return {"ok": worst <= tolerance, "max_abs_diff": worst, "tolerance": tolerance}


def _reference(model, prompt: mx.array, emitted: mx.array, held: int) -> list:
    """Fresh caches after the prompt's first n-1 tokens, then the first ``held`` tokens of its
    last and the emitted ones."""
    rolled = RolledBackCache(model, prompt.shape[0], prompt.shape[1] - 1, 0, prompt[:, :-1])
    fed = mx.concatenate([prompt[:, -1:], emitted], axis=1)[:, :held]
    for start in range(0, fed.shape[1], PREFILL_CHUNK):
        model(fed[:, start : start + PREFILL_CHUNK], cache=rolled.cache)
        mx.eval([c.state for c in rolled.cache])
    return rolled.cache


def audit_caches(model, caches: list, prompt: mx.array, emitted, held: int | None = None) -> dict:
    """``compare_caches`` of ``caches`` (a decode's, left as it ended) against plain decoding of
    ``prompt`` (batch, n) and then the ``emitted`` tokens (batch, m) (untimed). The caches hold
    the prompt's first n-1 tokens and then ``held`` more (default m: its last and every emitted
    token but the pending one)."""
    emitted = mx.array(emitted)
    mx.eval([c.state for c in caches])
    return compare_caches(caches, _reference(model, prompt, emitted, emitted.shape[1] if held is None else held))
