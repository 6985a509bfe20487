"""Where an SD round's time goes: the loop as it runs, the same loop waiting after each phase, and
the round's parts as the SD stage times them, interleaved in one process.

The timed-parts prediction (docs/design.md §4.5) sums parts each timed on its own, synchronously.
The loop runs them unsynchronised: the next phase's graph is built while the current one computes,
and the drafter's catch-up step after a fully accepted round is queued into the next round's
chain. This benchmark shows, per gamma, how far the sum of the parts (priced as
``round_prediction`` prices them) is from the round the loop takes, and which phase differs: the
loop's round (a run's seconds over its verifies), the same loop with a wait after each phase
(``Decoder.speculative``'s ``on_phase``, so each phase is timed alone in its place in the loop),
and the parts, one sample of each beside every run. No goal: it locates the difference that
`sd_prediction.py`'s timed-parts column carries.

    python benchmarks/round_phases.py [--model tiny-moe] [--batch 1] [--gamma 1,2,4] [--runs 40]
"""

import argparse
import random
import statistics
import time

import mac_moesd  # noqa: F401  (first: it loads OpenBLAS before MLX is imported, as the CLI does)
import numpy as np

from mac_moesd.analysis import acceptance
from mac_moesd.measure.decoding.sd_loop import PHASES
from mac_moesd.measure.sd import speedup
from mac_moesd.measure.sd.round_parts import RoundParts, round_prediction

MODE = "emulated-acceptance"


def phase_seconds(decoder, tokens: int, gamma: int, alpha: float, rng) -> dict[str, float]:
    """One decode with a wait after each phase: seconds a round per phase (catch-up averaged over
    every round, as the prediction prices it)."""
    spent = dict.fromkeys(PHASES, 0.0)
    last = [time.perf_counter()]

    def on_phase(name: str) -> None:
        now = time.perf_counter()
        spent[name] += now - last[0]
        last[0] = now

    decoded = decoder.speculative(tokens, gamma, MODE, alpha, rng=rng, on_phase=on_phase)
    return {name: seconds / decoded.verifies for name, seconds in spent.items()}


def measure(decoders, vocab: int, batch: int, gamma: int, runs: int, tokens: int, alpha: float) -> dict:
    rng = np.random.default_rng(0)
    parts = RoundParts(batch, gamma, vocab, with_reject=True, mode=MODE)
    time_parts = decoders.parts_timer(parts)
    loop_rounds, plain_steps, phased, realised = [], [], [], []

    def ready():
        decoders.prepare(0)
        speedup.settle()

    def loop():
        start = time.perf_counter()
        decoded = decoders.decoder.speculative(tokens, gamma, MODE, alpha, rng=rng)
        loop_rounds.append((time.perf_counter() - start) / decoded.verifies)
        realised.append(decoded.tokens / decoded.verifies / batch)

    def plain():
        start = time.perf_counter()
        decoders.decoder.plain(tokens)
        plain_steps.append((time.perf_counter() - start) / tokens)

    jobs = {"loop": loop, "plain": plain, "parts": lambda: time_parts(0),
            "phased": lambda: phased.append(phase_seconds(decoders.decoder, tokens, gamma, alpha, rng))}
    for name in jobs:  # warm-up: every shape compiled
        ready()
        jobs[name]()
    for samples in (loop_rounds, plain_steps, phased, realised, parts.samples):
        samples.clear()
    order = random.Random(gamma)
    for _ in range(runs):
        names = list(jobs)
        order.shuffle(names)
        for name in names:
            ready()
            jobs[name]()
    decoders.prepare(None)
    alpha_realised = acceptance.solve_alpha(statistics.mean(realised) - 1, gamma)
    priced = round_prediction(parts.medians(), statistics.median(plain_steps), alpha_realised, gamma, batch,
                              catch_up=True)
    return {"loop_s": statistics.median(loop_rounds),
            "phased": {name: statistics.median(p[name] for p in phased) for name in PHASES},
            "priced": priced}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--draft", default="tiny-draft")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--gamma", default="1,2,4")
    parser.add_argument("--alpha", type=float, default=0.7)
    parser.add_argument("--tokens", type=int, default=speedup.RUN_TOKENS)
    parser.add_argument("--runs", type=int, default=40, help="turns; each runs all four once, shuffled")
    args = parser.parse_args()
    cfg = speedup.SpecConfig(target=args.model, draft=args.draft, batches=(args.batch,), context=64)
    target, draft, inputs, _, vocab = speedup.prepare_models(cfg, None, speedup.resolve_sources(cfg))
    decoders = speedup.Decoders(target.model, draft.model, args.batch, inputs, cfg.context,
                                np.random.default_rng(0), vocab, random_tokens=True)
    ms = lambda s: f"{s * 1e3:6.2f}"  # noqa: E731
    print(f"{args.model} with {args.draft}, B={args.batch}, alpha {args.alpha}, {args.tokens} tokens a run, "
          f"{args.runs} turns; ms a round")
    print("gamma |   loop | phased |  parts | draft+catch-up: phased  parts | verify: phased  parts | "
          "rest: phased  parts")
    for gamma in (int(g) for g in args.gamma.split(",")):
        m = measure(decoders, vocab, args.batch, gamma, args.runs, args.tokens, args.alpha)
        p, q = m["phased"], m["priced"]
        rest_phased = p["reject"] + p["bookkeeping"] + p["rollback"]
        rest_priced = q["reject_s"] + q["bookkeeping_s"] + q["rollback_s"]
        print(f"{gamma:5d} | {ms(m['loop_s'])} | {ms(sum(p.values()))} | {ms(q['round_s'])} | "
              f"{' ' * 16}{ms(p['draft'] + p['catch_up'])} {ms(q['draft_s'])} | "
              f"{' ' * 8}{ms(p['verify'])} {ms(q['verify_s'])} | {' ' * 6}{ms(rest_phased)} {ms(rest_priced)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
