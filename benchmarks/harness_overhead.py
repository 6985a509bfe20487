"""Overhead of our timer against a bare `mx.eval` loop on the same forward (goal: <= 2%).

Both time one decode step of a model over a prefilled KV cache, trimmed back after each call;
the bare loop is the least a correct measurement can do. Prints the ratio of the medians.

    python benchmarks/harness_overhead.py [--model tiny-moe] [--context 64] [--repeats 200]
"""

import argparse
import random
import statistics
import time

import mac_moesd  # noqa: F401  (loads OpenBLAS before mlx on Linux)
import mlx.core as mx

from mac_moesd.inputs import models
from mac_moesd.measure.clock import timing
from mac_moesd.measure.forward import sweep


def bare_loop(model, cache, inputs, repeats):
    values = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(model(inputs, cache=cache.cache), cache.state())
        values.append(time.perf_counter() - start)
        cache.rollback(inputs.shape[1])
    return statistics.median(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    built = models.build(models.resolve(args.model))
    built.materialise()
    vocab = built.config["vocab_size"]
    cache = sweep.RolledBackCache(built.model, 1, args.context, vocab)
    point = sweep.forward_point(built.model, cache, 1, 1, vocab)
    inputs = mx.random.randint(0, vocab, (1, 1))
    budget = timing.Budget(warmup=5, min_repeats=args.repeats, max_repeats=args.repeats,
                           seconds_per_point=1e9, target_ci=0.0)
    ours, bare = [], []
    for _ in range(args.rounds):  # alternate, so drift hits both alike
        bare.append(bare_loop(built.model, cache, inputs, args.repeats))
        ours.append(timing.measure({"p": point}, budget, random.Random(0))["p"]["median_s"])
    ratio = statistics.median(ours) / statistics.median(bare)
    print(f"model {args.model}, context {args.context}, {args.rounds} rounds x {args.repeats} calls")
    print(f"bare mx.eval loop median: {statistics.median(bare) * 1e3:.3f} ms")
    print(f"mac-moesd timer median:   {statistics.median(ours) * 1e3:.3f} ms")
    print(f"ratio (ours / bare): {ratio:.4f}  overhead {ratio - 1:+.2%}  goal <= +2%")


if __name__ == "__main__":
    main()
