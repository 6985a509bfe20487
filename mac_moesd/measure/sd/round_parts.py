"""The parts of one SD round, timed inside the SD stage beside its (plain, SD) pairs.

A prediction from the sweep's grid, minutes earlier in another process, carries the machine's
drift between the two (10-18% between processes on a 2-core Linux box). So after each timed pair
the SD stage also times, on the same decoder (same prompt, same caches, rolled back), in shuffled
order, the forwards a round is made of:

- ``verify``: the target's forward of gamma+1 tokens per sequence, synchronous (keeping every
  position's recurrent state where the rollback selects one: ``recurrent_states``);
- ``target_step``: the target's one-token forward, synchronous (only to tell what pipelining
  hides from the verify: the plain decode beside it is the pipelined one-token step);
- ``draft``: gamma drafter steps chained as the loops draft (each queued as built, none waited
  for until the chain's end), the whole draft phase of a round, after an untimed verify of the
  target as in a round (``draft_chain``: the target's forward leaves the drafter a slower start);
- ``draft_caught_up`` (the suite's loop, ``CAUGHT_UP``): the same after a round that accepted
  every draft, whose last draft the loop feeds the drafter first, queued before the chain;
- ``reject``: rejection sampling at the batch, where the loop runs it (emulated acceptance);
- ``rollback``: both models' caches taken back after a round that kept half its drafts
  (``rollback.Rollback``: a trim, a window cut, a recurrent state selected or replayed, or a
  restore and re-forward of the kept tokens),
  the verify and draft forwards before it untimed;
- ``bookkeeping``: the round's own work besides its forwards, an "empty round" through the
  functions the suite's loop calls, or at batch 1 under mlx-lm a replica of its per-round Python
  (``bookkeeping``).

``round_prediction`` turns their medians, the plain decode's own step and the acceptance the
run realised into MoESD's S(B, gamma) (docs/design.md: the speedup formula):
  S = Omega * T_plain / (T_draft + T_verify,pipelined + T_rej + P_reject * T_rollback + T_book),
  T_draft = P_reject * draft + (1 - P_reject) * draft_caught_up in the suite's loop,
  T_verify,pipelined = T_verify - min(T_step - T_plain, T_step / 2), at least 0 hidden,
  P_reject = 1 - alpha^(gamma B): the chance that some sequence of the batch rejects a draft.
The forwards run at the prompt's context, the decode at a mean context new_tokens/2 longer; the
difference is the KV term over those tokens, small beside a forward for the runs timed here.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import mlx.core as mx

from mac_moesd.analysis import theory
from mac_moesd.inputs.cache_kinds import leaf_kind, leaves
from mac_moesd.measure.caches import recurrent_states
from mac_moesd.measure.clock import timing
from mac_moesd.measure.caches.rolled_cache import RolledBackCache
from mac_moesd.measure.caches.rollback import Rollback
from mac_moesd.measure.decoding.bookkeeping import bookkeeping_point, mlx_lm_bookkeeping
from mac_moesd.measure.forward.draft_chain import chain_point
from mac_moesd.measure.forward.points import forward_point, reject_point

__all__ = ["CAUGHT_UP", "RoundParts", "VERIFY_AT", "lookup_prediction", "round_prediction"]

VERIFY_AT = "verify_{}"  # the sample name of a verify of that many tokens (prompt lookup's widths)
CAUGHT_UP = "draft_caught_up"  # the drafting of a round after one that accepted every draft


@dataclass
class RoundParts:
    """Samples (seconds) of each part of a round at one (batch, gamma), one per timed pair."""

    batch: int
    gamma: int
    vocab: int
    with_reject: bool
    rollback: str = "auto"  # rollback.STRATEGIES
    mode: str = "real"  # the loop's acceptance (sd_loop.accept)
    mlx_lm: bool = False  # batch 1 under mlx-lm's own speculative decoding
    samples: dict[str, list[float]] = field(default_factory=dict)
    _verify_keeps_states: bool | None = field(default=None, init=False, repr=False)  # decided at the first sample

    def time(self, target, draft, target_cache: RolledBackCache, draft_cache: RolledBackCache | None,
             rng: random.Random, emit: Callable[[mx.array], mx.array] | None = None) -> None:
        """One sample of every part, in shuffled order, on caches at the prompt's context (each
        part rolls its cache back after itself). ``draft`` None: prompt lookup, whose rounds
        verify 1 to gamma+1 tokens (each width timed; ``VERIFY_AT``) and whose drafting is the
        lookup's host time, timed inside the SD runs (``lookup_samples``)."""
        points = {
            "verify": forward_point(target, target_cache, self.batch, self.gamma + 1, self.vocab),
            "target_step": forward_point(target, target_cache, self.batch, 1, self.vocab),
        }
        if draft is None:
            points.update({VERIFY_AT.format(tokens): forward_point(target, target_cache, self.batch, tokens, self.vocab)
                           for tokens in range(2, self.gamma + 1)})
        else:
            assert draft_cache is not None  # a drafter model has its caches
            points["draft"] = chain_point(target, target_cache, draft, draft_cache, self.batch, self.gamma, self.vocab)
            if not self.mlx_lm:  # the suite's loop feeds the drafter its last draft (round_prediction)
                points[CAUGHT_UP] = chain_point(target, target_cache, draft, draft_cache, self.batch, self.gamma,
                                                self.vocab, catch_up=True)
        if self.with_reject:
            points["reject"] = reject_point(self.batch, self.gamma, self.vocab)
        if emit is not None:
            points["bookkeeping"] = (mlx_lm_bookkeeping(self.gamma, self.vocab) if self.mlx_lm else
                                     bookkeeping_point(self.batch, self.gamma, self.vocab, self.mode, emit))
        timers: dict[str, Callable[[], float]] = {name: partial(timing.finite_time, point)
                                                  for name, point in points.items()}
        if self._verify_keeps_states is None:
            self._verify_keeps_states = Rollback(target, target_cache.cache, self.rollback).recurrent_way == "per-position"
        if self._verify_keeps_states:
            for name in [n for n in points if n == "verify" or n.startswith("verify_")]:
                timers[name] = _keeping_every_state(target, target_cache, timers[name])
        timers["rollback"] = rollback_timer(target, draft, target_cache, draft_cache, self.batch, self.gamma,
                                            self.vocab, self.rollback)
        names = list(timers)
        rng.shuffle(names)
        for name in names:
            self.samples.setdefault(name, []).append(timers[name]())
        mx.synchronize()

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.samples.items()}

    def lookup_samples(self, decodes) -> None:
        """The drafting part of prompt-lookup rounds: each timed SD decode's lookup host seconds
        per round (``Decoded.lookup_s`` over its rounds)."""
        self.samples["draft"] = [d.lookup_s / len(d.widths) for d in decodes]

    def verify_at(self, tokens: int) -> float:
        """The median synchronous forward of ``tokens`` tokens per sequence (1 .. gamma+1)."""
        medians = self.medians()
        if tokens == 1:
            return medians["target_step"]
        return medians["verify" if tokens == self.gamma + 1 else VERIFY_AT.format(tokens)]

    def to_dict(self) -> dict:
        medians = self.medians()
        return {"samples": len(self.samples.get("verify", [])),
                "median_s": {k: v for k, v in medians.items() if not k.startswith("verify_")},
                **({"verify_by_tokens": {k.removeprefix("verify_"): v for k, v in medians.items()
                                         if k.startswith("verify_")}}
                   if any(k.startswith("verify_") for k in medians) else {})}


