"""Acceptance of speculative decoding from measured rounds: mean accepted length, sigma, alpha.

Neither accepted/drafted nor from-draft/emitted is the per-token acceptance rate alpha (at
alpha 0.8 and gamma 4 they give 0.59 and 0.70). What a run measures directly is the mean number
of draft tokens accepted per round, L = alpha*(1 - alpha^gamma)/(1 - alpha) (Leviathan et al.,
arXiv 2211.17192, Eq. 1's tokens per round minus the bonus token); alpha is solved from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from scipy.optimize import brentq

__all__ = ["mlx_lm_rounds", "solve_alpha", "summarise_rounds"]


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


def summarise_rounds(accepted: Iterable[int], gamma: int) -> dict:
    """Mean accepted length, sigma, acceptance by position and the solved alpha, from the draft
    tokens accepted in each round (one entry per sequence per round).

    ``acceptance_by_position[i]`` is the fraction of rounds whose draft token i+1 was accepted.
    sigma = (L + 1)/(gamma + 1): tokens per round over the gamma+1 a round could produce.
    """
    counts = np.asarray(list(accepted), dtype=int)
    if counts.size == 0:
        raise ValueError("no complete speculative round to measure acceptance from")
    if counts.min() < 0 or counts.max() > gamma:
        raise ValueError(f"accepted counts must be in [0, gamma={gamma}]")
    mean = float(counts.mean())
    return {
        "rounds": int(counts.size),
        "mean_accepted": mean,
        "sigma": (mean + 1.0) / (gamma + 1.0),
        "acceptance_by_position": [float((counts >= i).mean()) for i in range(1, gamma + 1)],
        "alpha": solve_alpha(mean, gamma),
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
