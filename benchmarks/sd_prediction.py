"""Predicted against measured SD speedup (goal on the CPU backend with OpenBLAS: median absolute
error <= 5%, worst <= 10%).

Runs what `mac-moesd run` runs for one MoE, through the CLI, into one results folder: the quick
roofline, the sweep of the target with the drafter at the default budget, the fit, then measured
SD over B 1,2,4 x gamma 2,4 (emulated acceptance: random-weight models accept nothing on their
own), each predicted by the fit at the run's alpha and context. The SD measurement is then
repeated, and the sweep and fit too, into a second folder, so that each side is taken twice and
the two sweeps bracket the two SD measurements in time: how far the two measurements, and the two
predictions, of the same thing fall apart is the floor under any prediction's error on this
machine. The mean of the two predictions is judged against the mean of the two measurements.

For each configuration it prints the speedup error and the two terms behind it (from the first
measurement): the plain decode step and the SD round (gamma draft steps, the verify forward, rejection sampling), each
predicted from the fit and measured in the SD run (plain: batch / plain tokens/s; round: tokens
per round * batch / SD tokens/s).

    python benchmarks/sd_prediction.py [--model tiny-moe] [--draft tiny-draft] [--out DIR]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mac_moesd.analysis.fit import FittedModel, decoding_context, run_alpha

GOAL_MEDIAN, GOAL_WORST = 0.05, 0.10


def mac_moesd(*args: str) -> dict | None:
    cmd = [sys.executable, "-m", "mac_moesd", *args]
    print("$ mac-moesd " + " ".join(args), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out) if "--json" in args else None


def predicted_terms(model: FittedModel, run: dict, new_tokens: int) -> tuple[float, float]:
    """(plain step, SD round) in seconds, as the fit predicts them for this run."""
    g = run["gamma"]
    plain, verify, draft, reject = model.step_times(run["batch"], g, decoding_context(run["context"], new_tokens))
    return float(plain), float(g * draft + verify + reject)


def measured_terms(run: dict) -> tuple[float, float]:
    b = run["batch"]
    return b / run["tokens_per_s_plain"], (1 + run["mean_accepted"]) * b / run["tokens_per_s_sd"]


def summary(label: str, errors: list[float]) -> str:
    median, worst = statistics.median(errors), max(errors)
    return f"{label}: median |error| {median:.1%}, worst {worst:.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--alpha", default="0.7")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sequence per SD run")
    parser.add_argument("--repeats", type=int, default=8, help="timed plain/SD pairs per configuration per measurement")
    parser.add_argument("--out", help="results folder to keep (default: a temporary one)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sd-prediction-"))
    mac_moesd("roofline", "--quick", "--out", str(out))
    sweep_args = ["sweep", args.model, "--draft", args.draft, "--batch", "1,2,4,8", "--tokens", "1,2,3,4,5,6,8",
                  "--context", str(args.context)]
    mac_moesd(*sweep_args, "--out", str(out))
    fitted = mac_moesd("fit", str(out), "--json")
    spec_args = ["spec", args.model, "--draft", args.draft, "--batch", "1,2,4", "--gamma", "2,4",
                 "--alpha", args.alpha, "--mode", "emulated-acceptance", "--context", str(args.context),
                 "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--json"]
    spec = mac_moesd(*spec_args, "--out", str(out))
    # The repeat starts from the first run's roofline alone, so its fit is made the same way.
    repeat = out / "repeat"
    repeat.mkdir(exist_ok=True)
    first = json.loads((out / "results.json").read_text())
    (repeat / "results.json").write_text(json.dumps({k: first[k] for k in ("schema", "meta", "roofline")}))
    again = mac_moesd(*spec_args, "--out", str(repeat))
    mac_moesd(*sweep_args, "--out", str(repeat))
    refitted = FittedModel.from_document(mac_moesd("fit", str(repeat), "--json"))
    model = FittedModel.from_document(fitted)
    pipe = fitted.get("pipelining", {})
    print(f"{args.model} with {args.draft}, context {args.context}: fit chose `{fitted['chosen']}`, "
          f"held-out MAPE {fitted['heldout_mape']:.1%}; pipelining hides {pipe.get('target_s', 0) * 1e3:.2f} ms "
          f"per target forward, {pipe.get('draft_s', 0) * 1e3:.2f} ms per draft step")
    print(f"{'B':>3} {'gamma':>5} {'alpha':>5} {'measured':>13} {'predicted':>13} {'error':>7} "
          f"{'floors':>13}  {'plain ms meas/pred':>19}  {'round ms meas/pred':>19}")
    errors, floors, predicted_floors = [], [], []
    for r, r2 in zip(spec["runs"], again["runs"]):
        p2 = float(refitted.speedup(r["batch"], r["gamma"], run_alpha(r2), decoding_context(r["context"], args.tokens)))
        err = (r["predicted_speedup"] + p2) / (r["measured_speedup"] + r2["measured_speedup"]) - 1
        floor = r2["measured_speedup"] / r["measured_speedup"] - 1
        predicted_floor = p2 / r["predicted_speedup"] - 1
        errors.append(abs(err))
        floors.append(abs(floor))
        predicted_floors.append(abs(predicted_floor))
        (plain_p, round_p), (plain_m, round_m) = predicted_terms(model, r, args.tokens), measured_terms(r)
        print(f"{r['batch']:>3} {r['gamma']:>5} {r['alpha']:>5.2f} "
              f"{r['measured_speedup']:>6.3f}/{r2['measured_speedup']:.3f} {r['predicted_speedup']:>6.3f}/{p2:.3f} "
              f"{err:>+7.1%} {floor:>+6.1%}/{predicted_floor:+.1%}  "
              f"{plain_m * 1e3:>7.2f}/{plain_p * 1e3:>6.2f} {plain_p / plain_m - 1:>+5.0%}  "
              f"{round_m * 1e3:>7.2f}/{round_p * 1e3:>6.2f} {round_p / round_m - 1:>+5.0%}")
    met = statistics.median(errors) <= GOAL_MEDIAN and max(errors) <= GOAL_WORST
    print(summary("mean prediction against mean measurement", errors)
          + f" (goal <= {GOAL_MEDIAN:.0%}, <= {GOAL_WORST:.0%}): {'met' if met else 'NOT met'}")
    print(summary("floor: the repeated SD measurement against the first", floors))
    print(summary("floor: the repeated sweep's prediction against the first", predicted_floors))
    print(f"results in {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
