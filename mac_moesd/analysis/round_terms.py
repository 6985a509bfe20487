"""The time model's terms a round that are not forwards of a timed grid: T(B) = a + b * B seconds
(and, for the drafter's start, + c * (gamma - 1)).

Two of them, each a line through what the sweep timed at every batch, so that it prices rounds
nobody timed:

- the SD loop's **bookkeeping**: besides its forwards, rejection sampling and rollback, every
  round of the suite's loop chooses the target's token at each position from the verify's logits,
  synchronises once, decides what was accepted and builds the next pending token
  (``measure.decoding.bookkeeping``). The sweep times that empty round beside rejection sampling.
- the **drafter's start**: a round's draft chain runs right after the target's verify, which the
  drafter's grid points, timed back to back, never follow (``measure.forward.draft_chain``). The
  term is the chains the sweep timed after a verify less the drafter steps the fit prices for them;
  timed at several draft lengths, since the steps after the first pay some of it too (on the CPU
  backend, tiny-draft after a tiny-moe verify: 0.7, 1.2 and 1.4 ms more than back to back for
  chains of 1, 2 and 4 steps at B = 1).

A fixed part (a synchronisation, the Python, a cold start), a part per sequence and, for the
drafter's start, a part per draft step beyond the first: each bounded at 0, fitted on residuals
relative to what was timed, so every batch weighs alike, as the main fit weighs its points.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import lsq_linear

from mac_moesd.results import schema

__all__ = ["fit", "fit_in_gamma", "from_stored", "not_timed", "seconds"]


def not_timed() -> schema.RoundTerm:
    """The term where the sweep timed nothing for it: zero."""
    return {"a_s": 0.0, "b_s": 0.0, "c_s": 0.0, "points": 0, "mape": None}


def seconds(term: schema.RoundTerm, batch, gamma=1) -> np.ndarray:
    """T(B, gamma) = ``a_s`` + ``b_s`` * B + ``c_s`` * (gamma - 1) seconds a round."""
    return term["a_s"] + term["b_s"] * np.asarray(batch, dtype=float) + term["c_s"] * (np.asarray(gamma) - 1.0)


def fit(points: list[tuple[int, float]]) -> schema.RoundTerm:
    """The line a + b * B through (batch, seconds) points, each residual relative to its point
    (``c_s`` 0: timed at one draft length). None: zero."""
    return _solve([(b, 1, s) for b, s in points], None, per_step=False)


def fit_in_gamma(points: list[tuple[int, int, float]], scale: list[float]) -> schema.RoundTerm:
    """a + b * B + c * (gamma - 1) through (batch, gamma, seconds) points, each residual divided
    by its ``scale`` (the drafter's start is a difference, which may be near 0 or below; it is
    scaled by the chain it came from). None: zero."""
    return _solve(points, scale, per_step=True)


def _solve(points: list[tuple[int, int, float]], scale: list[float] | None, per_step: bool) -> schema.RoundTerm:
    """Least squares with every part bounded at 0; ``mape``: the mean absolute residual over its
    scale at the points it was fitted to."""
    if not points:
        return not_timed()
    batch, gamma, timed = (np.array(v, dtype=float) for v in zip(*points))
    weight = timed if scale is None else np.asarray(scale, dtype=float)
    columns = [np.ones_like(batch), batch] + ([gamma - 1] if per_step else [])
    design = np.stack(columns, axis=1) / weight[:, None]
    solved = lsq_linear(design, timed / weight, bounds=(0.0, np.inf)).x
    a, b, c = solved[0], solved[1], (solved[2] if per_step else 0.0)
    fitted = a + b * batch + c * (gamma - 1)
    return {"a_s": float(a), "b_s": float(b), "c_s": float(c), "points": len(points),
            "mape": float(np.mean(np.abs(fitted - timed) / weight))}


def from_stored(doc: schema.RoundTerm | None) -> schema.RoundTerm:
    """A stored term; a fit stored before the term (or its ``c_s``) existed lacks it: zero."""
    return {**not_timed(), **doc} if doc else not_timed()
