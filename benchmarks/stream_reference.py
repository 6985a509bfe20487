"""Our read/copy/triad bandwidth against plain references on the same machine, in the same run.

References: numpy (sum, copyto, and b + s*c into a preallocated array) and, when a C compiler
exists, a STREAM-style C program (one thread, arrays far past the caches). Goal: ours >= 0.95x
the best reference for each operation. Prints every figure and the ratios.

    python benchmarks/stream_reference.py [--mib 256] [--repeats 10]
"""

import argparse
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import mac_moesd  # noqa: F401  (loads OpenBLAS before mlx on Linux)
import mlx.core as mx
import numpy as np

from mac_moesd.measure.clock import timing
from mac_moesd.measure.peaks import kernels, roofline

C_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }
int main(int argc, char **argv) {
    size_t n = strtoull(argv[1], 0, 10); int reps = atoi(argv[2]);
    float *a = malloc(n * 4), *b = malloc(n * 4), *c = malloc(n * 4);
    for (size_t i = 0; i < n; i++) { a[i] = 1.0f; b[i] = 2.0f; c[i] = 0.0f; }
    double *t = malloc(sizeof(double) * reps); volatile float sink = 0;
    const char *names[3] = {"read", "copy", "triad"}; double bytes[3] = {4.0 * n, 8.0 * n, 12.0 * n};
    for (int op = 0; op < 3; op++) {
        for (int r = 0; r < reps; r++) {
            double s = now(); float acc = 0;
            if (op == 0) { for (size_t i = 0; i < n; i++) acc += a[i]; sink = acc; }
            if (op == 1) { for (size_t i = 0; i < n; i++) c[i] = a[i]; }
            if (op == 2) { for (size_t i = 0; i < n; i++) c[i] = b[i] + 3.0f * a[i]; }
            t[r] = now() - s;
        }
        qsort(t, reps, sizeof(double), cmp);
        if (op == 1 && c[n / 2] != 1.0f) return 2;
        if (op == 2 && c[n / 2] != 5.0f) return 3;
        printf("%s %f\n", names[op], bytes[op] / t[reps / 2] / 1e9);
    }
    return 0;
}
"""


def median_time(fn, repeats):
    values = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        values.append(time.perf_counter() - start)
    return statistics.median(values)


def numpy_reference(n, repeats):
    a, b = np.ones(n, np.float32), np.full(n, 2.0, np.float32)
    out = np.empty_like(a)

    def triad():
        np.multiply(a, np.float32(3.0), out=out)
        np.add(out, b, out=out)

    return {
        "read": 4 * n / median_time(lambda: a.sum(), repeats) / 1e9,
        "copy": 8 * n / median_time(lambda: np.copyto(out, a), repeats) / 1e9,
        # two passes over out: 5 arrays moved, counted as STREAM's 3 like every other row
        "triad": 12 * n / median_time(triad, repeats) / 1e9,
    }


def c_reference(n, repeats):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "stream.c", Path(tmp) / "stream"
        src.write_text(C_SOURCE)
        subprocess.run([cc, "-O2", "-o", str(exe), str(src)], check=True)
        out = subprocess.run([str(exe), str(n), str(repeats)], capture_output=True, text=True, check=True).stdout
    return {line.split()[0]: float(line.split()[1]) for line in out.splitlines()}


def ours(n, repeats):
    cfg = roofline.RooflineConfig(sizes=(4 * n,), plateau_from=4 * n,
                                  budget=timing.Budget(min_repeats=repeats, max_repeats=repeats,
                                                       seconds_per_point=1e9, target_ci=0.0))
    rows = roofline.stream_sweep(kernels.Kernels.build(), cfg, random.Random(0), lambda label: None)
    return {r["op"]: r["gbs"] for r in rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    n = args.mib * 2**20 // 4
    results = {"mac-moesd": ours(n, args.repeats), "numpy": numpy_reference(n, args.repeats)}
    c = c_reference(n, args.repeats)
    if c:
        results["C (cc -O2, 1 thread)"] = c
    print(f"{args.mib} MiB per array, median of {args.repeats}; GB/s (STREAM byte counts)")
    print(f"{'':24}" + "".join(f"{op:>10}" for op in ("read", "copy", "triad")))
    for name, row in results.items():
        print(f"{name:24}" + "".join(f"{row[op]:>10.2f}" for op in ("read", "copy", "triad")))
    for op in ("read", "copy", "triad"):
        best = max(row[op] for name, row in results.items() if name != "mac-moesd")
        print(f"{op}: ours / best reference = {results['mac-moesd'][op] / best:.2f}  (goal >= 0.95)")
    print(f"kernel path: {kernels.Kernels.build().reason}; backend {mx.default_device()}")


if __name__ == "__main__":
    main()
