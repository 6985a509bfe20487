"""What a sharded forward communicates, and what each of those collectives costs on its own.

``traced`` records every ``mx.distributed`` call a forward's graph makes (mlx-lm's models and
``mlx.nn.layers.distributed`` look the functions up on ``mx.distributed`` at each call), so the
collectives per forward are counted from the model itself, not assumed per mode. Each kind at
each size is then timed alone, all ranks together:

- ``all_sum`` and ``all_gather``: K launches in one evaluation, each reading the previous output;
- ``sendrecv``: one hop from one rank to the next. A receive has no input in MLX's graph, so
  hops cannot be ordered inside one evaluation: rank 0 and 1 pass the array back and forth,
  one evaluation per hop, and a hop's time includes that evaluation's fixed cost.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import mlx.core as mx

from mac_moesd.measure.clock import timing

__all__ = ["OPS", "combine", "op_point", "summarise_trace", "traced"]

TRACED = ("all_sum", "all_gather", "send", "recv_like", "recv")
OPS = ("all_sum", "all_gather", "sendrecv")
HOPS_PER_SAMPLE = 8  # ping-pong hops per timed call


def _stand_in(name: str, ranks: int):
    """What a collective returns, in shape and dtype, without a group to run it on."""
    def call(x, *args, **kwargs):
        if name == "all_gather":
            return mx.zeros((x.shape[0] * ranks, *x.shape[1:]), dtype=x.dtype)
        return x

    return call


@contextlib.contextmanager
def traced(planned_ranks: int | None = None) -> Iterator[list[dict]]:
    """Record (op, shape, dtype) of every collective called inside. Each call still runs; with
    ``planned_ranks`` none runs (a stand-in of the right shape comes back), for planning a
    model split by ``sharding`` for a group that does not exist here."""
    calls: list[dict] = []
    originals = {name: getattr(mx.distributed, name) for name in TRACED if hasattr(mx.distributed, name)}

    def counting(name, fn):
        run = fn if planned_ranks is None else _stand_in(name, planned_ranks)

        def call(*args, **kwargs):
            out = run(*args, **kwargs)
            calls.append({"op": name, "shape": list(out.shape), "dtype": str(out.dtype).split(".")[-1]})
            return out

        return call

    for name, fn in originals.items():
        setattr(mx.distributed, name, counting(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)


def _dtype(name: str) -> mx.Dtype:
    return getattr(mx, name)


def summarise_trace(calls: list[dict], ranks: int) -> list[dict]:
    """One rank's calls as {op, shape, dtype, count}: sends and receives become ``sendrecv``
    (counted on the sending side), an all-gather is keyed by its input's shape."""
    counts: Counter = Counter()
    for c in calls:
        op, shape = c["op"], list(c["shape"])
        if op in ("recv_like", "recv"):
            continue
        if op == "send":
            op = "sendrecv"
        if op == "all_gather":
            shape[0] //= ranks
        counts[(op, tuple(shape), c["dtype"])] += 1
    return [{"op": op, "shape": list(shape), "dtype": dtype, "count": n}
            for (op, shape, dtype), n in sorted(counts.items())]


def combine(per_rank: list[list[dict]]) -> list[dict]:
    """The collectives of one forward over all ranks: an all-reduce or all-gather takes every
    rank at once (the most any rank calls); hops run one after another (the sum of sends)."""
    total: dict[tuple, int] = {}
    for rank_ops in per_rank:
        for o in rank_ops:
            key = (o["op"], tuple(o["shape"]), o["dtype"])
            if o["op"] == "sendrecv":
                total[key] = total.get(key, 0) + o["count"]
            else:
                total[key] = max(total.get(key, 0), o["count"])
    out = []
    for (op, shape, dtype), count in sorted(total.items()):
        size = 1
        for s in shape:
            size *= s
        out.append({"op": op, "shape": list(shape), "dtype": dtype, "count": count,
                    "bytes": size * _dtype(dtype).size})
    return out


def op_point(op: dict, group: mx.distributed.Group, launches: int) -> timing.Point:
    """One timed call of ``launches`` collectives of this kind and size (see module docstring)."""
    n, rank = group.size(), group.rank()
    x0 = mx.ones(op["shape"], dtype=_dtype(op["dtype"]))
    mx.eval(x0)
    rows = op["shape"][0]
    if op["op"] == "all_sum":
        scale = 1.0 / n  # keeps chained sums finite

        def step(i, prev):
            return mx.distributed.all_sum(x0 if prev is None else prev, group=group) * scale

        return timing.chained(step, launches)
    if op["op"] == "all_gather":
        def step(i, prev):
            return mx.distributed.all_gather(x0 if prev is None else prev, group=group)[:rows]

        return timing.chained(step, launches)

    def hops():
        x = x0
        for i in range(launches):
            src, dst = (1, 0) if i % 2 == 0 else (0, 1)
            if rank == src:
                x = mx.distributed.send(x, dst, group=group)
            elif rank == dst:
                x = mx.distributed.recv_like(x, src, group=group)
            mx.eval(x)
        return x

    return timing.Point(run=hops)
