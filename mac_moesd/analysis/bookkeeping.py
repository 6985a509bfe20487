"""The SD loop's own work a round, as a term of the time model: T_book(B) = a + b * B.

Besides its forwards, rejection sampling and rollback, every round of the suite's loop chooses the
target's token at each position from the verify's logits, synchronises once, decides what was
accepted and builds the next pending token (``measure.decoding.bookkeeping``). The sweep times that empty
round at every batch beside rejection sampling; a line through those points prices it in rounds
nobody timed. A fixed part (the synchronisation, the Python) and a part per sequence (the token
choice over the vocabulary, the comparisons): both bounded at 0, fitted on relative residuals so
every batch weighs alike, as the main fit is.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import lsq_linear

from mac_moesd.results import schema

__all__ = ["fit", "from_stored", "not_timed", "seconds"]


def not_timed() -> schema.BookkeepingTerm:
    """The term where the sweep timed no empty round: zero."""
    return {"a_s": 0.0, "b_s": 0.0, "points": 0, "mape": None}


def seconds(term: schema.BookkeepingTerm, batch) -> np.ndarray:
    """T_book(B) = ``a_s`` + ``b_s`` * B seconds a round."""
    return term["a_s"] + term["b_s"] * np.asarray(batch, dtype=float)


def fit(points: list[tuple[int, float]]) -> schema.BookkeepingTerm:
    """The line through (batch, seconds) points, each weighed by 1/seconds; none: zero. ``mape``
    is over the points it was fitted to."""
    if not points:
        return not_timed()
    batch, timed = (np.array(v, dtype=float) for v in zip(*points))
    design = np.stack([np.ones_like(batch), batch], axis=1) / timed[:, None]
    solved = lsq_linear(design, np.ones_like(timed), bounds=(0.0, np.inf)).x
    fitted = solved[0] + solved[1] * batch
    return {"a_s": float(solved[0]), "b_s": float(solved[1]), "points": len(points),
            "mape": float(np.mean(np.abs(fitted / timed - 1)))}


def from_stored(doc: schema.BookkeepingTerm | None) -> schema.BookkeepingTerm:
    """A stored term; a fit stored before the term existed has none: zero."""
    return {**not_timed(), **doc} if doc else not_timed()
