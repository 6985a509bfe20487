"""`sweep --parallel`: T_T(B,t) of a model sharded over the ranks that ``mlx.launch`` started.

Every rank runs this same code on its own shard (``sharding``); MLX's distributed layer does all
communication. The ranks must stay in step: one collective missed by one rank blocks the rest.
So every decision is taken once and shared: rank 0 reads the results file and sends it to the
others (what to resume), memory is planned for the rank with least of it and the largest shard,
and each timed sample is the slowest rank's (``timing.synchronised``), so adaptive repeats end
on the same call everywhere. Only rank 0 writes results and prints.

After the grid, the collectives of one forward are traced at every point and each is timed on
its own (``collectives``): the communication cost recorded beside each point.

Faults: a rank that dies breaks its peers' connections, which MLX reports as an error; a rank that
hangs or never starts is caught by each rank's ``watchdog`` (MLX's collectives block, the ring
backend's init while holding the GIL). Either way every rank exits with one line, and what rank 0
wrote so far stays: the same command resumes.
"""

from __future__ import annotations

import json
import os
import random
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, cast

import mlx.core as mx
import numpy as np

from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.inputs import models
from mac_moesd.machine import hardware, memory, metadata
from mac_moesd.measure.clock import timing
from mac_moesd.measure.cluster import collectives, sharding
from mac_moesd.measure.forward.sweep import SweepConfig, entry_key, resolve_sources, run_sweep
from mac_moesd.progress import Progress
from mac_moesd.measure.clock.watchdog import Watchdog
from mac_moesd.results import ResultsStore, point_key, schema

__all__ = ["DEFAULT_TIMEOUT_S", "Cluster", "join", "launched_backend", "run_cluster_sweep"]

DEFAULT_TIMEOUT_S = 300.0
RESUME = "results written so far are kept: rerun the same command to resume"
NOT_LAUNCHED = ("--parallel runs on ranks started by mlx.launch, e.g. "
                "`mlx.launch -n 2 --backend ring -- mac-moesd sweep MODEL --parallel expert`")


def launched_backend(environ=os.environ) -> str | None:
    """The backend ``mlx.launch`` set this process up for, from the variables it exports."""
    if environ.get("MLX_IBV_DEVICES") or environ.get("MLX_JACCL_COORDINATOR"):
        return "jaccl"
    if "MLX_HOSTFILE" in environ and "MLX_RANK" in environ:
        return "ring"
    if "OMPI_COMM_WORLD_SIZE" in environ or "PMI_RANK" in environ:
        return "mpi"
    if environ.get("NCCL_HOST_IP"):
        return "nccl"
    return None


