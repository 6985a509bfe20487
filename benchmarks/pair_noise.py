"""The machine's own noise floor for the SD stage's pairs: plain decoding timed against itself.

The SD stage measures a speedup as the median of (plain, SD) pairs, adding pairs until the 95% CI
of that median is within +-3% (docs/design.md §4.5). How many pairs that takes is set by how much
one pair's ratio varies. This script times the suite's own plain run (``Decoder.plain``: pipelined
one-token steps of the target, the caches reset to the prompt before each run) against itself,
A then B, where both are the same plain decode, so every bit of the ratio's spread is the machine's:

1. A/A pairs at several run lengths (tokens per run), taking turns (a pair of each length per
   turn, in shuffled order) for ``--seconds`` times the number of lengths, so that every length
   sees the same phases of the machine: the per-pair CV, the pairs a +-3% CI of the median would
   need at that CV (normal approximation: the median's standard error is 1.2533 sigma /
   sqrt(n)), and the seconds of timed decoding that takes.
2. A series of synchronous one-token steps: their CV and autocorrelation by lag, which say whether
   the noise is independent from token to token (then a run's CV falls as 1/sqrt(tokens)) or comes
   in slower phases (then it does not, and no pair schedule of whole runs removes it).

    python benchmarks/pair_noise.py [--model tiny-moe] [--batch 1] [--tokens 8,16,32,64] [--seconds 30]
"""

import argparse
import random
import statistics
import time

import mac_moesd  # noqa: F401  (loads OpenBLAS before mlx on Linux)
import mlx.core as mx
import numpy as np

from mac_moesd.inputs import models
from mac_moesd.measure.sd.speedup import settle
from mac_moesd.measure.decoding.sd_loop import Decoder

MEDIAN_EFFICIENCY = 1.2533  # the sample median's standard error over the mean's, normal data
TARGET = 0.03


def aa_pairs(decoder: Decoder, lengths: list[int], seconds: float, seed: int = 0
             ) -> dict[int, tuple[list[float], float]]:
    """Ratios of back-to-back plain runs (A's tokens/s over B's) at each run length, and the mean
    timed seconds of a pair. The lengths take turns, one pair of each in a shuffled order per
    turn, for ``seconds`` times the number of lengths: every length sees the same phases of the
    machine."""
    def run(tokens: int) -> float:
        decoder.reset()
        settle()
        start = time.perf_counter()
        decoder.plain(tokens)
        return time.perf_counter() - start

    for tokens in lengths:  # warm-up: every shape compiled
        run(tokens), run(tokens)
    ratios: dict[int, list[float]] = {t: [] for t in lengths}
    timed: dict[int, list[float]] = {t: [] for t in lengths}
    order, rng = list(lengths), random.Random(seed)
    end = time.perf_counter() + seconds * len(lengths)
    while time.perf_counter() < end:
        rng.shuffle(order)
        for tokens in order:
            a, b = run(tokens), run(tokens)
            ratios[tokens].append(b / a)
            timed[tokens].append(a + b)
    return {t: (ratios[t], statistics.mean(timed[t])) for t in lengths}


def step_series(decoder: Decoder, seconds: float, cycle: int = 64) -> np.ndarray:
    """Seconds of each synchronous one-token step, the caches reset every ``cycle`` steps."""
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        decoder.reset()
        token = decoder.pending
        for _ in range(cycle):
            start = time.perf_counter()
            token = decoder.target(token, cache=decoder.target_cache)[:, -1:].argmax(-1)
            mx.eval(token)
            times.append(time.perf_counter() - start)
    return np.array(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", default="8,16,32,64", help="run lengths to try")
    parser.add_argument("--seconds", type=float, default=30.0, help="per run length, and for the step series")
    args = parser.parse_args()

    built = models.build(models.resolve(args.model))
    built.materialise()
    vocab = built.config["vocab_size"]
    prompt = mx.random.randint(0, vocab, (args.batch, args.context + 1))
    decoder = Decoder(built.model, None, prompt)

    print(f"{args.model}, batch {args.batch}, context {args.context}: plain runs timed against themselves")
    print("tokens  pairs  per-pair CV  pairs for +-3%  timed s for +-3%")
    lengths = [int(t) for t in args.tokens.split(",")]
    for tokens, (ratios, pair_s) in aa_pairs(decoder, lengths, args.seconds).items():
        cv = statistics.stdev(ratios) / statistics.mean(ratios)
        needed = (1.96 * MEDIAN_EFFICIENCY * cv / TARGET) ** 2
        print(f"{tokens:6d}  {len(ratios):5d}  {cv:10.1%}  {needed:14.0f}  {needed * pair_s:16.1f}")

    steps = step_series(decoder, args.seconds)
    centred = steps - steps.mean()
    lags = [lag for lag in (1, 2, 4, 8, 16, 32) if lag < len(steps) // 2]
    autocorr = [float(np.corrcoef(centred[:-lag], centred[lag:])[0, 1]) for lag in lags]
    cv = steps.std() / steps.mean()
    print(f"\n{len(steps)} synchronous steps: median {np.median(steps) * 1e3:.2f} ms, CV {cv:.1%}")
    print("autocorrelation by lag: " + ", ".join(f"{lag}: {a:.2f}" for lag, a in zip(lags, autocorr)))
    for tokens in [int(t) for t in args.tokens.split(",")]:
        # A pair's ratio has two runs' noise: sqrt(2) times one run's CV.
        print(f"  a {tokens}-token pair's CV if steps were independent: {cv * np.sqrt(2 / tokens):.1%}")


if __name__ == "__main__":
    main()
