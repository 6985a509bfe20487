"""The parts of one SD round, timed inside the SD stage beside its (plain, SD) pairs.

A prediction from the sweep's grid, minutes earlier in another process, carries the machine's
drift between the two (10-18% between processes on a 2-core Linux box). So after each timed pair
the SD stage also times, on the same decoder (same prompt, same caches, rolled back), in shuffled
order, the forwards a round is made of:

- ``verify``: the target's forward of gamma+1 tokens per sequence, synchronous;
- ``target_step``: the target's one-token forward, synchronous (only to tell what pipelining
  hides from the verify: the plain decode beside it is the pipelined one-token step);
- ``draft``: gamma drafter steps chained as the loops chain them (each next graph queued before
  waiting on the current one), the whole draft phase of a round;
- ``reject``: rejection sampling at the batch, where the loop runs it (emulated acceptance).

``round_prediction`` turns their medians, the plain decode's own step and the acceptance the
run realised into MoESD's S(B, gamma) (docs/design.md: the speedup formula):
  S = Omega * T_plain / (T_draft + T_verify,pipelined + T_rej),
  T_verify,pipelined = T_verify - min(T_step - T_plain, T_step / 2), at least 0 hidden.
The forwards run at the prompt's context, the decode at a mean context new_tokens/2 longer; the
difference is the KV term over those tokens, small beside a forward for the runs timed here.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

import mlx.core as mx

from mac_moesd.analysis import theory
from mac_moesd.measure import timing
from mac_moesd.measure.rolled_cache import RolledBackCache
from mac_moesd.measure.sweep import forward_point, pipelined_point, reject_point

__all__ = ["RoundParts", "round_prediction"]


@dataclass
class RoundParts:
    """Samples (seconds) of each part of a round at one (batch, gamma), one per timed pair."""

    batch: int
    gamma: int
    vocab: int
    with_reject: bool
    samples: dict[str, list[float]] = field(default_factory=dict)

    def time(self, target, draft, target_cache: RolledBackCache, draft_cache: RolledBackCache,
             rng: random.Random) -> None:
        """One sample of every part, in shuffled order, on caches at the prompt's context (each
        part rolls its cache back after itself)."""
        points = {
            "verify": forward_point(target, target_cache, self.batch, self.gamma + 1, self.vocab),
            "target_step": forward_point(target, target_cache, self.batch, 1, self.vocab),
            "draft": pipelined_point(draft, draft_cache, self.batch, 1, self.vocab, steps=self.gamma),
        }
        if self.with_reject:
            points["reject"] = reject_point(self.batch, self.gamma, self.vocab)
        names = list(points)
        rng.shuffle(names)
        for name in names:
            self.samples.setdefault(name, []).append(timing.finite_time(points[name]))
        mx.synchronize()

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.samples.items()}

    def to_dict(self) -> dict:
        return {"samples": len(next(iter(self.samples.values()), [])),
                "median_s": self.medians()}


def round_prediction(parts: dict[str, float], plain_step: float, alpha: float, gamma: int) -> dict:
    """S(B, gamma) from a round's timed parts (``RoundParts.medians``), the plain decode's step
    (seconds per token per sequence batch, pipelined as generation runs it) and the acceptance
    the run realised; with the round's parts as priced."""
    hidden = min(max(parts["target_step"] - plain_step, 0.0), parts["target_step"] / 2)
    verify = max(parts["verify"] - hidden, 0.0)
    draft, reject = parts["draft"], parts.get("reject", 0.0)
    omega = float(theory.expected_tokens_per_round(alpha, gamma))
    round_s = draft + verify + reject
    return {"speedup": omega * plain_step / round_s, "plain_s": plain_step, "verify_s": verify,
            "draft_s": draft, "reject_s": reject, "round_s": round_s, "hidden_s": hidden,
            "tokens_per_round": omega}
