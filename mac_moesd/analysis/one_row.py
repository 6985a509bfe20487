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

from mac_moesd.analysis import pipelining
from mac_moesd.results import schema

__all__ = ["from_points", "seconds"]


def from_points(context: int, target, target_pipelined) -> schema.OneRow | None:
    """T_T(1,1) as the sweep timed it at ``context``: synchronous and, where timed, pipelined;
    from (batch, tokens, seconds) rows, as ``FitInputs`` holds them; None without (1, 1)."""
    sync = {(b, t): s for b, t, s in target}.get((1, 1))
    if sync is None:
        return None
    return {"context": context, "sync_s": sync,
            "pipelined_s": {(b, t): s for b, t, s in target_pipelined}.get((1, 1))}


def seconds(row: schema.OneRow, pipelined: bool, hidden: float = 0.0) -> float:
    """The timing a loop of that kind sees; where the pipelined one was not timed, the
    synchronous one less ``hidden``, the graph-build time pipelining hides elsewhere."""
    if not pipelined:
        return row["sync_s"]
    timed = row.get("pipelined_s")
    if timed is not None:
        return timed
    return float(pipelining.pipelined(row["sync_s"], hidden))
