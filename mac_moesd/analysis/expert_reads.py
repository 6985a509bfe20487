"""How many experts a forward of B sequences x t tokens activates: counted where the sweep counted
them, else the anchored correlation forms fitted to those counts.

Every MoE point of a sweep records the unique experts per MoE layer its routing chose
(``unique_experts``). Real and random-weight routers reuse experts across consecutive tokens, so
these counts sit well below MoESD's uniform N(B*t) (docs/design.md §6: a random model's 16 consecutive
tokens hit 19.5 of 60 experts, against 40.1 uniform), and the time model's expert-read term must
follow them. Off the counted grid, B independent sequences act like 1 + c_batch*(B - 1) uniform
tokens and each sequence's t consecutive tokens like 1 + c*(t - 1) (the anchored form, exact K at
one token), so

    N(B, t) = N(uniform tokens = (1 + c_batch*(B - 1)) * (1 + c*(t - 1)))

Uniform routing has c = c_batch = 1: MoESD's N(B*t).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import least_squares

from mac_moesd.analysis import theory

__all__ = ["Routing", "fit_routing"]

MIN_CORRELATION = 1e-3


@dataclass(frozen=True)
class Routing:
    """Unique experts per MoE layer at (B, t): the sweep's counts, and the fitted forms between."""

    correlation: float = 1.0  # within a sequence
    batch_correlation: float = 1.0  # across the batch's sequences
    counts: dict[tuple[int, int], float] = field(default_factory=dict)  # (B, t) -> counted unique

    def effective_tokens(self, batch: ArrayLike, tokens: ArrayLike) -> np.ndarray:
        return (theory.correlated_tokens(batch, self.batch_correlation)
                * theory.correlated_tokens(tokens, self.correlation))

    def unique(self, batch: ArrayLike, tokens: ArrayLike, experts: int, top_k: int) -> np.ndarray:
        """Counted where the sweep counted (B, t), else the fitted form."""
        batch, tokens = np.broadcast_arrays(np.asarray(batch, dtype=float), np.asarray(tokens, dtype=float))
        active = theory.activated_experts(self.effective_tokens(batch, tokens), experts, top_k)
        if self.counts:
            counted = np.asarray([self.counts.get((int(b), int(t)), np.nan) if b == int(b) and t == int(t)
                                  else np.nan for b, t in zip(batch.ravel(), tokens.ravel())],
                                 dtype=float).reshape(batch.shape)
            active = np.where(np.isnan(counted), active, counted)
        return active

    def form_only(self) -> Routing:
        """The fitted forms without the counts (for another top-k, whose counts were not taken)."""
        return replace(self, counts={})

    def to_dict(self) -> dict:
        return {"correlation": self.correlation, "batch_correlation": self.batch_correlation,
                "counts": [[b, t, n] for (b, t), n in sorted(self.counts.items())]}

    @classmethod
    def from_dict(cls, data: dict | None) -> Routing:
        if not data:
            return cls()
        return cls(data["correlation"], data["batch_correlation"],
                   {(int(b), int(t)): float(n) for b, t, n in data.get("counts", [])})


def fit_routing(counts: dict[tuple[int, int], float], experts: int, top_k: int) -> Routing:
    """Both correlations fitted jointly to every counted (B, t); one the grid cannot see (no
    B > 1, or no t > 1) stays at 1."""
    if not counts:
        return Routing()
    keys = sorted(counts)
    b = np.array([k[0] for k in keys], dtype=float)
    t = np.array([k[1] for k in keys], dtype=float)
    measured = np.array([counts[k] for k in keys])
    free = np.array([bool((t > 1).any()), bool((b > 1).any())])  # (c, c_batch)
    if not free.any():
        return Routing(counts=dict(counts))

    def unpack(x):
        full = np.ones(2)
        full[free] = x
        return full

    def residual(x):
        return Routing(*unpack(x)).unique(b, t, experts, top_k) - measured

    k = int(free.sum())
    x = least_squares(residual, x0=np.full(k, 0.9), bounds=(np.full(k, MIN_CORRELATION), np.ones(k))).x
    c, cb = unpack(x)
    return Routing(float(c), float(cb), dict(counts))
