"""The SD loop's own work a round, as a term of the time model: T_book(B) = a + b * B.

Besides its forwards, rejection sampling and rollback, every round of the suite's loop chooses the
target's token at each position from the verify's logits, synchronises once, decides what was
accepted and builds the next pending token (``measure.bookkeeping``). The sweep times that empty
round at every batch beside rejection sampling; a line through those points prices it in rounds
nobody timed. A fixed part (the synchronisation, the Python) and a part per sequence (the token
choice over the vocabulary, the comparisons): both bounded at 0, fitted on relative residuals so
every batch weighs alike, as the main fit is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import lsq_linear

__all__ = ["Bookkeeping"]


@dataclass(frozen=True)
class Bookkeeping:
    """T_book(B) = ``a_s`` + ``b_s`` * B seconds a round; all zero where nothing was timed."""

    a_s: float = 0.0
    b_s: float = 0.0
    points: int = 0
    mape: float | None = None  # over the points it was fitted to

    def time(self, batch) -> np.ndarray:
        return self.a_s + self.b_s * np.asarray(batch, dtype=float)

    @classmethod
    def fit(cls, points: list[tuple[int, float]]) -> Bookkeeping:
        """The line through (batch, seconds) points, each weighed by 1/seconds; none: zero."""
        if not points:
            return cls()
        batch, seconds = (np.array(v, dtype=float) for v in zip(*points))
        design = np.stack([np.ones_like(batch), batch], axis=1) / seconds[:, None]
        solved = lsq_linear(design, np.ones_like(seconds), bounds=(0.0, np.inf)).x
        fitted = solved[0] + solved[1] * batch
        return cls(float(solved[0]), float(solved[1]), len(points), float(np.mean(np.abs(fitted / seconds - 1))))

    def to_dict(self) -> dict:
        return {"a_s": self.a_s, "b_s": self.b_s, "points": self.points, "mape": self.mape}

    @classmethod
    def from_dict(cls, doc: dict | None) -> Bookkeeping:
        return cls(**doc) if doc else cls()
