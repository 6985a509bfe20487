"""The timed points every forward measurement is made of: one synchronous forward over a rolled-back
cache, a pipelined chain of forwards as mlx-lm's generation loops run them, and rejection
sampling. The sweep's grid, the drafter's chains and the SD stage's round parts are built from
them, so each is timed the same way wherever it appears."""

from __future__ import annotations

import mlx.core as mx

from mac_moesd.measure.caches.rolled_cache import RolledBackCache
from mac_moesd.measure.clock import timing
from mac_moesd.measure.decoding.sampling import random_ids, rejection_sample
from mac_moesd.measure.experts.routing_control import SweepRouting

__all__ = ["PIPELINED_STEPS", "forward_point", "pipelined_point", "reject_point"]

PIPELINED_STEPS = 8  # forwards per pipelined sample of t > 1 tokens (verify-sized windows)


def forward_point(model, cache: RolledBackCache, batch: int, tokens: int, vocab: int,
                  control: SweepRouting | None = None, inputs: mx.array | None = None) -> timing.Point:
    """One grid point, fed ``inputs`` (default: random ids); with ``control`` its routing is
    prepared here, before any timing."""
    if inputs is None:
        inputs = mx.random.randint(0, vocab, (batch, tokens))
    mx.eval(inputs)

    def run():
        return model(inputs, cache=cache.cache), cache.state()

    if control is None:
        return timing.Point(run=run, reset=lambda: cache.rollback(tokens))
    control.prepare(batch, tokens, run, lambda: cache.rollback(tokens))
    return timing.Point(run=lambda: control.run(batch, tokens, run), reset=lambda: cache.rollback(tokens))


def pipelined_point(model, cache: RolledBackCache, batch: int, tokens: int, vocab: int,
                    control: SweepRouting | None = None, steps: int = PIPELINED_STEPS) -> timing.Point:
    """``steps`` forwards of B x t tokens, each fed ids drawn from the previous one's argmax (a real
    data dependency, as in decoding; random ids, as the synchronous points are fed, since a
    random-weight model's own argmax repeats one token), each next graph built and queued with
    ``mx.async_eval`` before waiting on the current one: the loop of mlx-lm's ``generate_step``.
    One sample covers all ``steps``; ``timing.per_launch`` turns it into seconds per forward.

    The cache is rolled back as soon as each forward's graph is built (the arrays it wrote stay
    in the graph), so every forward of the chain runs at the point's context, as the synchronous
    one does: their difference is then the graph-build time pipelining hides, not the attention
    over the 8 t tokens a growing chain would add. With ``control`` every forward of the chain
    runs the point's prepared routing."""
    inputs = mx.random.randint(0, vocab, (batch, tokens))
    mx.eval(inputs)

    def step(x: mx.array) -> mx.array:
        token = random_ids(mx.argmax(model(x, cache=cache.cache), axis=-1), vocab)
        cache.rollback(tokens, settle=False)
        return token

    def run():
        return timing.pipelined(step, inputs, steps)[-1], cache.state()

    if control is None:
        return timing.Point(run=run, reset=cache.reset)
    control.prepare(batch, tokens, lambda: (model(inputs, cache=cache.cache), cache.state()),
                    lambda: cache.rollback(tokens))
    return timing.Point(run=lambda: control.run(batch, tokens, run), reset=cache.reset)


def reject_point(batch: int, gamma: int, vocab: int) -> timing.Point:
    target = mx.random.normal((batch, gamma + 1, vocab))
    draft = mx.random.normal((batch, gamma, vocab))
    tokens = mx.random.randint(0, vocab, (batch, gamma))
    mx.eval(target, draft, tokens)
    return timing.Point(run=lambda: rejection_sample(target, draft, tokens))
