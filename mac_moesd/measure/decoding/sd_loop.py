"""The suite's own speculative-decoding loop, for any batch (mlx-lm has none for batch > 1).

One round: gamma drafter steps, one verify forward of gamma+1 tokens (the pending token and the
drafts), an acceptance decision, and a KV rollback. Modes: ``real`` (the drafter's own tokens,
accepted as mlx-lm accepts them: at temperature 0 while they equal the target's argmax; above it
while they equal the token the target samples at each position, mlx_lm/generate.py's
``speculative_generate_step``), ``self-draft`` (draft = target, everything accepted) and
``emulated-acceptance`` (each draft token accepted with probability alpha, after paying for
rejection sampling, so the system cost of SD at any alpha is measured on random-weight models).

Random-weight models decode into loops of one or two repeated tokens, which route every position
of a window to the same experts and make verify forwards cheaper than any real text would. In
``emulated-acceptance`` mode, where the drafted tokens decide nothing, the loop emits random ids
(``sampling.random_ids``), as the sweep's points are fed.

Sequences of a batch accept different counts; the caches are rolled back to the batch's shortest
accepted prefix. What the loop emits (``Decoded.outputs``) is that shared prefix and the token
after it, a valid continuation for every sequence, so at temperature 0 it must equal plain greedy
decoding. With real drafts (a drafter's, self-draft's or the context's own) each sequence is
credited what it emitted: a row that accepted more verifies those tokens again next round, and
crediting them then too would count tokens no sequence emitted (43% too many at B = 4 with
prompt lookup). So a real-mode run at B > 1 measures this loop, a lower bound on an engine that
rolls each row back on its own. With emulated acceptance each sequence is credited its own
accepted tokens: its draws are fresh every round, so the count is what a per-row rollback
would give, and lengths that differ by at most gamma tokens do not change the cost of a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import numpy as np
from mac_moesd.measure.clock import timing
from mac_moesd.measure.decoding.prompt_lookup import PromptLookup
from mac_moesd.measure.caches.rollback import Rollback
from mac_moesd.measure.decoding.sampling import random_ids, rejection_sample
from mac_moesd.measure.caches.rolled_cache import RolledBackCache
from mac_moesd.results import schema

__all__ = ["Decoded", "Decoder", "PHASES", "accept", "advance", "common_prompt"]

# A round's phases in the order the loop runs them (``Decoder.speculative``'s ``on_phase``); the
# names of the round parts each stands beside (``round_parts``), and the drafter's catch-up step.
PHASES = ("draft", "verify", "reject", "bookkeeping", "rollback", "catch_up")

RuleProbs = dict[str, tuple[list[np.ndarray], list[np.ndarray]]]  # rule -> rows of (token, position) probs


@dataclass
class Decoded:
    """What one decode produced: tokens credited (all sequences), the draft tokens each sequence
    accepted in each round, the emitted token ids per sequence, the verify forwards it ran (its
    rounds; 0 for a plain decode), and, when asked for at
    temperature > 0, each rule's acceptance probabilities per round and position (rows of
    ``analysis.acceptance.expected_rounds``'s inputs)."""

    tokens: int
    per_round: list[int] = field(default_factory=list)
    outputs: np.ndarray | None = None  # (batch, emitted)
    rule_probs: RuleProbs | None = None  # rule -> (token_probs, position_probs)
    verifies: int = 0
    # Prompt lookup: draft tokens each sequence was offered in each round (as ``per_round``),
    # each round's verify width (its longest proposal), the host seconds its lookups took, and
    # the rounds that rolled back.
    proposed: list[int] | None = None
    widths: list[int] | None = None
    lookup_s: float = 0.0
    rounds_rolled_back: int = 0


def common_prompt(prompts: list[list[int]]) -> mx.array:
    """A (batch, n) prompt from token lists of different lengths: each cut to the batch's
    shortest, keeping its end, so every sequence continues from where its prompt ends."""
    n = min(len(p) for p in prompts)
    return mx.array([p[len(p) - n :] for p in prompts])


def sample(logits: mx.array, temperature: float) -> mx.array:
    """Greedy at temperature 0, else a draw from softmax(logits / temperature) (last axis)."""
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits * (1.0 / temperature), axis=-1)


