"""The drafter's chain as an SD round runs it: gamma one-token steps, each next graph queued before
waiting on the current one, evaluated once a round, right after the target's verify forward.

The drafter's grid points are timed back to back (``timing.measure`` takes several samples a
visit), so each finds the machine as the drafter's own last forward left it. In a round the chain
follows the target's verify of gamma + 1 tokens, and pays for that: on the CPU backend with
OpenBLAS, where a small drafter's weights fit in the processor's caches, the target's forward
presumably evicts them (in one process, tiny-draft after a tiny-moe verify, B = 1, 2, 4: chains of 1, 2 and
4 steps 0.65-0.67, 0.8-1.2 and 1.1-1.5 ms longer than the same chains timed back to back, against
a step of 1.5-2.4 ms). The fit prices the difference between these chains and its own drafter
steps as a term a round (``analysis.round_terms``); on a Mac the same points say whether the GPU
pays anything like it.

The chains are timed at gamma 1, 2 and the sweep's gamma, at every batch of the sweep, with the
target whole beside the drafter (both as the SD stage holds them); a target that had to be
sliced to fit is not timed with its drafter, and the fit says the term is missing.
"""

from __future__ import annotations

import random
from dataclasses import replace
from functools import partial

from mac_moesd.inputs import models
from mac_moesd.measure.caches.rolled_cache import RolledBackCache, batch_caches
from mac_moesd.measure.clock import timing
from mac_moesd.measure.forward.points import forward_point, pipelined_point
from mac_moesd.progress import Progress
from mac_moesd.results import point_key
from mac_moesd.results.keys import CHAIN_POINTS, chain_points

__all__ = ["chain_gammas", "chain_point", "chain_rows", "measure_chains"]


def chain_gammas(gamma: int) -> tuple[int, ...]:
    """The draft lengths whose chains are timed: one step, two, and the sweep's gamma (the start
    is paid mostly by the first steps, so the short chains tell its shape)."""
    return tuple(sorted({1, 2, gamma}))


def chain_point(target, target_cache: RolledBackCache, draft, draft_cache: RolledBackCache, batch: int,
                gamma: int, vocab: int) -> timing.Point:
    """gamma drafter steps chained as the loops chain them (``pipelined_point``), evaluated once,
    each sample preceded (untimed) by a target forward of gamma + 1 tokens, rolled back."""
    verify = forward_point(target, target_cache, batch, gamma + 1, vocab)
    chain = pipelined_point(draft, draft_cache, batch, 1, vocab, steps=gamma)
    return replace(chain, before=partial(timing.run_untimed, verify))


def chain_rows(entry: dict) -> list[dict]:
    """The chains as a sweep document lists them: {batch, gamma, median_s, ...} without the samples."""
    return [{"batch": b, "gamma": g, **{k: v for k, v in entry[CHAIN_POINTS][point_key(b, g)].items()
                                        if k != "samples_s"}}
            for b, g, _ in chain_points(entry)]


def measure_chains(target: models.Built, draft: models.Built, batches: tuple[int, ...], gamma: int, context: int,
                   entry: dict, budget: timing.Budget, save, progress: Progress, rng: random.Random) -> None:
    """Time the chains missing from ``entry[CHAIN_POINTS]`` at every batch, on one prefill of
    each model at the largest batch (copies of its rows for the smaller ones), saving each."""
    kept = entry.setdefault(CHAIN_POINTS, {})
    todo = [(b, g) for b in batches for g in chain_gammas(gamma) if point_key(b, g) not in kept]
    for b in sorted(set(batches) - {b for b, _ in todo}):
        progress.advance(f"{draft.source.name} chain after the target B={b} (kept)")
    if not todo:
        return
    vocab = min(target.config["vocab_size"], draft.config["vocab_size"])  # ids both models embed
    big = max(b for b, _ in todo)
    wanted = {b for b, _ in todo}
    target_caches = batch_caches(RolledBackCache(target.model, big, context, vocab), wanted)
    draft_caches = batch_caches(RolledBackCache(draft.model, big, context, vocab), wanted)
    points = {(b, g): chain_point(target.model, target_caches[b], draft.model, draft_caches[b], b, g, vocab)
              for b, g in todo}

    def done(key, m):
        b, g = key
        kept[point_key(b, g)] = m
        save()
        if all(point_key(b, x) in kept for x in chain_gammas(gamma)):
            progress.advance(f"{draft.source.name} chain after the target B={b}")

    timing.measure(points, budget, rng, on_done=done, group=lambda key: key[0])