@dataclass
class Cluster:
    """This rank's view of the group: who it is, who the others are, and its watchdog."""

    group: mx.distributed.Group
    backend: str
    hosts: list[str]
    parallel: str
    watchdog: Watchdog

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def describe(self) -> dict:
        return {"ranks": self.size, "backend": self.backend, "hosts": self.hosts, "parallel": self.parallel}

    # ---- agreement (timing.Ranks) ----

    def _reduce(self, op, array: mx.array) -> np.ndarray:
        self.watchdog.beat()
        out = op(array, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return np.array(out)

    def barrier(self) -> None:
        self._reduce(mx.distributed.all_sum, mx.array(1.0))

    def slowest(self, seconds: float) -> float:
        return float(self._reduce(mx.distributed.all_max, mx.array(seconds, dtype=mx.float32)))

    def largest(self, values: list[int]) -> list[int]:
        return [int(v) for v in self._reduce(mx.distributed.all_max, mx.array(values, dtype=mx.int64))]

    def gather_json(self, value: Any) -> list[Any]:
        """Every rank's JSON-able ``value``, in rank order, on every rank."""
        data = json.dumps(value).encode()
        width = self.largest([len(data)])[0]
        buffer = np.zeros(width + 1, dtype=np.uint8)
        buffer[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        rows = self._reduce(mx.distributed.all_gather, mx.array(buffer)).reshape(self.size, -1)
        return [json.loads(bytes(row).rstrip(b"\0")) for row in rows]

    def from_rank0(self, produce: Callable[[], Any]) -> Any:
        """Rank 0 runs ``produce``; every rank returns its value or raises its error (rank 0
        re-raises its own, so a bug keeps its traceback there)."""
        payload, failure = None, None
        if self.rank == 0:
            try:
                payload = {"value": produce()}
            except Exception as err:  # told to the others before it goes up, so none waits
                failure = err
                payload = {"error": str(err) if isinstance(err, MacMoesdError) else f"rank 0 failed: {err!r}",
                           "usage": isinstance(err, BadInput)}
        shared = self.gather_json(payload)[0]
        if failure is not None:
            raise failure
        if "error" in shared:
            raise (BadInput if shared["usage"] else MacMoesdError)(shared["error"])
        return shared["value"]


def join(parallel: str, timeout: float) -> Cluster:
    """Join the group ``mlx.launch`` set up; each rank gets a watchdog of ``timeout`` seconds."""
    if parallel not in sharding.MODES:
        raise BadInput(f"--parallel must be one of {', '.join(sharding.MODES)}")
    backend = launched_backend()
    if backend is None:
        raise BadInput(NOT_LAUNCHED)
    rank = os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    dog = Watchdog(timeout, f"rank {rank}: the other ranks did not connect within {timeout:g} s "
                            "(one never started, or the hosts cannot reach each other)")
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except RuntimeError as err:
        dog.stop()
        raise MacMoesdError(f"rank {rank}: could not join the {backend} group: {err}") from None
    if group.size() < 2:
        dog.stop()
        raise BadInput(NOT_LAUNCHED)
    cluster = Cluster(group, backend, [], parallel, dog)
    cluster.hosts = cluster.gather_json(socket.gethostname())
    dog.say(f"rank {group.rank()}: no answer from the other ranks for {timeout:g} s (a rank hung or "
            f"died); {RESUME}")
    return cluster


# ---- the sharded model ----


def rank_config(config: dict, parallel: str, ranks: int, layers: int) -> dict:
    """The config of what one rank runs (for memory and time estimates): heads and widths
    divided for tensor parallelism, the layer count of the stage for pipeline parallelism."""
    out = dict(config)
    if parallel == "tensor":
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                    "moe_intermediate_size", "shared_expert_intermediate_size"):
            if out.get(key):
                out[key] = max(out[key] // ranks, 1)
    if parallel == "pipeline":
        out["num_hidden_layers"] = layers
    return out


def shard_built(built: models.Built, parallel: str, group) -> tuple[models.Built, str]:
    """``built`` split for this rank of ``group`` (lazy: nothing allocated), and who split it."""
    how = sharding.shard(built.model, parallel, group)
    local_layers = len(built.model.layers)
    config = rank_config(built.config, parallel, group.size(), local_layers)
    return replace(built, config=config, footprint=models.footprint(built.model, built.config)), how


def sharded_builder(cluster: Cluster, sharded_by: dict) -> Callable[..., models.Built]:
    """A ``models.build`` whose model is this rank's shard. Its footprint is the largest rank's
    (field by field), so every rank plans memory alike and the ranks take the same decisions."""

    def build(source, dtype=None, bits=None, layers=None, seed: int = 0) -> models.Built:
        built, how = shard_built(models.build(source, dtype, bits, layers, seed=seed), cluster.parallel,
                                 cluster.group)
        sharded_by["by"] = how
        fp: dict[str, Any] = dict(built.footprint)
        names = [name for name, value in fp.items() if isinstance(value, int)]
        largest = dict(zip(names, cluster.largest([fp[n] for n in names])))  # counts; derived ones recomputed
        return replace(built, footprint=models.with_derived(cast(schema.Footprint, {**fp, **largest})))

    return build


# ---- communication ----


def trace_forward(model, cluster: Cluster, batch: int, tokens: int) -> list[dict]:
    """The collectives one forward of batch x tokens makes, over all ranks (graph built, not run)."""
    with collectives.traced() as calls:
        model(mx.zeros((batch, tokens), dtype=mx.int32))
    mine = collectives.summarise_trace(calls, cluster.size)
    return collectives.combine(cluster.gather_json(mine))


def measure_communication(cfg: SweepConfig, store: ResultsStore, cluster: Cluster, build, source,
                          rng: random.Random, progress: Progress) -> dict:
    """For every (B, t) of the grid: the collectives of one forward, each timed alone, and their
    sum, the communication a forward pays. Resumes per point from ``store``."""
    built = build(source, cfg.dtype, cfg.bits, seed=cfg.seed)  # lazy: only its graph is built
    key = entry_key(built, cfg.context)
    entry = store.entry("communication", key, {"model": source.name, "context": cfg.context,
                                                "parallel": cluster.parallel, "ranks": cluster.size})
    progress.expect(len(cfg.batches) * len(cfg.tokens))
    timed: dict[tuple, dict] = {}
    for p in entry["points"].values():
        for o in p["ops"]:
            timed[(o["op"], tuple(o["shape"]), o["dtype"])] = {k: o[k] for k in o if k not in
                                                                ("count", "shape", "op", "dtype", "bytes")}
    for batch in cfg.batches:
        for tokens in cfg.tokens:
            label = point_key(batch, tokens)
            if label in entry["points"]:
                progress.advance(f"communication B={batch} t={tokens} (kept)")
                continue
            ops = trace_forward(built.model, cluster, batch, tokens)
            for op in ops:
                k = (op["op"], tuple(op["shape"]), op["dtype"])
                if k not in timed:
                    timed[k] = time_op(op, cluster, cfg.budget, rng)
                op.update(timed[k])
            entry["points"][label] = {"ops": ops, "total_s": sum(o["count"] * o["median_s"] for o in ops)}
            store.save()
            progress.advance(f"communication B={batch} t={tokens}")
    return entry


def time_op(op: dict, cluster: Cluster, budget: timing.Budget, rng: random.Random) -> dict:
    """Seconds of one collective of this kind and size (median over samples, all ranks together).
    A timed call chains at least as many as one forward makes, so the first one's cost (ranks
    idle since the barrier wake up) is spread as it is in a forward."""
    if op["op"] == "sendrecv":
        k = max(collectives.HOPS_PER_SAMPLE, op["count"])
    else:
        k = max(op["count"], timing.calibrate(
            lambda: None, batch=lambda _, n: collectives.op_point(op, cluster.group, n), max_k=256))
    point = collectives.op_point(op, cluster.group, k)
    m = timing.per_launch(timing.measure({0: point}, budget, rng)[0], k)
    return {"launches": k, "median_s": m["median_s"], "iqr_s": m["iqr_s"], "cv": m["cv"], "repeats": m["repeats"]}


# ---- the command ----


def default_folder(slug: str, cluster: Cluster) -> Path:
    return Path("reports") / f"{slug}-x{cluster.size}-{cluster.parallel}"


class MirrorStore(ResultsStore):
    """Ranks other than 0: rank 0's results, in memory; only rank 0 writes."""

    def __init__(self, path: Path, data: dict):  # noqa: super().__init__ would open the file
        self.path = Path(path)
        self.data = data

    def save(self) -> None:
        pass


def open_results(cluster: Cluster, out: Path | None) -> tuple[ResultsStore, dict]:
    """Rank 0 opens (or resumes) the results file and shares its contents; its errors are everyone's."""
    machine = hardware.detect()
    meta = metadata.collect(machine)
    meta["cluster"] = cluster.describe()
    stores: dict[str, ResultsStore] = {}

    def open_on_rank0() -> dict:
        folder = out or default_folder(machine.slug, cluster)
        stores["own"] = ResultsStore(folder / "results.json", meta)
        return {"path": str(stores["own"].path), "data": stores["own"].data}

    shared = cluster.from_rank0(open_on_rank0)
    store = stores.get("own") or MirrorStore(Path(shared["path"]), shared["data"])
    return store, meta


def run_cluster_sweep(cfg: SweepConfig, parallel: str, out: Path | None, memory_limit_bytes: int | None,
                      timeout: float, progress: Progress) -> dict | None:
    """Join the ranks, measure the sharded sweep and its communication; rank 0 gets the sweep
    document (with ``ranks``, ``backend``, ``hosts``, ``parallel`` and per-point communication),
    the other ranks None."""
    cluster = join(parallel, timeout)
    try:
        return _measure(cluster, cfg, out, memory_limit_bytes, progress if cluster.rank == 0 else Progress())
    except RuntimeError as err:  # MLX's report of a lost peer
        raise MacMoesdError(f"rank {cluster.rank}: lost the other ranks ({err}); {RESUME}") from None
    finally:
        cluster.watchdog.stop()


def _measure(cluster: Cluster, cfg: SweepConfig, out, memory_limit_bytes, progress: Progress) -> dict | None:
    store, meta = open_results(cluster, out)
    usable = memory.usable(memory_limit_bytes).usable_bytes
    agreed = None if usable is None else -cluster.largest([-usable])[0]
    sharded_by: dict = {}
    build = sharded_builder(cluster, sharded_by)
    sources = resolve_sources(cfg)
    with timing.synchronised(cluster), hardware.measuring_stage():
        document = run_sweep(cfg, store, agreed, progress, build=build, sources=sources)
        comm = measure_communication(cfg, store, cluster, build, sources.target, random.Random(cfg.seed + 1),
                                     progress)
    if cluster.rank != 0:
        return None
    document.update(cluster.describe())
    document["sharded_by"] = sharded_by.get("by")
    document["communication"] = comm
    for p in document["points"]:
        c = comm["points"].get(point_key(p["batch"], p["tokens"]))
        p["comm_s"] = c["total_s"] if c else None
        p["comm_share"] = c["total_s"] / p["median_s"] if c and p["median_s"] else None
    store.data.setdefault("cluster", {}).update(cluster.describe())
    store.save()
    document["meta"] = meta
    document["results_file"] = str(store.path)
    return document
