"""Wall time of a sweep against its number of points (the cost of the grid a user asks for).

    python benchmarks/sweep_cost.py [--model tiny-moe] [--seconds-per-point 0.2]
"""

import argparse
import tempfile
import time
from pathlib import Path

import mac_moesd  # noqa: F401  (loads OpenBLAS before mlx on Linux)

from mac_moesd.machine import metadata
from mac_moesd.measure.clock import timing
from mac_moesd.results import ResultsStore
from mac_moesd.measure.forward.sweep import SweepConfig, run_sweep

GRIDS = [((1,), (1, 2)), ((1, 2), (1, 2)), ((1, 2, 4), (1, 2, 4)), ((1, 2, 4, 8), (1, 2, 4, 8))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--seconds-per-point", type=float, default=0.2)
    args = parser.parse_args()
    budget = timing.Budget(seconds_per_point=args.seconds_per_point)
    meta = metadata.collect()
    print(f"{'points':>6}  {'wall s':>7}  {'s/point':>7}  (budget {args.seconds_per_point} s/point)")
    for batches, tokens in GRIDS:
        with tempfile.TemporaryDirectory() as folder:
            store = ResultsStore(Path(folder) / "results.json", meta)
            cfg = SweepConfig(model=args.model, batches=batches, tokens=tokens,
                              context=args.context, budget=budget)
            start = time.perf_counter()
            run_sweep(cfg, store, None)
            wall = time.perf_counter() - start
        n = len(batches) * len(tokens)
        print(f"{n:>6}  {wall:>7.1f}  {wall / n:>7.2f}")


if __name__ == "__main__":
    main()
