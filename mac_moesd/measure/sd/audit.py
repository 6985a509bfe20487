"""The untimed audit of one SD configuration: how its caches were rolled back, and whether right.

After a configuration's timed pairs, one more decode runs on its first pair's prompt, as the
timed ones did, and ``rollback_audit`` compares both models' caches with plain decoding of the
tokens it emitted. The record (a run's ``rollback``): the strategy that ran (the costliest any
round needed: ``none`` when no round rejected, ``trim``, ``window``, ``per-position``,
``replay`` or ``re-forward``), the strategy asked for, the cache classes of both models, how many
rounds each way per model, and the audit ``{"ok", "max_abs_diff", "tolerance"}`` (with
``reason`` where structure or offsets differ).

mlx-lm's batch-1 SD (chosen only where every cache trims for the whole decode) leaves its caches
holding the emitted tokens, or all but the last when its decode ended inside an accepted run of
drafts, and its drafter one token fewer when a round accepted every draft: ``exact=False``
compares against plain decoding of as many emitted tokens as each cache holds, within one.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from mac_moesd.inputs.cache_kinds import cache_kinds, leaf_kind, leaves
from mac_moesd.measure.caches.rollback import APPLIED
from mac_moesd.measure.caches.rollback_audit import audit_caches
from mac_moesd.results import schema

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


def _merged(audits: dict[str, dict]) -> schema.RollbackAudit:
    """One audit of the models (``{"target": ..., "drafter": ...}``): ok when all are, the largest
    difference, the first reason."""
    diffs = [a["max_abs_diff"] for a in audits.values() if a["max_abs_diff"] is not None]
    out: schema.RollbackAudit = {"ok": all(a["ok"] for a in audits.values()),
           "max_abs_diff": max(diffs) if len(diffs) == len(audits) else None,
           "tolerance": max(a["tolerance"] or 0.0 for a in audits.values()) or None}
    reasons = [f"{who}: {a['reason']}" for who, a in audits.items() if "reason" in a]
    if reasons:
        out["reason"] = reasons[0]
    return out


def audit_configuration(decoders, decode: Callable, exact: bool = True) -> schema.RollbackRecord:
    """Decode once on pair 0's prompt with ``decode(decoder)`` (a ``Decoded``), then audit the
    models' caches (the target's alone where prompt lookup or an MTP head drafts); ``decoders``
    is the configuration's ``speedup.Decoders``."""
    decoders.prepare(0)
    d = decoders.current
    models = {"target": (d.target, d.target_cache, d.target_rollback)}
    if d.draft is not None:
        models["draft"] = (d.draft, d.draft_cache, d.draft_rollback)
    # An MTP head's states come from the target's hidden states, which a replay of the emitted
    # tokens through the head alone cannot give: its rounds are counted, its cache not compared.
    replayed = {who: m for who, m in models.items() if not hasattr(m[0], "capture")}
    before = {who: dict(r.applied) for who, (_, _, r) in models.items()}
    out = decode(d)
    rounds = {who: {k: r.applied[k] - before[who][k] for k in APPLIED} for who, (_, _, r) in models.items()}
    emitted = mx.array(out.outputs)
    audits = {"drafter" if who == "draft" else who: _audit(model, caches, d.prompt, emitted, exact)
              for who, (model, caches, _) in replayed.items()}
    used = [name for name in APPLIED if any(r[name] for r in rounds.values())]
    kinds = set(cache_kinds(d.target_cache)) | set(cache_kinds(d.draft_cache))
    record: schema.RollbackRecord = {"strategy": used[-1] if used else "none", "requested": decoders.rollback,
              "cache_kinds": sorted(kinds), "rounds": rounds, "audit": _merged(audits)}
    decoders.prepare(None)
    return record
