"""Acceptance of speculative decoding from measured rounds: mean accepted length, sigma, alpha.

Neither accepted/drafted nor from-draft/emitted is the per-token acceptance rate alpha (at
alpha 0.8 and gamma 4 they give 0.59 and 0.70). What a run measures directly is the mean number
of draft tokens accepted per round, L = alpha*(1 - alpha^gamma)/(1 - alpha) (Leviathan et al.,
arXiv 2211.17192, Eq. 1's tokens per round minus the bonus token); alpha is solved from it.

At temperature > 0 two acceptance rules differ. Exact rejection sampling accepts draft token x
(drawn from the drafter's q) with probability min(1, p(x)/q(x)): sum_x min(p, q) per position
(Leviathan et al., Theorem 3.5). mlx-lm's ``speculative_generate_step`` instead samples the
target's own token y from p and accepts x only when y == x: sum_x p(x) q(x) per position, never
more (mlx_lm/generate.py). ``expected_rounds`` turns either rule's per-round probabilities into
the same summary as measured rounds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from scipy.optimize import brentq

__all__ = ["RULES", "expected_rounds", "mlx_lm_rounds", "mlx_lm_verifies", "solve_alpha", "summarise_rounds", "tokens_per_round"]

RULES = ("mlx-lm", "rejection")  # accept when the sampled target token equals the draft; min(1, p/q)


def _accepted_length(alpha: float, gamma: int) -> float:
    # sum_{i=1..gamma} alpha^i: equal to alpha*(1-alpha^gamma)/(1-alpha), and defined at alpha = 1.
    return float(sum(alpha**i for i in range(1, gamma + 1)))


def solve_alpha(mean_accepted: float, gamma: int) -> float:
    """The alpha in [0, 1] whose expected accepted draft tokens per round equal ``mean_accepted``."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if not 0.0 <= mean_accepted <= gamma:
        raise ValueError(f"mean accepted length must be in [0, gamma={gamma}], got {mean_accepted}")
    if mean_accepted == 0.0:
        return 0.0
    if mean_accepted == gamma:
        return 1.0
    return float(brentq(lambda a: _accepted_length(a, gamma) - mean_accepted, 0.0, 1.0, xtol=1e-12))


def summarise_rounds(accepted: Iterable[int], gamma: int, proposed: Iterable[int] | None = None) -> dict:
    """Mean accepted length, sigma, acceptance by position and the solved alpha, from the draft
    tokens accepted in each round (one entry per sequence per round), and ``proposed``, the
    draft tokens each round offered where that varies (prompt lookup; None: gamma every round).

    ``acceptance_by_position[i]`` is the fraction of the rounds that offered a draft token i+1
    whose draft token i+1 was accepted (None where no round offered one). Every round counts in
    ``rounds`` and the mean, one that offered nothing as one that accepted 0. sigma =
    (L + 1)/(gamma + 1): tokens per round over the gamma+1 a round could produce. ``alpha`` is
    solved from the mean where every round offered gamma drafts; where ``proposed`` varies it
    would mix how often a proposal exists with how often it is right, so it is None.
    """
    counts = np.asarray(list(accepted), dtype=int)
    offered = np.full(counts.shape, gamma) if proposed is None else np.asarray(list(proposed), dtype=int)
    if counts.size == 0:
        raise ValueError("no complete speculative round to measure acceptance from")
    if offered.shape != counts.shape or offered.min() < 0 or offered.max() > gamma:
        raise ValueError(f"proposed counts must be in [0, gamma={gamma}], one per round")
    if counts.min() < 0 or (counts > offered).any():
        raise ValueError(f"accepted counts must be in [0, the tokens offered <= gamma={gamma}]")
    mean = float(counts.mean())
    by_position = [float((counts[offered >= i] >= i).mean()) if (offered >= i).any() else None
                   for i in range(1, gamma + 1)]
    return {
        "rounds": int(counts.size),
        "mean_accepted": mean,
        "sigma": (mean + 1.0) / (gamma + 1.0),
        "acceptance_by_position": by_position,
        "alpha": solve_alpha(mean, gamma) if proposed is None else None,
    }


def mlx_lm_rounds(from_draft: Sequence[bool], gamma: int, max_tokens: int) -> list[int]:
    """Accepted draft tokens per round of mlx-lm's ``speculative_generate_step``, from its flags.

    A round yields its accepted draft tokens (from_draft True) and then the target's own token
    (False). Near the end mlx-lm drafts only max_tokens - emitted tokens, so only rounds that
    started with at least gamma + 1 tokens to go are counted: their length does not depend on
    the outcome.
    """
    rounds, run, emitted, start = [], 0, 0, 0
    for flag in from_draft:
        emitted += 1
        if flag:
            run += 1
            continue
        if max_tokens - start >= gamma + 1:
            rounds.append(run)
        run, start = 0, emitted
    return rounds


def mlx_lm_verifies(from_draft: Sequence[bool]) -> int:
    """The verify forwards mlx-lm's ``speculative_generate_step`` ran, from its flags: one per
    round, each closed by the target's own token (False), and one more where the decode ended on
    accepted drafts (max_tokens reached inside a round, whose verify had run)."""
    flags = list(from_draft)
    return flags.count(False) + bool(flags and flags[-1])


def expected_rounds(token_probs: np.ndarray, position_probs: np.ndarray) -> dict:
    """Expected acceptance of one rule over many rounds, from the probabilities it accepts with.

    Shapes (rounds, gamma): ``token_probs[r, j]`` is the rule's chance of accepting the drafted
    token at position j+1 given the drafted prefix (p(x) for mlx-lm's rule, min(1, p(x)/q(x)) for
    rejection sampling), ``position_probs[r, j]`` its chance averaged over the draft, x ~ q
    (sum_x p q, or sum_x min(p, q)). A round accepts at least i tokens with probability
    prod_{j<i} token_probs[j] * position_probs[i]; its average over rounds is an unbiased
    estimate of ``acceptance_by_position``, with less variance than counting accepted tokens.
    Returns the keys of ``summarise_rounds``.
    """
    token_probs = np.asarray(token_probs, dtype=float)
    position_probs = np.asarray(position_probs, dtype=float)
    if token_probs.shape != position_probs.shape or token_probs.ndim != 2 or token_probs.size == 0:
        raise ValueError("token and position probabilities must be non-empty (rounds, gamma) arrays")
    gamma = token_probs.shape[1]
    prefix = np.cumprod(np.concatenate([np.ones_like(token_probs[:, :1]), token_probs[:, :-1]], axis=1),
                        axis=1)
    by_position = (prefix * position_probs).mean(axis=0).clip(0.0, 1.0)
    mean = float(by_position.sum())
    return {
        "rounds": int(token_probs.shape[0]),
        "mean_accepted": mean,
        "sigma": (mean + 1.0) / (gamma + 1.0),
        "acceptance_by_position": [float(v) for v in by_position],
        "alpha": solve_alpha(min(mean, float(gamma)), gamma),
    }


def tokens_per_round(summary: dict) -> float:
    """Omega as measured: the mean accepted draft tokens plus the target's own token. At equal
    cost per round, speedups of two acceptance rules stand in the ratio of their Omegas."""
    return summary["mean_accepted"] + 1.0
