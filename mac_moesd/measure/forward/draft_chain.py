"""The drafter's chain as an SD round runs it: gamma one-token steps, each queued as it is built
and nothing waited for until the round's verify needs the drafts, right after the target's
verify forward. (Until 2026-12-07 the chain waited on each step's token as a generation loop
does; on tiny-moe's round at B=1, gamma 4 that chain cost 8.05 ms where the loop's drafting took
7.29 ms, `benchmarks/round_phases.py`. The figures below are from those chains.)

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
target beside the drafter, as the SD stage holds them, into the target's sweep entry (they are
the pair's, not the drafter's alone: ``keys.chains_of``). A target too big for memory is swept in
slices, and its chains follow the verify of its larger slice: what the chain pays is the
drafter's weights gone from the caches the target's forward passed through, and a slice of such
a target reads far more bytes than any cache holds, as the whole target would.
"""

from __future__ import annotations

import random
from functools import partial

import mlx.core as mx

from mac_moesd.inputs import models
from mac_moesd.measure.caches.rolled_cache import RolledBackCache, batch_caches
from mac_moesd.measure.clock import timing
from mac_moesd.measure.decoding.sampling import random_ids
from mac_moesd.measure.forward.points import forward_point
from mac_moesd.progress import Progress
from mac_moesd.results import point_key
from mac_moesd.results.keys import chain_points

__all__ = ["chain_gammas", "chain_point", "chain_rows", "measure_chains", "missing"]


def chain_gammas(gamma: int) -> tuple[int, ...]:
    """The draft lengths whose chains are timed: one step, two, and the sweep's gamma (the start
    is paid mostly by the first steps, so the short chains tell its shape)."""
    return tuple(sorted({1, 2, gamma}))


def chain_point(target, target_cache: RolledBackCache, draft, draft_cache: RolledBackCache, batch: int,
                gamma: int, vocab: int, catch_up: bool = False) -> timing.Point:
    """gamma drafter steps chained as both loops draft (the suite's ``Decoder.speculative``,
    mlx-lm's ``_draft_generate``): each step's token queued with ``mx.async_eval`` and the next
    step built on it at once, nothing waited for until the chain's end (unlike a generation
    loop, which reads each token as it arrives: ``pipelined_point``); each sample preceded
    (untimed) by a target forward of gamma + 1 tokens, rolled back, and the drafter's cache
    taken back to the prompt after it. ``catch_up``: the drafting of a round after one that
    accepted every draft, in the suite's loop: the drafter's forward of that round's last draft,
    queued unread, then the chain (the catch-up, not the chain, then meets the drafter's start)."""
    verify = forward_point(target, target_cache, batch, gamma + 1, vocab)
    first = mx.random.randint(0, vocab, (batch, 1))
    mx.eval(first)

    def run():
        token, drafts = first, []
        if catch_up:
            draft(first, cache=draft_cache.cache)
        for _ in range(gamma):
            token = random_ids(mx.argmax(draft(token, cache=draft_cache.cache)[:, -1:], axis=-1), vocab)
            mx.async_eval(token)
            drafts.append(token)
        return drafts, draft_cache.state()

    return timing.Point(run=run, reset=draft_cache.reset, before=partial(timing.run_untimed, verify))


def chain_rows(record: dict) -> list[dict]:
    """A chain record's chains as a sweep document lists them: {batch, gamma, median_s, ...}
    without the samples."""
    return [{"batch": b, "gamma": g, **{k: v for k, v in record["points"][point_key(b, g)].items()
                                        if k != "samples_s"}}
            for b, g, _ in chain_points(record)]


def missing(record: dict, batches: tuple[int, ...], gamma: int) -> list[tuple[int, int]]:
    """The (batch, gamma) chains a record lacks."""
    return [(b, g) for b in batches for g in chain_gammas(gamma) if point_key(b, g) not in record["points"]]


def measure_chains(target: models.Built, draft: models.Built, todo: list[tuple[int, int]], context: int,
                   record: dict, budget: timing.Budget, save, progress: Progress, rng: random.Random) -> None:
    """Time the (batch, gamma) chains ``todo`` into ``record["points"]``, on one prefill of each
    model at the largest batch (copies of its rows for the smaller ones), saving each; a batch's
    progress step is counted when its last chain is done."""
    vocab = min(target.config["vocab_size"], draft.config["vocab_size"])  # ids both models embed
    wanted = {b for b, _ in todo}
    big = max(wanted)
    target_caches = batch_caches(RolledBackCache(target.model, big, context, vocab), wanted)
    draft_caches = batch_caches(RolledBackCache(draft.model, big, context, vocab), wanted)
    points = {(b, g): chain_point(target.model, target_caches[b], draft.model, draft_caches[b], b, g, vocab)
              for b, g in todo}
    left = {b: sum(1 for x, _ in todo if x == b) for b in wanted}

    def done(key, m):
        b, g = key
        record["points"][point_key(b, g)] = m
        save()
        left[b] -= 1
        if not left[b]:
            progress.advance(f"{draft.source.name} chain after the target B={b}")

    timing.measure(points, budget, rng, on_done=done, group=lambda key: key[0])
