"""The untimed audit of one SD configuration: how its caches were rolled back, and whether right.

After a configuration's timed pairs, one more decode runs on its first pair's prompt, as the
timed ones did, and ``rollback_audit`` compares both models' caches with plain decoding of the
tokens it emitted. The record (a run's ``rollback``): the strategy that ran (the costliest any
round needed: ``none`` when no round rejected, ``trim``, ``window`` or ``re-forward``), the
strategy asked for, the cache classes of both models, how many rounds each way per model, and
the audit ``{"ok", "max_abs_diff", "tolerance"}`` (with ``reason`` where structure or offsets
differ).

mlx-lm's batch-1 SD (chosen only where every cache trims for the whole decode) leaves its caches
holding the emitted tokens, or all but the last when its decode ended inside an accepted run of
drafts, and its drafter one token fewer when a round accepted every draft: ``exact=False``
compares against plain decoding of as many emitted tokens as each cache holds, within one.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from mac_moesd.inputs.cache_kinds import cache_kinds, leaf_kind, leaves
from mac_moesd.measure.rollback import APPLIED
from mac_moesd.measure.rollback_audit import audit_caches

__all__ = ["audit_configuration"]


def _held(caches, context: int) -> int | None:
    """Tokens past the prompt's held part that the caches hold (None: only recurrent states)."""
    offsets = [leaf.offset for leaf in leaves(caches) if leaf_kind(leaf) != "recurrent"]
    return offsets[0] - context if offsets else None


def _audit(model, caches, prompt: mx.array, emitted: mx.array, exact: bool) -> dict:
    held = _held(caches, prompt.shape[1] - 1)
    if exact or held is None or abs(held - emitted.shape[1]) > 1:
        held = None  # exactly the emitted tokens: a cache holding others fails on its offsets
    return audit_caches(model, caches, prompt, emitted, held)


def _merged(target: dict, draft: dict) -> dict:
    """One audit of both models: ok when both are, the larger difference, the first reason."""
    diffs = [a["max_abs_diff"] for a in (target, draft) if a["max_abs_diff"] is not None]
    out = {"ok": target["ok"] and draft["ok"],
           "max_abs_diff": max(diffs) if len(diffs) == 2 else None,
           "tolerance": max(a["tolerance"] or 0.0 for a in (target, draft)) or None}
    reasons = [f"{who}: {a['reason']}" for who, a in (("target", target), ("drafter", draft)) if "reason" in a]
    if reasons:
        out["reason"] = reasons[0]
    return out


def audit_configuration(decoders, decode: Callable, exact: bool = True) -> dict:
    """Decode once on pair 0's prompt with ``decode(decoder)`` (a ``Decoded``), then audit both
    models' caches; ``decoders`` is the configuration's ``spec.Decoders``."""
    decoders.prepare(0)
    d = decoders.current
    before = {who: dict(r.applied) for who, r in (("target", d.target_rollback), ("draft", d.draft_rollback))}
    out = decode(d)
    rounds = {who: {k: r.applied[k] - before[who][k] for k in APPLIED}
              for who, r in (("target", d.target_rollback), ("draft", d.draft_rollback))}
    emitted = mx.array(out.outputs)
    audits = [_audit(model, caches, d.prompt, emitted, exact)
              for model, caches in ((d.target, d.target_cache), (d.draft, d.draft_cache))]
    used = [name for name in APPLIED if any(r[name] for r in rounds.values())]
    record = {"strategy": used[-1] if used else "none", "requested": decoders.rollback,
              "cache_kinds": sorted(set(cache_kinds(d.target_cache)) | set(cache_kinds(d.draft_cache))),
              "rounds": rounds, "audit": _merged(*audits)}
    decoders.prepare(None)
    return record
