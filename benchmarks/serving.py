"""mlx_lm.server's plain aggregate tok/s at each concurrency against the sweep's B / T_T(B,1).

Sweeps the target (with the drafter's step, so the fit can also draw the SD lines), fits it, then
runs `mac-moesd serving` on the same pair into the same folder, and prints per concurrency the
server's aggregate, the fitted model's prediction at the requests' context, their ratio, and the
server's time per token beyond the forward (1/measured - 1/predicted per sequence-token). The
server adds HTTP, tokenization, detokenization and streaming, prefill of every request, and its
own scheduling; the suite's B/T_T(B,1) is a decode step alone.

    python benchmarks/serving.py [--target DIR --draft DIR] [--concurrency 1,4,16] [--window 10]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = Path(__file__).resolve().parent.parent / "tests" / "data" / "tiny-pair"


def mac_moesd(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "mac_moesd", *args], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"mac-moesd {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=str(TINY / "target"))
    parser.add_argument("--draft", default=str(TINY / "draft"))
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--window", default="10")
    parser.add_argument("--tokens", default="64")
    parser.add_argument("--prompts", default="code")
    parser.add_argument("--out", type=Path, default=None, help="Folder to keep [default: a temporary one].")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="serving-bench-"))
    batches = args.concurrency if "2" in args.concurrency.split(",") else "1,2," + args.concurrency
    mac_moesd("sweep", args.target, "--draft", args.draft, "--batch", batches, "--tokens", "1,2,3,4,6,8",
              "--context", "64", "--quick", "--out", str(out), "--json")
    mac_moesd("fit", str(out), "--json")
    doc = json.loads(mac_moesd("serving", args.target, "--draft", args.draft, "--concurrency", args.concurrency,
                               "--window", args.window, "--warmup", "3", "--tokens", args.tokens,
                               "--prompts", args.prompts, "--out", str(out), "--json"))
    predicted = {p["concurrency"]: p for p in doc["predicted"]}
    print(f"results: {out / 'results.json'}")
    print(f"{'B':>4} {'server tok/s':>13} {'B/T_T(B,1)':>11} {'ratio':>6} {'overhead/token':>15} {'generating':>11}")
    for leg in doc["legs"]:
        if leg["server"] != "plain":
            continue
        b, measured = leg["concurrency"], leg["aggregate_tok_s"]
        p = predicted.get(b, {}).get("plain_tok_s")
        extra = (b / measured - b / p) if p else None  # seconds per step of B tokens beyond the forward
        print(f"{b:>4} {measured:>13.0f} {p or float('nan'):>11.0f} {measured / p if p else float('nan'):>6.2f} "
              f"{(extra or float('nan')) * 1e3:>12.2f} ms {leg['in_flight']['mean']:>11.1f}")
    print(f"crossover: {doc['crossover_concurrency']} ({doc['crossover_reason'] or 'SD as served beats plain up to it'})")


if __name__ == "__main__":
    main()
