"""The SD prediction with the machine's drift taken out: the sweep and the SD runs in one schedule.

`sd_prediction.py` checks the suite as a user runs it: a sweep, then SD measured minutes later in
another process. On a machine whose speed drifts over minutes, or differs from one process to the
next, that comparison carries the drift. Here one process times everything together: the
target's grid (synchronous and pipelined), the drafter's steps, rejection sampling, and plain and
speculative decoding at B 1,2,4 x gamma 2,4, every point visited once per round, in shuffled
order, for the same number of rounds, so that every median sees the same mix of machine states.
Beside them, the drafter's chains after a verify of the target (as the sweep times them, for the
fit's drafter start). The grid then goes through the same fit as `mac-moesd fit` (with a quick roofline, as `run`
makes), and each measured speedup is set beside the fit's prediction at the run's acceptance and
mean context. What error is left is the time model's and the loop's, not the machine's.

Emulated acceptance draws from a fixed seed, so every timed SD run decodes the same rounds; the
prediction takes the acceptance those rounds realised (alpha solved from their mean accepted
length), so the draws' luck is not counted as model error either.

    python benchmarks/sd_prediction_same_schedule.py [--model tiny-moe] [--draft tiny-draft] [--rounds 10]
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import mac_moesd  # noqa: F401  (first: it loads OpenBLAS before MLX is imported, as the CLI does)
import mlx.core as mx
import numpy as np

from mac_moesd.analysis import acceptance, fit
from mac_moesd.inputs import models
from mac_moesd.machine import blas
from mac_moesd.measure.clock import timing
from mac_moesd.measure.forward import draft_chain, points as timed, sweep
from mac_moesd.measure.decoding.sd_loop import Decoder
from mac_moesd.measure.sd.speedup import RUN_TOKENS
from mac_moesd.results import point_key

GOAL_MEDIAN, GOAL_WORST = 0.05, 0.10
BATCHES, TOKENS, SD_BATCHES, GAMMAS = (1, 2, 4, 8), (1, 2, 3, 4, 5, 6, 8), (1, 2, 4), (2, 4)
REJECT_GAMMA = 4  # as the sweep times T_rej(B) by default
CHAINS = timing.Budget()  # pipelined chains as long as a sweep at the default budget runs them


def grid(built, context: int, tokens, control, second_context: int | None = None) -> tuple[dict, dict, dict]:
    """Synchronous and pipelined points of one model: {(B, t): Point} each, on one prefill; with
    ``second_context``, the one-token points there too (on trimmed copies, as the sweep times them)."""
    vocab = built.config["vocab_size"]
    parent = sweep.RolledBackCache(built.model, max(BATCHES), context, vocab)
    shorts = {b: parent.shortened(b, second_context) for b in BATCHES} if second_context else {}
    caches = sweep.batch_caches(parent, BATCHES)
    sync = {(b, t): timed.forward_point(built.model, caches[b], b, t, vocab, control) for b in BATCHES for t in tokens}
    pipe = {(b, t): timed.pipelined_point(built.model, caches[b], b, t, vocab, control, sweep.pipelined_steps(t, CHAINS))
            for b in BATCHES for t in tokens}
    short = {(b, 1): timed.forward_point(built.model, shorts[b], b, 1, vocab, control) for b in shorts}
    return sync, pipe, short


def chain_points(target, draft, context: int) -> dict:
    """The drafter's chains after an untimed verify of the target, as the sweep times them
    (``draft_chain``): {(B, gamma): Point}."""
    vocab = min(target.config["vocab_size"], draft.config["vocab_size"])
    target_caches, draft_caches = (sweep.batch_caches(sweep.RolledBackCache(b.model, max(BATCHES), context, vocab), BATCHES)
                                   for b in (target, draft))
    return {(b, g): draft_chain.chain_point(target.model, target_caches[b], draft.model, draft_caches[b], b, g, vocab)
            for b in BATCHES for g in draft_chain.chain_gammas(REJECT_GAMMA)}


def decode_points(target, draft, context: int, new_tokens: int, alpha: float, seed: int) -> tuple[dict, dict]:
    """Plain and speculative decode points per batch, and what each speculative run decodes
    (the same rounds every time: the acceptance draws restart from ``seed``)."""
    vocab = target.config["vocab_size"]
    rng = np.random.default_rng(seed)
    points, decoded = {}, {}
    for b in SD_BATCHES:
        decoder = Decoder(target.model, draft.model, mx.array(rng.integers(0, vocab, (b, context + 1))),
                          random_tokens=vocab)
        points[("plain", b)] = timing.Point(run=lambda d=decoder: (d.plain(new_tokens), [])[1], reset=decoder.reset)
        for g in GAMMAS:
            def run(d=decoder, g=g, b=b):
                decoded[(b, g)] = d.speculative(new_tokens, g, "emulated-acceptance", alpha,
                                                rng=np.random.default_rng(seed))
                return []
            points[("sd", b, g)] = timing.Point(run=run, reset=decoder.reset)
    return points, decoded


def entry(built, context: int, sync: dict, pipe: dict, stats: dict, role: str | None = None,
          short: dict | None = None, second_context: int | None = None) -> dict:
    """A results entry as the sweep writes it; the second-context points' twins are the grid's own
    points, timed in the same schedule."""
    out = {**sweep.entry_header(built, context), "points": {}, "pipelined_points": {}}
    if role:
        out["role"] = role
    for kind, measured in (("points", sync), ("pipelined_points", pipe)):
        for (b, t), m in measured.items():
            out[kind][point_key(b, t)] = sweep.recorded(kind, t, m, CHAINS, stats.get((b, t), {}))
    if short:
        keys = [point_key(b, t) for b, t in short]
        out.update(kv_context=second_context,
                   kv_points={str(second_context): {point_key(b, t): sweep.recorded("points", t, m, CHAINS, {})
                                                    for (b, t), m in short.items()}},
                   kv_twins={str(second_context): {k: out["points"][k] for k in keys}})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--kv-context", type=int, default=None,
                        help="second context of the one-token points (default: a quarter of --context, as the sweep's; 0: none)")
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--tokens", type=int, default=RUN_TOKENS, help="tokens per sequence per decode run (as `run` times them)")
    parser.add_argument("--rounds", type=int, default=10, help="samples of every point, one per round")
    parser.add_argument("--out", help="folder for the roofline and the assembled results (default: temporary)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sd-same-schedule-"))
    subprocess.run([sys.executable, "-m", "mac_moesd", "roofline", "--quick", "--out", str(out)], check=True,
                   capture_output=True)
    data = json.loads((out / "results.json").read_text())

    print(f"BLAS: {blas.describe('cpu')['name']}", file=sys.stderr, flush=True)
    target, draft = (models.build(models.resolve(name)) for name in (args.model, args.draft))
    target.materialise()
    draft.materialise()
    cfg = sweep.SweepConfig(model=args.model, batches=BATCHES, tokens=TOKENS, context=args.context)
    control = sweep.routing_for(target, cfg)
    second = args.context // sweep.KV_LEVER if args.kv_context is None else args.kv_context
    target_sync, target_pipe, target_short = grid(target, args.context, TOKENS, control, second)
    draft_sync, draft_pipe, _ = grid(draft, args.context, (1,), None)
    vocab = target.config["vocab_size"]
    reject = {b: timed.reject_point(b, REJECT_GAMMA, vocab) for b in BATCHES}
    chains = chain_points(target, draft, args.context)
    decodes, decoded = decode_points(target, draft, args.context, args.tokens, args.alpha, seed=1)
    points = {**{("target", "sync", *k): p for k, p in target_sync.items()},
              **{("target", "pipe", *k): p for k, p in target_pipe.items()},
              **{("target", "short", *k): p for k, p in target_short.items()},
              **{("draft", "sync", *k): p for k, p in draft_sync.items()},
              **{("draft", "pipe", *k): p for k, p in draft_pipe.items()},
              **{("reject", b): p for b, p in reject.items()},
              **{("chain", *k): p for k, p in chains.items()}, **decodes}
    budget = timing.Budget(warmup=1, min_repeats=args.rounds, max_repeats=args.rounds, per_visit=1,
                           seconds_per_point=1e9)
    print(f"timing {len(points)} points, {args.rounds} rounds in one shuffled schedule", file=sys.stderr, flush=True)
    m = timing.measure(points, budget, random.Random(0))

    def kind(model, how):
        return {k[2:]: v for k, v in m.items() if k[:2] == (model, how)}

    data["sweeps"] = {sweep.entry_key(target, args.context): entry(
        target, args.context, kind("target", "sync"), kind("target", "pipe"), control.stats if control else {},
        short=kind("target", "short"), second_context=second)}
    chained = {point_key(b, g): m[("chain", b, g)] for b, g in chains}
    next(iter(data["sweeps"].values()))["draft_chains"] = {draft.source.name: {"points": chained}}
    data["draft"] = {sweep.entry_key(draft, args.context): entry(
        draft, args.context, kind("draft", "sync"), kind("draft", "pipe"), {}, role="draft")}
    data["reject"] = {f"V{vocab}|gamma{REJECT_GAMMA}": {"vocab": vocab, "gamma": REJECT_GAMMA, "points": {
        point_key(b, REJECT_GAMMA + 1): m[("reject", b)] for b in BATCHES}}}
    (out / "results.json").write_text(json.dumps(data))
    result = fit.fit(fit.inputs_from_results(data))
    model = result.model()
    context = fit.decoding_context(args.context, args.tokens)
    print(f"{args.model} with {args.draft}, context {args.context}, {args.rounds} rounds: fit chose "
          f"`{result.chosen}`, held-out MAPE {result.heldout_mape:.1%}; k_kv {result.k_kv * 1e6:.2f} us per "
          f"cached token, k_seq {result.best.k_seq * 1e3:.3f} ms per sequence; pipelining hides "
          f"{result.pipelining['target_s'] * 1e3:.2f} ms per target forward, {result.pipelining['draft_s'] * 1e3:.2f} ms "
          "per draft step")
    print(f"{'B':>3} {'gamma':>5} {'alpha':>5} {'measured':>8} {'predicted':>9} {'error':>7}  "
          f"{'plain ms meas/pred':>19}  {'round ms meas/pred':>19}")
    errors = []
    for b in SD_BATCHES:
        plain_s = m[("plain", b)]["median_s"] / args.tokens
        for g in GAMMAS:
            run = decoded[(b, g)]
            alpha = acceptance.summarise_rounds(run.per_round, g)["alpha"]
            round_s = m[("sd", b, g)]["median_s"] / (len(run.per_round) / b)
            measured = (run.tokens / m[("sd", b, g)]["median_s"]) / (b * args.tokens / m[("plain", b)]["median_s"])
            predicted = float(model.speedup(b, g, alpha, context))
            plain_p, verify_p, draft_p, reject_p = (float(x) for x in model.step_times(b, g, context))
            round_p = g * draft_p + verify_p + reject_p
            errors.append(abs(predicted / measured - 1))
            print(f"{b:>3} {g:>5} {alpha:>5.2f} {measured:>8.3f} {predicted:>9.3f} {predicted / measured - 1:>+7.1%}  "
                  f"{plain_s * 1e3:>7.2f}/{plain_p * 1e3:>6.2f} {plain_p / plain_s - 1:>+5.0%}  "
                  f"{round_s * 1e3:>7.2f}/{round_p * 1e3:>6.2f} {round_p / round_s - 1:>+5.0%}")
    median, worst = statistics.median(errors), max(errors)
    met = median <= GOAL_MEDIAN and worst <= GOAL_WORST
    print(f"predicted against measured in one schedule: median |error| {median:.1%}, worst {worst:.1%} "
          f"(goal <= {GOAL_MEDIAN:.0%}, <= {GOAL_WORST:.0%}): {'met' if met else 'NOT met'}")
    print(f"results in {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
