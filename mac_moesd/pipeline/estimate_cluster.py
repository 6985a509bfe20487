"""`mac-moesd run --dry-run --ranks n`: the sharded sweep of each MoE model, planned per rank.

What ``mlx.launch -n N ... sweep MODEL --parallel MODE`` would do on N machines of one kind: each
rank's shard is built lazily as ``sharding`` would split it for that rank (nothing allocated,
no group needed), its peak memory estimated against one machine's usable memory, and the
duration estimated as ``estimate`` does for one machine, per rank: a forward costs the slowest
rank's time (tensor, expert) or every stage's in turn (pipeline), plus the bytes its collectives
move over the link. The collectives are counted from the model's own forward (``collectives``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mac_moesd.errors import BadInput
from mac_moesd.inputs import models
from mac_moesd.machine import memory
from mac_moesd.measure.clock import timing
from mac_moesd.measure.cluster import collectives, sharding
from mac_moesd.measure.forward import sweep
from mac_moesd.measure.cluster.distributed import shard_built
from mac_moesd.pipeline import estimate as single
from mac_moesd.pipeline.plans import Plan

__all__ = ["LINK_GBPS", "PlannedGroup", "dry_run_cluster", "link_seconds", "rank_builds"]

# Thunderbolt 5: 80 Gb/s in each direction (Intel's Thunderbolt 5 announcement, Sept. 2023,
# https://www.intel.com/content/www/us/en/newsroom/news/thunderbolt-5-announcement.html);
# the M3 Ultra and M4 Pro/Max Mac Studio and Mac mini have it, earlier Macs Thunderbolt 4 (40).
LINK_GBPS = 80.0


@dataclass(frozen=True)
class PlannedGroup:
    """Rank ``r`` of ``n``: enough of a group for ``sharding`` to split a lazy model as that
    rank would (splitting reads only rank and size)."""

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


def rank_builds(source, dtype, bits, layers, parallel: str, ranks: int) -> list[models.Built]:
    """Every rank's shard of ``source`` (lazy)."""
    return [shard_built(models.build(source, dtype, bits, layers), parallel, PlannedGroup(r, ranks))[0]
            for r in range(ranks)]


def per_token_collectives(builds: list[models.Built]) -> list[dict]:
    """The collectives of a one-token forward over all ranks (their bytes scale with B*t)."""
    traces = []
    for b in builds:
        with collectives.traced(planned_ranks=len(builds)) as calls:
            b.model(mx.zeros((1, 1), dtype=mx.int32))
        traces.append(collectives.summarise_trace(calls, len(builds)))
    return collectives.combine(traces)


def link_seconds(ops: list[dict], tokens: int, ranks: int, link_bytes_s: float) -> float:
    """Bytes each rank sends per forward of ``tokens`` tokens over the link: a ring all-reduce
    sends 2(n-1)/n of the array, an all-gather (n-1) inputs, a hop one array (Patarasuk and Yuan,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009)."""
    factor = {"all_sum": 2 * (ranks - 1) / ranks, "all_gather": ranks - 1, "sendrecv": 1}
    return sum(o["count"] * o["bytes"] * tokens * factor[o["op"]] for o in ops) / link_bytes_s


def _forward(builds, parallel, rates, ops, link, batch, tokens, context) -> float:
    times = [single.forward_seconds(b, rates, batch, tokens, context) for b in builds]
    compute = sum(times) if parallel == "pipeline" else max(times)
    return compute + link_seconds(ops, batch * tokens, len(builds), link)


