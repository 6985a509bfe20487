"""What each decoding loop experiences: forwards whose graph is built while the previous one runs.

mlx-lm's loops queue each next forward with ``mx.async_eval`` before waiting on the current one,
so in plain decode and in the drafter's steps the cost of building a graph (Python, dispatch) is
hidden behind the previous forward's compute. A speculative round cannot hide its first draft
step: it waits for the verify result before it knows what to draft. The sweep times every point
both ways; the hidden part is their difference, about constant per forward (building a graph
costs the same whatever B and t), so one figure per model carries it to any batch and window. It
is taken from the one-token points, timed in chains as long as decoding's: a chain's fixed cost
(filling the pipeline) is spread over its forwards, and the smallest forwards vary least.

Per round (gamma draft steps, one verify of gamma+1 tokens):
  round = T_D,sync + (gamma - 1) * T_D,pipe + T_T,pipe(B, gamma+1) + T_rej
  plain = T_T,pipe(B, 1) per token
(the verify forward is built while the last draft step runs, so its cost is the pipelined one).

The hidden part is min(graph build, compute): pipelining can hide no more than the shorter of the
two, so it is at most half a synchronous forward. Each point's difference is clipped to that, and
so is the figure wherever it is applied; a noisy machine cannot make a forward free, nor a
pipelined loop slower than a synchronous one.
"""

from __future__ import annotations

import numpy as np

from mac_moesd.results import schema

__all__ = ["draft_step", "from_stored", "hidden_seconds", "measured", "not_measured", "pipelined"]


def not_measured() -> schema.Pipelining:
    """The record of a fit whose sweep timed no point both ways: nothing hidden."""
    return {"target_s": 0.0, "draft_s": 0.0, "target_points": 0, "draft_points": 0, "target_mape": None}


def measured(record: schema.Pipelining) -> bool:
    """Whether the target's figure came from points timed both ways."""
    return record.get("target_points", 0) > 0


def from_stored(data: schema.Pipelining | None) -> schema.Pipelining:
    """A stored record, with what an earlier file lacks as not measured."""
    return {**not_measured(), **(data or {})}


def hidden_seconds(sync: dict, pipelined: dict) -> tuple[float, int]:
    """The mean over the points timed both ways of (synchronous - pipelined), each at most half
    its forward, weighted by 1 / T_sync^2, and at least 0; and how many points it came from. Keys
    are any point labels; values seconds.

    The weights are inverse variances: a point's median is known to a fraction of itself (each
    gets alike seconds, so a larger forward's gets fewer samples), so its difference to that
    fraction of a larger time. A median of the differences took each batch as alike: on a 2-core
    box one sweep's batch-1 point said 1.3 ms, its batch-8 point -1.3 ms from chains of 1 s."""
    both = sorted(k for k in sync.keys() & pipelined.keys() if sync[k] > 0)
    if not both:
        return 0.0, 0
    differences = [min(sync[k] - pipelined[k], sync[k] / 2) for k in both]
    weights = [1.0 / sync[k] ** 2 for k in both]
    return max(float(np.average(differences, weights=weights)), 0.0), len(both)


def pipelined(sync, hidden: float) -> np.ndarray:
    """A synchronous forward time as a pipelined loop sees it: less the hidden part, which is
    never more than half of it."""
    sync = np.asarray(sync, dtype=float)
    return sync - np.minimum(hidden, sync / 2)


def draft_step(sync, hidden: float, gamma: int) -> np.ndarray:
    """The drafter's mean cost per step within a round: the first step pays its graph build,
    the other gamma - 1 are pipelined."""
    sync = np.asarray(sync, dtype=float)
    return sync - np.minimum(hidden, sync / 2) * (gamma - 1) / gamma
