"""Predicted against measured SD speedup (goal on the CPU backend with OpenBLAS: median absolute
error <= 5%, worst <= 10%).

Runs what `mac-moesd run` runs for one MoE, through the CLI, into one results folder: the quick
roofline, the sweep of the target with the drafter at the default budget, the fit, then measured
SD over B 1,2,4 x gamma 2,4 (emulated acceptance: random-weight models accept nothing on their
own), each predicted by the fit at the run's alpha and context. Prints every pair with its error.

    python benchmarks/sd_prediction.py [--model tiny-moe] [--draft tiny-draft] [--out DIR]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GOAL_MEDIAN, GOAL_WORST = 0.05, 0.10


def mac_moesd(*args: str) -> dict | None:
    cmd = [sys.executable, "-m", "mac_moesd", *args]
    print("$ mac-moesd " + " ".join(args), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out) if "--json" in args else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--alpha", default="0.7")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence per SD run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="results folder to keep (default: a temporary one)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sd-prediction-"))
    mac_moesd("roofline", "--quick", "--out", str(out))
    mac_moesd("sweep", args.model, "--draft", args.draft, "--batch", "1,2,4,8", "--tokens", "1,2,3,4,5,6,8",
              "--context", str(args.context), "--out", str(out))
    fitted = mac_moesd("fit", str(out), "--json")
    spec = mac_moesd("spec", args.model, "--draft", args.draft, "--batch", "1,2,4", "--gamma", "2,4",
                     "--alpha", args.alpha, "--mode", "emulated-acceptance", "--context", str(args.context),
                     "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--out", str(out), "--json")
    pipe = fitted.get("pipelining", {})
    print(f"{args.model} with {args.draft}, context {args.context}: fit chose `{fitted['chosen']}`, "
          f"held-out MAPE {fitted['heldout_mape']:.1%}; pipelining hides {pipe.get('target_s', 0) * 1e3:.2f} ms "
          f"per target forward, {pipe.get('draft_s', 0) * 1e3:.2f} ms per draft step")
    print(f"{'B':>3} {'gamma':>5} {'alpha':>5} {'measured':>9} {'predicted':>9} {'error':>7}  CV plain/SD")
    errors = []
    for r in spec["runs"]:
        err = r["predicted_speedup"] / r["measured_speedup"] - 1
        errors.append(abs(err))
        print(f"{r['batch']:>3} {r['gamma']:>5} {r['alpha']:>5.2f} {r['measured_speedup']:>9.3f} "
              f"{r['predicted_speedup']:>9.3f} {err:>+7.1%}  {r['cv_plain']:.0%}/{r['cv_sd']:.0%}")
    median, worst = statistics.median(errors), max(errors)
    met = median <= GOAL_MEDIAN and worst <= GOAL_WORST
    print(f"median |error| {median:.1%} (goal <= {GOAL_MEDIAN:.0%}), worst {worst:.1%} "
          f"(goal <= {GOAL_WORST:.0%}): {'met' if met else 'NOT met'}; results in {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
