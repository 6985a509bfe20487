"""Measured SD speedup, to a stated precision, against both predictions.

Runs what `mac-moesd run` runs for one MoE, through the CLI, into one results folder: the quick
roofline, the sweep of the target with the drafter at the default budget, the fit, then SD over
B 1,2,4 x gamma 2,4, 32 tokens a run as `run` times them (emulated acceptance: random-weight
models accept nothing on their own), each configuration measured until the 95% CI of its median
speedup is within +-precision or its budget is spent. Each run carries two predictions
(docs/design.md §4.5): `measured`, from the round's parts timed by the SD stage beside its pairs,
and `model`, from the fit (both at the acceptance the run realised and its own context).

Goals on the CPU backend with OpenBLAS, on a quiet machine:
- every CI half-width <= 3% (a configuration whose budget ran out first says so);
- the `measured` prediction inside every CI widened by 3%;
- the `model` prediction's absolute error: median <= 5%, worst <= 10%.

    python benchmarks/sd_prediction.py [--model tiny-moe] [--draft tiny-draft] [--budget 120] [--out DIR]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GOAL_CI, GOAL_MEASURED, GOAL_MEDIAN, GOAL_WORST = 0.03, 0.03, 0.05, 0.10


def mac_moesd(*args: str) -> dict | None:
    cmd = [sys.executable, "-m", "mac_moesd", *args]
    print("$ mac-moesd " + " ".join(args), file=sys.stderr, flush=True)
    # Its stderr passes through: a failing stage's reason then reaches the log.
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out) if "--json" in args else None


def row(run: dict) -> dict:
    """One configuration's figures: the CI's half-width, both predictions and their errors."""
    low, high = run["measured_ci"]
    measured, by = run["measured_speedup"], run["predicted_by"]
    inside = (by["measured"] is not None
              and low * (1 - GOAL_MEASURED) <= by["measured"] <= high * (1 + GOAL_MEASURED))
    return {"half_width": (high - low) / 2 / measured, "inside": inside,
            "measured_error": None if by["measured"] is None else by["measured"] / measured - 1,
            "model_error": None if by["model"] is None else by["model"] / measured - 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--alpha", default="0.7")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence per SD run (as `spec` and `run`)")
    parser.add_argument("--budget", default="120", help="seconds per SD configuration")
    parser.add_argument("--precision", default="0.03")
    parser.add_argument("--out", help="results folder to keep (default: a temporary one)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sd-prediction-"))
    mac_moesd("roofline", "--quick", "--out", str(out))
    mac_moesd("sweep", args.model, "--draft", args.draft, "--batch", "1,2,4,8", "--tokens", "1,2,3,4,5,6,8",
              "--context", str(args.context), "--out", str(out))
    fitted = mac_moesd("fit", str(out), "--json")
    spec = mac_moesd("spec", args.model, "--draft", args.draft, "--batch", "1,2,4", "--gamma", "2,4",
                     "--alpha", args.alpha, "--mode", "emulated-acceptance", "--context", str(args.context),
                     "--tokens", str(args.tokens), "--budget", args.budget, "--precision", args.precision,
                     "--json", "--out", str(out))
    print(f"{args.model} with {args.draft}, context {args.context}: fit chose `{fitted['chosen']}`, held-out "
          f"MAPE {fitted['heldout_mape']:.1%}; SD to +-{float(args.precision):.0%} or {args.budget} s a configuration")
    start = fitted.get("draft_start") or {}
    if start.get("points"):
        print(f"fit's drafter start a round (chains after a verify, {start['points']} timed): "
              f"{start['a_s'] * 1e3:.3f} ms + {start['b_s'] * 1e3:.4f} ms x B")
    print(f"{'B':>3} {'gamma':>5} {'alpha':>5} {'pairs':>5} {'CV':>5} {'measured S [95% CI]':>22} {'+-':>6} "
          f"{'timed parts':>11} {'error':>7} {'fit':>6} {'error':>7} {'plain/sweep':>11}")
    rows = []
    for run in spec["runs"]:
        r = row(run)
        rows.append(r)
        low, high = run["measured_ci"]
        by = run["predicted_by"]
        sweep = run.get("plain_vs_sweep")
        cv = run.get("cv_pairs")
        print(f"{run['batch']:>3} {run['gamma']:>5} {run['measured_alpha']:>5.2f} {run['pairs']:>5} "
              f"{'-' if cv is None else f'{cv:.1%}':>5} "
              f"{run['measured_speedup']:>7.3f} [{low:.3f}-{high:.3f}] {r['half_width']:>6.1%} "
              f"{by['measured']:>11.3f} {r['measured_error']:>+7.1%}{'' if r['inside'] else '*'} "
              f"{by['model']:>6.3f} {r['model_error']:>+7.1%} {'-' if sweep is None else f'{sweep:.2f}':>11}")
    tight = sum(r["half_width"] <= GOAL_CI for r in rows)
    inside = sum(r["inside"] for r in rows)
    model = [abs(r["model_error"]) for r in rows if r["model_error"] is not None]
    met = (tight == len(rows) and inside == len(rows)
           and statistics.median(model) <= GOAL_MEDIAN and max(model) <= GOAL_WORST)
    print(f"CI within +-{GOAL_CI:.0%}: {tight} of {len(rows)} configurations (the others spent their budget)")
    print(f"timed-parts prediction inside the CI widened by {GOAL_MEASURED:.0%}: {inside} of {len(rows)} (* above: outside)")
    print(f"fit's prediction: median |error| {statistics.median(model):.1%}, worst {max(model):.1%} "
          f"(goal <= {GOAL_MEDIAN:.0%}, <= {GOAL_WORST:.0%})")
    print(f"all goals {'met' if met else 'NOT met'}; results in {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
