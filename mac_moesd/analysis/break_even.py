"""The two numbers a user acts on: where SD stops paying, for one round's step times.

With a plain step T_T(B,1), a verify forward, the drafter's mean step and rejection sampling
priced as the loops run them (``FittedModel.step_times``), S = Omega * plain / round with
round = gamma * draft + verify + reject (docs/design.md §2.5). Setting S = 1:

- break-even acceptance: Omega(alpha, gamma) = round / plain, solved for alpha (Omega rises from 1
  at alpha 0 to gamma + 1 at alpha 1, so the root is unique where it exists);
- break-even drafter cost: the largest draft step over plain step at which S = 1 at a given alpha,
  (Omega * plain - verify - reject) / (gamma * plain).
"""

from __future__ import annotations

from mac_moesd.analysis import theory
from mac_moesd.analysis.acceptance import solve_alpha

__all__ = ["break_even_alpha", "break_even_draft_ratio"]


def break_even_alpha(plain: float, verify: float, draft_step: float, reject: float, gamma: int) -> float | None:
    """The acceptance at which SD at draft length ``gamma`` just matches plain decode: 0.0 where
    it pays at any acceptance, None where not even every draft accepted pays."""
    need = (gamma * draft_step + verify + reject) / plain  # tokens a round must yield
    if need <= 1.0:
        return 0.0
    if need >= gamma + 1:
        return None
    return solve_alpha(need - 1.0, gamma)


def break_even_draft_ratio(plain: float, verify: float, reject: float, gamma: int, alpha: float) -> float | None:
    """The largest drafter step, as a fraction of the plain step, at which SD at ``gamma`` and
    ``alpha`` still matches plain decode; None where even a free drafter does not pay."""
    omega = float(theory.expected_tokens_per_round(alpha, gamma))
    ratio = (omega * plain - verify - reject) / (gamma * plain)
    return ratio if ratio > 0 else None
