"""The one-row forward (one sequence, one new token): timed, not fitted.

MLX runs a matmul of one row on its matrix-vector path (Metal's gemv and qmv kernels; BLAS gemv on
the CPU backend) and every larger one on matrix-matrix kernels, and a decode loop hides a
different share of a one-row forward's graph building. The fitted curve, shaped by the many
larger forwards, sat 4-9% above the measured T_T(1,1) in every sweep on MLX's CPU backend, and
one hidden graph-build figure for all batches missed batch 1's (2.4 ms hidden there against a
0.8 ms median). Batch-1 plain decode is the denominator of every batch-1 speedup, so the model
takes the sweep's own timing of this one forward, carried to another context by the fitted KV
term. Every other shape keeps the fitted curve: timing them all in place of the curve made the
predictions worse on a 2-core machine, whose per-point noise exceeds the curve's error there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mac_moesd.analysis import pipelining

__all__ = ["OneRow"]


@dataclass(frozen=True)
class OneRow:
    """T_T(1,1) as the sweep timed it at ``context``: synchronous and, where timed, pipelined."""

    context: int
    sync_s: float
    pipelined_s: float | None = None

    @classmethod
    def from_points(cls, context: int, target, target_pipelined) -> OneRow | None:
        """From (batch, tokens, seconds) rows, as ``FitInputs`` holds them; None without (1, 1)."""
        sync = {(b, t): s for b, t, s in target}.get((1, 1))
        if sync is None:
            return None
        return cls(context, sync, {(b, t): s for b, t, s in target_pipelined}.get((1, 1)))

    def seconds(self, pipelined: bool, hidden: float = 0.0) -> float:
        """The timing a loop of that kind sees; where the pipelined one was not timed, the
        synchronous one less ``hidden``, the graph-build time pipelining hides elsewhere."""
        if not pipelined:
            return self.sync_s
        if self.pipelined_s is not None:
            return self.pipelined_s
        return float(pipelining.pipelined(self.sync_s, hidden))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> OneRow | None:
        return cls(**data) if data else None