def _keeping_every_state(target, cache: RolledBackCache, timer: Callable[[], float]) -> Callable[[], float]:
    """A verify timer whose forward keeps every position's recurrent state, as the verify of a
    per-position rollback does (``recurrent_states``)."""
    recurrent = [leaf for leaf in leaves(cache.cache) if leaf_kind(leaf) == "recurrent"]

    def sample() -> float:
        with recurrent_states.per_position_forwards(target, recurrent):
            return timer()

    return sample


def rollback_timer(target, draft, target_cache: RolledBackCache, draft_cache: RolledBackCache | None, batch: int,
                   gamma: int, vocab: int, strategy: str) -> Callable[[], float]:
    """One sample (seconds) of both models' rollback after a round that kept the pending token and
    half the drafts: the drafter's gamma steps and the target's verify run untimed before it, the
    rollback (and the re-forward it may build) until evaluated is timed, and the caches go back
    to the prompt after it. ``draft`` None (prompt lookup): the target's alone."""
    kept = mx.random.randint(0, vocab, (batch, gamma // 2 + 1))
    verified = mx.concatenate([kept, mx.random.randint(0, vocab, (batch, gamma + 1 - kept.shape[1]))], axis=1)
    models = [(target, target_cache, gamma + 1)]
    if draft is not None:
        assert draft_cache is not None  # a drafter model has its caches
        models.append((draft, draft_cache, gamma))
    rollbacks = [(Rollback(model, cache.cache, strategy), forwarded) for model, cache, forwarded in models]

    def states() -> list:
        return [cache.state() for _, cache, _ in models]

    def sample() -> float:
        for rollback, _ in rollbacks:
            rollback.mark()
        for model, cache, forwarded in models[1:]:  # the drafter's steps
            for position in range(forwarded):
                model(verified[:, position : position + 1], cache=cache.cache)
        target(verified, cache=target_cache.cache)
        mx.eval(states())
        start = time.perf_counter()
        for rollback, forwarded in rollbacks:
            rollback.undo(forwarded, kept)
        mx.eval(states())
        elapsed = time.perf_counter() - start
        for _, cache, _ in models:
            cache.reset()
        return elapsed

    return sample


def _account(plain_step: float, tokens_per_round: float, verify: float, hidden: float, **parts: float) -> dict:
    """S from a round's priced parts (draft, reject, rollback, bookkeeping) and its verify, with
    each as priced: what ``round_prediction`` and ``lookup_prediction`` record."""
    round_s = verify + sum(parts.values())
    return {"speedup": tokens_per_round * plain_step / round_s, "plain_s": plain_step, "verify_s": verify,
            **{f"{name}_s": value for name, value in parts.items()},
            "round_s": round_s, "hidden_s": hidden, "tokens_per_round": tokens_per_round}


def round_prediction(parts: dict[str, float], plain_step: float, alpha: float, gamma: int,
                     batch: int = 1, catch_up: bool = False) -> dict:
    """S(B, gamma) from a round's timed parts (``RoundParts.medians``), the plain decode's step
    (seconds per token per sequence batch, pipelined as generation runs it) and the acceptance
    the run realised; with the round's parts as priced. ``catch_up`` (the suite's loop): after a
    round that accepted every draft, the drafter is fed its last draft, one more drafter step
    queued before the next round's chain (``Decoder.speculative``), so that a share
    alpha^(gamma B) of rounds drafts as ``CAUGHT_UP`` was timed, the rest as ``draft``; mlx-lm
    feeds it with the next round's first step instead, at about the cost of that step. (Priced
    at the chain's mean step instead, as before 2026-12-07, the step carried a share of the
    drafter's start after the verify, all of it at gamma 1: on the hybrid twin at B=1, gamma 1,
    1.1 ms over the loop's own drafting, 11% of its round, ``benchmarks/round_phases.py``.)"""
    hidden = min(max(parts["target_step"] - plain_step, 0.0), parts["target_step"] / 2)
    rejects = float(theory.rollback_probability(alpha, gamma, batch))
    rollback = parts.get("rollback", 0.0) * rejects
    draft = rejects * parts["draft"] + (1 - rejects) * parts[CAUGHT_UP] if catch_up else parts["draft"]
    return _account(plain_step, float(theory.expected_tokens_per_round(alpha, gamma)),
                    max(parts["verify"] - hidden, 0.0), hidden, draft=draft,
                    reject=parts.get("reject", 0.0), rollback=rollback, bookkeeping=parts.get("bookkeeping", 0.0))


def lookup_prediction(parts: RoundParts, plain_step: float, widths: list[int], tokens_per_round: float,
                      rolled_back_share: float) -> dict:
    """S(B) of prompt-lookup rounds from their timed parts: the lookup's host time, the verify of
    each round's width (the pending token and the batch's longest proposal, 1 to gamma+1 tokens,
    priced at the widths the run verified) as timed, synchronous (nothing hides its graph build:
    the lookup runs on the host between the round's synchronisation and the verify), the
    rollback priced by the share of rounds that rolled back, and the loop's bookkeeping; the
    tokens a round gives each sequence as the run measured them (no proposal: 1)."""
    medians = parts.medians()
    at_width = {w: parts.verify_at(w + 1) for w in set(widths)}
    return _account(plain_step, tokens_per_round, statistics.mean(at_width[w] for w in widths), 0.0,
                    draft=medians["draft"], reject=0.0,
                    rollback=medians.get("rollback", 0.0) * rolled_back_share,
                    bookkeeping=medians.get("bookkeeping", 0.0))
