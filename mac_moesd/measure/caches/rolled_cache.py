"""A prompt cache prefilled once and rolled back after every timed forward.

The sweep times forwards over it (and over copies of its first rows, one prefill serving every
smaller batch), and the SD loops decode from it and go back to the prefill between runs. Every
cache class of mlx-lm 0.32 is handled (``cache_copy``): a cache of plain KV layers is trimmed back;
one with a sliding window or a recurrent state (which may not trim, or trim nothing at all) is
restored from a snapshot; the offsets are checked after every rollback.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mac_moesd.errors import MacMoesdError
from mac_moesd.measure.caches import cache_copy
from mac_moesd.inputs.cache_kinds import leaf_kind, leaves

__all__ = ["PREFILL_CHUNK", "RolledBackCache", "batch_caches"]

PREFILL_CHUNK = 512  # tokens per prefill forward


class RolledBackCache:
    """A prompt cache prefilled to ``context``; ``rollback`` undoes the last forward, ``reset``
    everything since the prefill. ``prompt`` (batch, context) defaults to random token ids. Every
    cache class of mlx-lm 0.32 is handled (``cache_copy``); another is refused when copied.

    ``also_at``: a shorter context ``shortened`` will be asked for. A cache that cannot trim back
    to it (a recurrent state, a full window) is copied when the prefill passes it, so the same
    prompt at the shorter context needs no second prefill."""

    def __init__(self, model, batch: int, context: int, vocab: int, prompt: mx.array | None = None,
                 also_at: int | None = None):
        self.cache = make_prompt_cache(model)
        self.batch, self.context = batch, context
        # Only plain KV layers trim back whatever the decode did (a window stops trimming once
        # full; a recurrent state never trims, and mlx-lm then trims no layer at all).
        self.trimmable = all(leaf_kind(leaf) == "kv" for leaf in leaves(self.cache))
        self.short: tuple[int, list] | None = None  # (context, copies of the caches there)
        if prompt is None:
            prompt = mx.random.randint(0, vocab, (batch, context))
        cuts = set(range(0, context, PREFILL_CHUNK))
        if also_at and not self.trimmable and 0 < also_at < context:
            cuts.add(also_at)
        bounds = sorted(cuts) + [context]
        for start, end in zip(bounds, bounds[1:]):
            model(prompt[:, start:end], cache=self.cache)
            mx.eval([c.state for c in self.cache])
            if end == also_at and not self.trimmable:
                self.short = (end, [cache_copy.copy_cache(c) for c in self.cache])
                mx.eval(cache_copy.arrays(self.short[1]))
        # Snapshot for the others: copies, since the caches write their arrays in place.
        self.snapshot = None if self.trimmable else [cache_copy.copy_cache(c) for c in self.cache]

    def rollback(self, tokens: int, settle: bool = True) -> None:
        """Undo the last ``tokens`` tokens. A cache that does not trim goes back leaf by leaf: KV
        leaves (and windows not yet full) are trimmed, recurrent states take back the snapshot's
        arrays themselves (the recurrent layers rebind their state, never write into it, so the
        snapshot stays exact at no cost), and a full window gets a copy of the snapshot's (its
        one-token writes go into its buffer in place). With ``settle`` the copies are made now,
        so that their cost lands here (untimed) and not in the next forward; a pipelined chain,
        which must not wait, passes False."""
        if self.trimmable:
            trim_prompt_cache(self.cache, tokens)
        else:
            copied = []
            for leaf, saved in zip(leaves(self.cache), leaves(self.snapshot)):
                kind = leaf_kind(leaf)
                if kind == "kv" or (kind == "sliding" and leaf.is_trimmable()):
                    leaf.trim(tokens)
                elif kind == "recurrent":
                    leaf.cache = list(saved.cache)
                else:
                    cache_copy.restore(leaf, saved)
                    copied += cache_copy.arrays([leaf])
            if settle and copied:
                mx.eval(copied)
        offsets = set(cache_copy.offsets(self.cache))
        if offsets - {self.context}:
            raise MacMoesdError(f"KV cache not restored: offsets {sorted(offsets)}, want {self.context}")

    def reset(self) -> None:
        self.rollback(max(cache_copy.offsets(self.cache), default=self.context) - self.context)

    def rows(self, batch: int) -> RolledBackCache:
        """The first ``batch`` sequences as a cache of their own (copies of their rows: every
        per-sequence array holds the batch on axis 0), so one prefill serves every smaller batch."""
        self.reset()
        out = object.__new__(RolledBackCache)
        out.batch, out.context, out.trimmable, out.short = batch, self.context, self.trimmable, None
        out.cache = [cache_copy.copy_cache(c, batch) for c in self.cache]
        out.snapshot = None if self.snapshot is None else [cache_copy.copy_cache(s, batch) for s in self.snapshot]
        mx.eval(cache_copy.arrays(out.cache), cache_copy.arrays(out.snapshot or []))
        return out

    def shortened(self, batch: int, context: int) -> RolledBackCache | None:
        """The first ``batch`` sequences trimmed back to their first ``context`` tokens, as a cache
        of their own: the same prompt at a shorter context, with no second prefill. A cache that
        does not trim gives the copy its prefill made there (``also_at``); None where it made none."""
        if not self.trimmable:
            if self.short is None or self.short[0] != context:
                return None
            out = object.__new__(RolledBackCache)
            out.batch, out.context, out.trimmable, out.short = batch, context, False, None
            out.cache = [cache_copy.copy_cache(c, batch) for c in self.short[1]]
            out.snapshot = [cache_copy.copy_cache(c, batch) for c in self.short[1]]
            mx.eval(cache_copy.arrays(out.cache), cache_copy.arrays(out.snapshot))
            return out
        out = self.rows(batch)
        trim_prompt_cache(out.cache, self.context - context)
        if set(cache_copy.offsets(out.cache)) != {context}:
            return None
        out.context = context
        return out

    def state(self) -> list:
        return [c.state for c in self.cache]


def batch_caches(parent: RolledBackCache, batches) -> dict[int, RolledBackCache]:
    """A cache per batch on one prefill: ``parent`` for its own batch, copies of its first rows
    for the smaller ones (made largest first, before anything is timed)."""
    return {b: parent if b == parent.batch else parent.rows(b) for b in sorted(set(batches), reverse=True)}
