"""Rolling a model's caches back to the tokens an SD round kept, correctly for every cache kind.

A round forwards tokens that it may then reject: the target's verify (the pending token and
gamma drafts), the drafter's gamma one-token steps. mlx-lm's ``trim_prompt_cache`` trims nothing
at all when any layer's cache cannot trim (a recurrent state, a sliding window past its size),
so a loop that relies on it goes on from a context holding the rejected drafts. Here every cache
leaf has a kind (``inputs.cache_kinds``), and a rejection is undone by what that kind allows:

- ``kv`` (``KVCache``, ``QuantizedKVCache``, ``ConcatenateKVCache``, ``ChunkedKVCache``): trimmed.
- ``sliding`` (``RotatingKVCache``): trimmed while the window is not full; past it, after a
  multi-token forward (mlx-lm then keeps ``max_size + S - 1`` entries in temporal order, so
  every one of the S tokens saw its full window), the last entries are cut off: the window is
  still whole for the next token (``window``). After one-token forwards (which overwrite the
  oldest entries in place) nothing can be cut: the leaf is restored from a snapshot.
- ``recurrent`` (``ArraysCache``: GatedDeltaNet and Mamba2 states): the state after the kept
  position, kept during the forwards and selected (``per-position``) or computed again from the
  state before the round over the kept tokens' recurrence inputs (``replay``); see
  ``recurrent_states``. Where the model's layers compute their state in a way the suite does not
  record, restored from a snapshot.

Whenever a leaf is restored, every leaf goes back to where it was before the forwards (kv
leaves by trimming them all) and the kept tokens are forwarded through the whole model again
(``re-forward``, as vllm-mlx's scheduler and llama.cpp's fallback do). Snapshots are free: the
recurrent layers rebind their state arrays, and ``mx.array(x)`` holds x's value while the
in-place window writes go to new buffers (their copy is the cost, inside the round).

``strategy``: ``auto`` takes each round back the cheapest correct way (per position for a
recurrent state); ``per-position`` and ``replay`` choose how a recurrent state goes back (refused,
with the reason, on a model whose state cannot); ``re-forward`` forces the re-forward for every
rejection, on any model: the naive baseline. A cache class not listed is refused with its name:
nothing is measured with a rollback that did nothing.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mac_moesd import mlxlm_compat
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs.cache_kinds import leaf_kind, leaves
from mac_moesd.measure.caches import recurrent_states

__all__ = ["APPLIED", "STRATEGIES", "Rollback", "mlx_lm_can_roll_back"]

# What --rollback offers: each kind's cheapest correct rollback, a recurrent state's two ways back,
# or the re-forward for every one.
STRATEGIES = ("auto", "per-position", "replay", "re-forward")
# How a round was rolled back, cheapest first; a run reports the costliest that happened.
APPLIED = ("none", "trim", "window", "per-position", "replay", "re-forward")


def mlx_lm_can_roll_back(caches, longest: int) -> bool:
    """Whether mlx-lm's batch-1 SD rolls ``caches`` back correctly through a decode that reaches
    ``longest`` tokens (prompt, new tokens and a round's verify): only when every leaf can trim
    for the whole decode, which a sliding window can only while it is not full."""
    for leaf in leaves(caches):
        kind = leaf_kind(leaf)
        if kind == "recurrent" or (kind == "sliding" and longest >= leaf.max_size):
            return False
    return True


def _snapshot(leaf):
    """The values a leaf holds now, safe from the writes that follow (see the module docstring)."""
    if leaf_kind(leaf) == "recurrent":
        return list(leaf.cache), leaf.left_padding, leaf.lengths
    keys, values, offset, keep, max_size, idx = leaf.state
    return mx.array(keys), mx.array(values), offset, keep, max_size, idx


def _restore(leaf, saved) -> None:
    if leaf_kind(leaf) == "recurrent":
        states, left_padding, lengths = saved
        leaf.state = (list(states), left_padding, lengths)
    else:
        leaf.state = saved


def _can_cut(leaf, tokens: int) -> bool:
    """Whether a full sliding window is in the temporal order a multi-token forward leaves (not
    after in-place writes) with ``tokens`` entries to spare beyond its size."""
    keys, _, _, _, max_size, idx = leaf.state
    return keys is not None and idx == keys.shape[2] and idx - tokens >= max_size


def _trims(leaf, tokens: int) -> bool:
    """Whether ``leaf.trim(tokens)`` takes back all ``tokens``: mlx-lm's trims silently take back
    fewer where they cannot (a chunked cache never goes before its chunk's ``start_position``)."""
    return leaf.is_trimmable() and leaf.offset - getattr(leaf, "start_position", 0) >= tokens


def _cut_window(leaf, tokens: int) -> None:
    """Drop the last ``tokens`` entries of a window ``_can_cut`` allows."""
    keys, values, offset, keep, max_size, idx = leaf.state
    leaf.state = (keys[..., : idx - tokens, :], values[..., : idx - tokens, :], offset - tokens, keep,
                  max_size, idx - tokens)


class Rollback:
    """The rollback of one model's caches: ``mark`` before the forwards a round may reject,
    ``undo`` once it knows what it keeps. ``applied`` counts how each round was undone."""

    def __init__(self, model: nn.Module, caches: list, strategy: str = "auto"):
        if strategy not in STRATEGIES:
            raise MacMoesdError(f"unknown rollback strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
        self.model, self.caches, self.strategy = model, caches, strategy
        self.leaves = leaves(caches)
        self.kinds = [leaf_kind(leaf) for leaf in self.leaves]
        self.saved: list | None = None
        self.applied = {name: 0 for name in APPLIED}
        self.states = self._state_log(model, strategy)

    def _state_log(self, model, strategy: str) -> recurrent_states.StateLog | None:
        """How the recurrent leaves go back without a re-forward; None: they have none, or re-forward."""
        recurrent = [leaf for leaf, kind in zip(self.leaves, self.kinds) if kind == "recurrent"]
        if not recurrent or strategy == "re-forward":
            return None
        sites = mlxlm_compat.recurrence_sites(model)
        reason = recurrent_states.unsupported(model, recurrent, sites)
        if reason is not None:
            if strategy != "auto":
                raise BadInput(f"--rollback {strategy} cannot take this model's recurrent state back: {reason}")
            return None
        return recurrent_states.StateLog(sites, recurrent, per_position=strategy != "replay")

    @property
    def recurrent_way(self) -> str | None:
        """How a rejected round takes the recurrent states back: ``per-position``, ``replay``,
        ``re-forward``; None without recurrent leaves."""
        if "recurrent" not in self.kinds:
            return None
        return "re-forward" if self.states is None else ("per-position" if self.states.per_position else "replay")

    def mark(self) -> None:
        """Remember the leaves that may need restoring (none on a model of plain KV caches), and
        start keeping what the recurrent layers go through."""
        self.saved = [None if kind == "kv" else _snapshot(leaf) for leaf, kind in zip(self.leaves, self.kinds)]
        if self.states is not None:
            self.states.open()

    def undo(self, forwarded: int, kept: mx.array) -> str:
        """Go back to the tokens ``kept`` (batch, n) of the ``forwarded`` tokens since ``mark``
        (``kept`` are their first n). Returns how (one of ``APPLIED``)."""
        rejected = forwarded - kept.shape[1]
        if rejected < 0:
            raise ValueError(f"kept {kept.shape[1]} of {forwarded} tokens")
        try:
            how = "none" if rejected == 0 else self._in_place(rejected, kept.shape[1])
        finally:
            if self.states is not None:
                self.states.close()  # before a re-forward, whose forward is not the round's
        if how is None:
            self._reforward(forwarded, kept)
            how = "re-forward"
        self.applied[how] += 1
        return how

    def _in_place(self, rejected: int, kept: int) -> str | None:
        """Trim or cut every leaf back by ``rejected`` tokens and take the recurrent states back
        to ``kept``; None (nothing changed) where a leaf cannot, or where the strategy forces a
        re-forward."""
        if self.strategy == "re-forward" or ("recurrent" in self.kinds and self.states is None):
            return None
        cuts = []
        for leaf, kind in zip(self.leaves, self.kinds):
            if kind == "recurrent":
                continue
            if kind == "sliding" and not leaf.is_trimmable():
                if not _can_cut(leaf, rejected):
                    return None
                cuts.append(leaf)
            elif not _trims(leaf, rejected):
                return None
        for leaf, kind in zip(self.leaves, self.kinds):
            if any(leaf is cut for cut in cuts):
                _cut_window(leaf, rejected)
            elif kind != "recurrent":
                leaf.trim(rejected)
        if self.states is not None:
            self.states.select(kept)
            return self.recurrent_way
        return "window" if cuts else "trim"

    def _reforward(self, forwarded: int, kept: mx.array) -> None:
        if self.saved is None:
            raise MacMoesdError("rollback without a mark: the SD loop must mark before it forwards")
        for leaf, kind, saved in zip(self.leaves, self.kinds, self.saved):
            if kind == "kv":
                if not _trims(leaf, forwarded):
                    raise MacMoesdError(f"a {type(leaf).__name__} cannot take back the {forwarded} tokens of "
                                        "this round (its chunk starts after them), so SD cannot roll it back")
                leaf.trim(forwarded)
            else:
                _restore(leaf, saved)
        self.model(kept, cache=self.caches)