def within(logits: mx.array, vocab: int | None) -> mx.array:
    """``logits`` cut to the first ``vocab`` ids where they are wider (no copy otherwise)."""
    return logits if vocab is None or logits.shape[-1] <= vocab else logits[..., :vocab]


class Decoder:
    """A target and a drafter with caches prefilled to the same prompt, for one batch.

    ``prompt`` (batch, n): the caches hold its first n-1 tokens, the last is the pending token
    the first forward consumes. ``random_tokens`` (a vocabulary size): emit uniformly random ids
    instead of the models' choices (emulated acceptance). ``rollback``: ``rollback.STRATEGIES``.
    ``vocab``: the ids both models read (the smaller vocabulary of the two; None when they
    match): every token is chosen among them, so neither model is fed an id past its embedding
    (a drafter padded wider than its target, or the reverse, is common)."""

    def __init__(self, target, draft, prompt: mx.array, random_tokens: int | None = None,
                 rollback: str = "auto", vocab: int | None = None, lookup: schema.LookupRule | None = None):
        self.target, self.draft = target, draft
        self.random_tokens, self.vocab = random_tokens, vocab
        self.prompt = prompt
        self.batch, length = prompt.shape
        self.context = length - 1
        held = prompt[:, :-1]
        self.target_rolled = RolledBackCache(target, self.batch, self.context, 0, held)
        self.target_cache = self.target_rolled.cache
        self.target_rollback = Rollback(target, self.target_cache, rollback)
        # A drafter model has caches of its own; prompt lookup (``draft`` None) only contexts.
        self.lookup = None if lookup is None else PromptLookup(np.array(prompt), lookup)
        self.draft_rolled = None if draft is None else RolledBackCache(draft, self.batch, self.context, 0, held)
        self.draft_cache = [] if self.draft_rolled is None else self.draft_rolled.cache
        self.draft_rollback = None if draft is None else Rollback(draft, self.draft_cache, rollback)
        # An MTP head drafts from the hidden state of the target's verify (``mtp_head.MTPHead``).
        capture = getattr(draft, "capture", None)
        self.verifier = target if capture is None else capture(target)
        self.pending = prompt[:, -1:]

    def reset(self) -> None:
        """Back to the prefilled prompt (between timed runs)."""
        self.target_rolled.reset()
        if self.draft_rolled is not None:
            self.draft_rolled.reset()
        if self.lookup is not None:
            self.lookup.reset()

    def plain(self, steps: int, temperature: float = 0.0) -> Decoded:
        """One-token steps of the target alone, each next step built while the current one
        runs, as mlx-lm's generate_step does."""
        emitted = timing.pipelined(
            lambda x: self.emit(self.target(x, cache=self.target_cache)[:, -1:], temperature), self.pending, steps)
        mx.eval(emitted[-1])
        return Decoded(steps * self.batch, outputs=np.array(mx.concatenate(emitted, axis=1)))

    def emit(self, logits: mx.array, temperature: float) -> mx.array:
        """The token at each position: ``sample``'s, or with ``random_tokens`` that shifted by a
        uniform random offset (uniform over the vocabulary, still computed from the logits)."""
        token = sample(within(logits, self.vocab), temperature)
        return token if self.random_tokens is None else random_ids(token, self.random_tokens)

    def speculative(self, new_tokens: int, gamma: int, mode: str, alpha: float | None = None,
                    temperature: float = 0.0, rules: bool = False,
                    rng: np.random.Generator | None = None,
                    on_phase: Callable[[str], None] | None = None) -> Decoded:
        """Rounds until every sequence has ``new_tokens``. ``rules`` (temperature > 0, ``real``)
        also records each acceptance rule's probabilities; ``rng`` draws emulated acceptance.
        With prompt lookup, ``lookup_rounds``. ``on_phase`` (a diagnostic, never in a timed SD
        run): the loop waits for each phase of a round (``PHASES``) and then calls it with the
        phase's name, so that each can be timed on its own (``benchmarks/round_phases.py``)."""
        if self.lookup is not None:
            return self.lookup_rounds(new_tokens, gamma, temperature)

        def phase(name: str, *arrays) -> None:
            if on_phase is not None:
                mx.eval(*arrays)
                on_phase(name)

        produced = np.zeros(self.batch, dtype=int)
        per_round: list[int] = []
        emitted: list[mx.array] = []
        probs: RuleProbs | None = {"mlx-lm": ([], []), "rejection": ([], [])} if rules and temperature > 0 else None
        draft_rollback = self.draft_rollback
        assert draft_rollback is not None  # a drafter model (prompt lookup went to lookup_rounds)
        y = self.pending
        while produced.min() < new_tokens:
            x, drafts, draft_logits = y, [], []
            draft_rollback.mark()
            for _ in range(gamma):  # each draft step queued as built, as mlx-lm's _draft_generate
                logits = self.draft(x, cache=self.draft_cache)[:, -1:]
                x = self.emit(logits, temperature)
                mx.async_eval(x)
                drafts.append(x)
                draft_logits.append(logits)
            phase("draft", drafts, draft_logits)
            drafts_arr = mx.concatenate(drafts, axis=1)
            self.target_rollback.mark()
            verify = self.verifier(mx.concatenate([y, drafts_arr], axis=1), cache=self.target_cache)
            phase("verify", verify)
            # The target's token at every position: its argmax, or (mlx-lm's rule) its own sample.
            chosen = self.emit(verify, temperature)  # (B, gamma+1)
            extra = []
            if mode == "emulated-acceptance":  # pay for rejection sampling, then accept with alpha
                extra = [rejection_sample(within(verify, self.vocab),
                                          within(mx.concatenate(draft_logits, axis=1), self.vocab), drafts_arr)[0]]
            elif probs is not None:
                extra = _rule_probabilities(verify[:, :gamma], mx.concatenate(draft_logits, axis=1),
                                            drafts_arr, temperature)
            phase("reject", extra)
            accepted = accept(chosen, drafts_arr, mode, alpha, rng, extra)
            if probs is not None:
                for (token_list, position_list), token_p, position_p in zip(
                        probs.values(), extra[0::2], extra[1::2]):
                    token_list.extend(np.array(token_p))
                    position_list.extend(np.array(position_p))
            shared, kept, next_y, pieces = advance(y, chosen, drafts_arr, accepted)
            phase("bookkeeping", kept, next_y, *pieces)
            self.target_rollback.undo(gamma + 1, kept)
            draft_rollback.undo(gamma, kept[:, :gamma])  # all kept: nothing to undo
            phase("rollback", [c.state for c in self.target_cache], [c.state for c in self.draft_cache])
            if shared == gamma:  # the drafter never saw its last token: feed it, as mlx-lm does
                self.draft(drafts[-1], cache=self.draft_cache)
                phase("catch_up", [c.state for c in self.draft_cache])
            if mode != "emulated-acceptance":
                accepted = np.full(self.batch, shared)  # what each sequence emitted (module docstring)
            produced += accepted + 1
            per_round += [int(a) for a in accepted]
            y = next_y
            emitted += pieces
        # A last round that accepted every draft leaves the drafter's catch-up forward queued in
        # its cache only: evaluate it here, inside the timed run, not in the next one.
        outputs = np.array(mx.concatenate(emitted, axis=1))
        mx.eval([c.state for c in self.draft_cache])
        return Decoded(int(produced.sum()), per_round, outputs, probs, verifies=len(per_round) // self.batch)


    def lookup_rounds(self, new_tokens: int, gamma: int, temperature: float = 0.0) -> Decoded:
        """Rounds drafted by prompt lookup: each sequence's proposal (up to gamma tokens, perhaps
        none), one verify of the pending token and the batch's longest proposal (shorter ones
        padded, their padding never accepted; no proposal anywhere: a one-token step), tokens
        accepted as in ``real`` mode, and the batch rolled back to its shortest accepted prefix."""
        produced = np.zeros(self.batch, dtype=int)
        per_round, proposed, widths, emitted = [], [], [], []
        lookup_s, rolled_back = 0.0, 0
        lookup = self.lookup
        assert lookup is not None
        y = self.pending
        while produced.min() < new_tokens:
            start = time.perf_counter()
            proposals = lookup.propose(gamma)
            lookup_s += time.perf_counter() - start
            lengths = np.array([p.size for p in proposals])
            width = int(lengths.max())
            padded = np.zeros((self.batch, width), dtype=np.int64)
            for row, p in enumerate(proposals):
                padded[row, : p.size] = p
            drafts_arr = mx.array(padded, dtype=y.dtype)
            self.target_rollback.mark()
            verify = self.target(mx.concatenate([y, drafts_arr], axis=1), cache=self.target_cache)
            chosen = self.emit(verify, temperature)  # (B, width+1)
            accepted = accept(chosen, drafts_arr, "real", offered=lengths)
            shared, kept, y, pieces = advance(y, chosen, drafts_arr, accepted)
            rolled_back += self.target_rollback.undo(width + 1, kept) != "none"
            produced += shared + 1  # what each sequence emitted (module docstring)
            per_round += [shared] * self.batch
            proposed += [int(n) for n in lengths]
            widths.append(width)
            emitted += pieces
            lookup.extend(np.concatenate([padded[:, :shared], np.array(y)], axis=1))
        outputs = np.array(mx.concatenate(emitted, axis=1))
        return Decoded(int(produced.sum()), per_round, outputs, verifies=len(widths), proposed=proposed,
                       widths=widths, lookup_s=lookup_s, rounds_rolled_back=int(rolled_back))


def accept(chosen: mx.array, drafts: mx.array, mode: str, alpha: float | None = None,
           rng: np.random.Generator | None = None, evaluate: list | None = None,
           offered: np.ndarray | None = None) -> np.ndarray:
    """The draft tokens each sequence accepts, after the round's one synchronisation (``chosen``,
    the target's token at every position, ``drafts`` and whatever else the round evaluates):
    ``real``, while the drafts equal the target's tokens (``offered``: each row's proposal length,
    its padding never accepted); ``self-draft``, all (the target drafts for itself: an argmax
    comparison could differ on float16 near-ties, not in what it means); ``emulated-acceptance``,
    each with probability ``alpha``."""
    mx.eval(chosen, drafts, *(evaluate or []))
    batch, gamma = drafts.shape
    if mode == "emulated-acceptance":
        assert rng is not None and alpha is not None, "emulated acceptance draws from rng at alpha"
        return np.cumprod(rng.random((batch, gamma)) < alpha, axis=1).sum(axis=1)
    if mode == "self-draft":
        return np.full(batch, gamma)
    matches = np.array(chosen[:, :gamma]) == np.array(drafts)
    if offered is not None:
        matches &= np.arange(gamma) < offered[:, None]
    return np.cumprod(matches, axis=1).sum(axis=1)


def advance(pending: mx.array, chosen: mx.array, drafts: mx.array, accepted: np.ndarray):
    """The round's outcome for a batch rolled back to its shortest accepted prefix: (that prefix's
    length, the tokens both caches keep, the next pending token, what the round emits). For rows
    that accepted more than the prefix, the target's token after it equals their draft."""
    shared = int(accepted.min())
    kept = mx.concatenate([pending, drafts[:, :shared]], axis=1)
    following = chosen[:, shared : shared + 1]
    return shared, kept, following, [drafts[:, :shared], following]


def _rule_probabilities(target_logits: mx.array, draft_logits: mx.array, drafts: mx.array,
                        temperature: float) -> list[mx.array]:
    """Per (sequence, position): mlx-lm's rule p(x) and sum_x p q; rejection sampling's
    min(1, p(x)/q(x)) and sum_x min(p, q). Vocabularies of different sizes are compared on
    their common ids (the larger one's extra ids have probability 0 in the other)."""
    vocab = min(target_logits.shape[-1], draft_logits.shape[-1])
    scale = 1.0 / temperature
    p = mx.softmax(target_logits.astype(mx.float32) * scale, axis=-1)[..., :vocab]
    q = mx.softmax(draft_logits.astype(mx.float32) * scale, axis=-1)[..., :vocab]
    index = drafts[..., None]
    p_x = mx.take_along_axis(p, index, axis=-1)[..., 0]
    q_x = mx.take_along_axis(q, index, axis=-1)[..., 0]
    return [p_x, (p * q).sum(axis=-1),
            mx.minimum(1.0, p_x / mx.maximum(q_x, 1e-30)), mx.minimum(p, q).sum(axis=-1)]