def _cluster_sweep_stage(plan: Plan, name: str, dtype: str, usable: int, rates: single.Rates,
                         parallel: str, ranks: int, link: float) -> dict:
    cfg = sweep.SweepConfig(model=name, batches=plan.batches, tokens=plan.tokens, context=plan.context,
                            dtype=dtype, bits=plan.bits, budget=plan.budget, draft=plan.draft)
    source = models.resolve(name)
    cfg, _ = sweep.timed_config(source, cfg)  # as the sweep will run it

    def largest_rank(source, dtype=None, bits=None, layers=None, seed=0):
        builds = rank_builds(source, dtype, bits, layers, parallel, ranks)
        return max(builds, key=lambda b: sweep.estimate_bytes(b, cfg))

    slices = sweep.plan_layers(source, cfg, usable, largest_rank)
    budget, big = plan.budget, max(plan.batches)
    peak, seconds, parts, rank_rows, ops = 0, 0.0, [], [], []
    for layers in slices:
        builds = rank_builds(source, dtype, plan.bits, layers, parallel, ranks)
        ops = per_token_collectives(builds)
        needs = [sweep.estimate(b, cfg) for b in builds]

        def forward(b, t, L=plan.context):
            return _forward(builds, parallel, rates, ops, link, b, t, L)

        seconds += max(single.materialise_seconds(b, rates) for b in builds)  # ranks load at once
        prefills = [single.prefill_seconds(b, rates, big, plan.context) for b in builds]
        seconds += sum(prefills) if parallel == "pipeline" else max(prefills)
        seconds += sum(single.grid_point_seconds(forward(b, t), budget, t) for b in plan.batches for t in plan.tokens)
        if cfg.second_context:  # the one-token points again at the second context
            seconds += sum(single.point_seconds(forward(b, min(plan.tokens), cfg.second_context), budget)
                           for b in plan.batches)
        seconds += single.point_seconds(forward(plan.batches[0], plan.tokens[0]), budget)  # the drift check
        # the communication benchmark: each collective timed for a point's budget, calibrated
        # evals lasting at least MIN_EVAL_S
        kinds = {(o["op"], o["bytes"] * b * t) for o in ops for b in plan.batches for t in plan.tokens}
        seconds += len(kinds) * single.point_seconds(timing.MIN_EVAL_S, budget)
        peak = max(peak, max(n["peak_bytes"] for n in needs))
        parts.append({"layers": layers, "peak_bytes": max(n["peak_bytes"] for n in needs)})
        rank_rows = [{"rank": r, "layers": b.config["num_hidden_layers"], "weights_bytes": b.footprint["bytes_total"],
                      "peak_bytes": n["peak_bytes"], "phase": n["phase"]}
                     for r, (b, n) in enumerate(zip(builds, needs))]
    if cfg.draft:  # none in a pair run drafted without a model (prompt lookup, an MTP head)
        draft = models.build(models.resolve(cfg.draft), dtype, plan.bits)  # whole, on every rank
        draft_need = sweep.estimate(draft, sweep.draft_config(cfg))
        peak = max(peak, draft_need["peak_bytes"])
        seconds += single.materialise_seconds(draft, rates) + single.prefill_seconds(draft, rates, big, plan.context)
        seconds += sum(single.grid_point_seconds(single.forward_seconds(draft, rates, b, 1, plan.context), budget, 1)
                       for b in plan.batches)
    vocab = source.config["vocab_size"]
    peak = max(peak, memory.rejection_bytes(vocab, big, cfg.gamma))
    seconds += sum(single.point_seconds(memory.rejection_bytes(vocab, b, cfg.gamma) / rates.bandwidth_bytes_s,
                                        budget) for b in plan.batches)
    verify = plan.tokens[-1]
    return {"stage": f"sweep {name} ({parallel} x{ranks})", "models": [name, *([cfg.draft] if cfg.draft else [])],
            "layers": slices, "layers_full": int(source.config["num_hidden_layers"]), "extrapolated": len(slices) > 1,
            "grid": {"batch": list(plan.batches), "tokens": list(plan.tokens)}, "context": plan.context,
            "slices": parts, "ranks": rank_rows, "collectives_per_token": ops,
            "comm_share_batch1": {
                str(t): link_seconds(ops, t, ranks, link) / _forward(
                    builds, parallel, rates, ops, link, 1, t, plan.context) for t in (1, verify)},
            "peak_bytes": peak, "eta_s": seconds}


def dry_run_cluster(plan: Plan, backend: str, chip: str, memory_bytes: int | None, usable: memory.Usable,
                    rates: single.Rates | None, ranks: int, parallel: str, link_gbps: float) -> dict:
    """Each MoE model of ``plan`` swept sharded over ``ranks`` machines like this one."""
    if ranks < 2:
        raise BadInput("--ranks must be at least 2 for a sharded plan")
    if parallel not in sharding.MODES:
        raise BadInput(f"--parallel must be one of {', '.join(sharding.MODES)}")
    if rates is None:
        raise BadInput("no bandwidth or FLOPS for this machine: run `mac-moesd roofline` first, or give --chip")
    dtype = "float16" if backend != "cpu" else "float32"
    link = link_gbps * 1e9 / 8
    budget = usable.usable_bytes
    stages = [single.roofline_stage(plan, single.Sizing(backend, budget, rates))]
    for name in plan.moe:
        stages.append(single.guarded(f"sweep {name} ({parallel} x{ranks})", (name,), _cluster_sweep_stage,
                                     plan, name, dtype, budget, rates, parallel, ranks, link))
    for s in stages:
        s["fits"] = s["peak_bytes"] <= budget
    whole = {name: models.build(models.resolve(name), dtype, plan.bits).footprint["bytes_total"] for name in plan.moe}
    return {
        "chip": chip, "backend": backend, "dtype": dtype, "bits": plan.bits, "ranks": ranks, "parallel": parallel,
        "memory_bytes": memory_bytes, "usable_bytes": budget, "usable": usable.to_dict(),
        "rates": {"bandwidth_bytes_s": rates.bandwidth_bytes_s, "flops": rates.flops, "source": rates.source},
        "link": {"bandwidth_bytes_s": link, "gbps": link_gbps,
                 "source": "--link-gbps" if link_gbps != LINK_GBPS else "Thunderbolt 5 (80 Gb/s each way)"},
        "whole_model_bytes": whole,
        "stages": stages, "eta_s": sum(s["eta_s"] for s in stages),
        "not_estimated": ["per-collective latency (no published figure; the sharded sweep measures it)",
                          "routing and spec (they run on one machine: plan them without --ranks)",
                          "fit", "report"],
    }

