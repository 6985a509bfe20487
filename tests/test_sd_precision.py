"""SD measured to a stated precision, and predicted from the SD stage's own timed forwards."""

import numpy as np
import pytest

from mac_moesd.measure.clock import timing
from mac_moesd.measure.sd import speedup
from mac_moesd.measure.sd.round_parts import round_prediction
from mac_moesd.measure.decoding.sd_loop import Decoded


def test_median_ci_takes_the_order_statistics_of_conovers_ranks():
    assert timing.median_ci([0.9]) == (0.9, 0.9)
    assert timing.median_ci([3.0, 1.0]) == (1.0, 3.0)  # ranks clipped to [1, 2]
    # n = 8: ranks floor(4 - 2.77) = 1 and ceil(5 + 2.77) = 8, the whole range.
    assert timing.median_ci([0.8, 1.1, 0.95, 1.0, 1.3, 0.7, 1.05, 0.9]) == (0.7, 1.3)
    # n = 100: ranks floor(50 - 9.8) = 40 and ceil(51 + 9.8) = 61.
    assert timing.median_ci([float(v) for v in range(100, 0, -1)]) == (40.0, 61.0)


def test_median_ci_covers_the_median_at_least_95_percent_of_the_time_with_few_values():
    # A percentile bootstrap of 8 values' median covers less often than it says (0.91 here).
    rng = np.random.default_rng(1)
    for n in (8, 12, 30):
        covered = [low <= 0.0 <= high for low, high in map(timing.median_ci, rng.standard_normal((4000, n)))]
        assert np.mean(covered) >= 0.945, n


def test_each_pairs_sd_rate_counts_its_rounds_at_the_tokens_per_round_all_runs_realised():
    plain = [Decoded(10), Decoded(10)]  # 10 tok/s in both pairs
    # Same machine speed (4 rounds a second) but different luck: 12 and 8 tokens in 4 rounds.
    lucky, unlucky = Decoded(12, verifies=4), Decoded(8, verifies=4)
    assert speedup.pooled_tokens_per_round([lucky, unlucky]) == 2.5
    assert speedup.pair_speedups(plain, [1.0, 1.0], [lucky, unlucky], [1.0, 1.0]) == [1.0, 1.0]
    # A run twice as slow per round is half the rate at the pooled 2.5 tokens a round.
    assert speedup.pair_speedups(plain, [1.0, 1.0], [lucky, unlucky], [1.0, 2.0]) == [1.0, 0.5]
    # Decodes that did not count their rounds keep their own tokens per second, as do prompt
    # lookup's, whose rounds verify different widths.
    assert speedup.pooled_tokens_per_round([lucky, Decoded(8)]) is None
    assert speedup.pooled_tokens_per_round([lucky, Decoded(8, verifies=4, widths=[0, 2, 3, 0])]) is None
    assert speedup.pair_speedups(plain, [1.0, 1.0], [Decoded(12), Decoded(8)], [1.0, 1.0]) == [1.2, 0.8]
    row = speedup.summarise_pairs(plain, [1.0, 1.0], [lucky, unlucky], [1.0, 2.0], speedup.Precision(2, 0.03, 1.0))
    assert row["pooled_tokens_per_round"] == 2.5 and row["measured_ci_method"] == "order statistics"
    assert row["tokens_per_s_sd"] == pytest.approx(8.0)  # the runs' own rates (12 and 4 tok/s)
    assert row["measured_speedup"] == pytest.approx(0.75) and row["measured_ci"] == [0.5, 1.0]


def test_enough_pairs_after_the_minimum_once_the_ci_is_tight_or_the_budget_spent():
    p = speedup.Precision(min_pairs=3, target=0.03, budget_s=10.0)
    assert not p.enough([1.0, 1.0], 0.0)  # fewer than the minimum, however tight
    assert p.enough([1.0, 1.0, 1.0], 0.0)  # CI of zero width...
    assert p.stop_reason([1.0, 1.0, 1.0], 0.0) == "repeats"  # ...of too few pairs to cover 95%
    assert p.stop_reason([1.0] * 6, 0.0) == "precision"
    noisy = [0.6, 1.4, 0.8, 1.2]
    assert p.half_width(noisy) > 0.03 and not p.enough(noisy, 9.9)
    assert p.enough(noisy, 10.0)  # the budget is spent


def _fake_runs(monkeypatch, times):
    """paired() over fake runs whose speedups are given, on a clock that advances 1 s a call."""
    clock = iter(range(10_000))
    monkeypatch.setattr(speedup.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(speedup, "settle", lambda: None)
    return speedup.paired(lambda: Decoded(10), lambda: Decoded(10), lambda i: None, times)


def test_paired_stops_at_the_minimum_when_every_pair_agrees(monkeypatch):
    # Every pair takes 1 s each way on the fake clock: speedup 1, CI of zero width.
    plain_times, spec_times, *_ = _fake_runs(monkeypatch, speedup.Precision(4, 0.03, 1e9))
    assert len(plain_times) == len(spec_times) == 4


def test_paired_stops_when_its_budget_is_spent(monkeypatch):
    # The CI is never tight enough (half_width 1.0), so the 60 s budget ends it. On the fake clock
    # (0 at the first reading, +1 s a reading): the start reads 0, the first check 1; each pair
    # reads 4 times (two timed runs) and then checks, so after n pairs the check reads 1 + 5n,
    # which first reaches 60 at n = 12.
    precision = speedup.Precision(2, 0.03, 60.0)
    monkeypatch.setattr(speedup.Precision, "half_width", lambda self, speedups, ci=None: 1.0)
    plain_times, spec_times, *_ = _fake_runs(monkeypatch, precision)
    assert len(plain_times) == len(spec_times) == 12
    assert plain_times == spec_times == [1.0] * 12


def test_the_rounds_parts_are_topped_up_on_the_last_pairs_caches(monkeypatch):
    # Every pair agrees, so the pairs stop at their fewest (3); the parts, timed once a pair, are
    # then timed on pair 2's readied caches until they have 5 samples, with nothing else run.
    clock = iter(range(10_000))
    monkeypatch.setattr(speedup.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(speedup, "settle", lambda: None)
    events = []
    plain_times, *_ = speedup.paired(
        lambda: events.append("plain") or Decoded(10), lambda: events.append("sd") or Decoded(10),
        lambda i: events.append(f"prepare {i}"), speedup.Precision(3, 0.03, 1e9, parts_samples=5),
        lambda i: events.append(f"parts {i}"))
    assert len(plain_times) == 3
    pairs = [e for i in range(3) for e in (f"prepare {i}", "plain", f"prepare {i}", "sd", f"prepare {i}", f"parts {i}")]
    assert events == ["prepare 0", "plain", "prepare 0", "sd", *pairs,
                      "prepare 2", "parts 2", "prepare 2", "parts 2", "prepare None"]


def test_the_parts_top_up_stops_at_the_budget(monkeypatch):
    # The fake clock reads 0 at the start and +1 a reading: the check after 3 pairs reads 16
    # (1, then 4 readings a pair and its check); a budget of 18 s allows one top-up sample (its
    # check reads 17, the next one's 18), not the 7 the minimum asks for.
    clock = iter(range(10_000))
    monkeypatch.setattr(speedup.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(speedup, "settle", lambda: None)
    parts = []
    speedup.paired(lambda: Decoded(10), lambda: Decoded(10), lambda i: None,
                   speedup.Precision(3, 0.03, 18.0, parts_samples=10), parts.append)
    assert parts == [0, 1, 2, 2]


def test_a_quick_run_times_the_parts_once_a_pair_and_a_full_one_to_their_fewest():
    quick = speedup.SpecConfig(target="tiny-moe", draft="tiny-draft", stop_when_decided=True)
    full = speedup.SpecConfig(target="tiny-moe", draft="tiny-draft")
    assert speedup.Precision.of(quick).parts_samples == 0
    assert speedup.Precision.of(full).parts_samples == speedup.PARTS_SAMPLES == 32


def test_a_round_priced_from_its_timed_parts():
    # Plain decode 0.9 ms a step (pipelined); a synchronous one-token forward 1.0 ms, so 0.1 ms
    # is hidden, and the 1.2 ms verify costs 1.1 ms in the loop; four draft steps chained 0.28 ms;
    # no rejection sampling. alpha 0.8, gamma 4: Omega 3.3616, S = 3.3616*0.9/(0.28 + 1.1) = 2.19235,
    # the round FittedModel.speedup prices for the same forwards (test_verdict).
    parts = {"verify": 1.2e-3, "target_step": 1.0e-3, "draft": 0.28e-3}
    out = round_prediction(parts, 0.9e-3, 0.8, 4)
    assert out["speedup"] == pytest.approx(2.19235, abs=1e-4)
    assert out["hidden_s"] == pytest.approx(0.1e-3) and out["round_s"] == pytest.approx(1.38e-3)
    # Rejection sampling counts where the loop runs it; hiding is never negative nor over half.
    assert round_prediction({**parts, "reject": 0.12e-3}, 0.9e-3, 0.8, 4)["round_s"] == pytest.approx(1.5e-3)
    assert round_prediction(parts, 1.1e-3, 0.8, 4)["hidden_s"] == 0.0
    assert round_prediction(parts, 0.1e-3, 0.8, 4)["hidden_s"] == pytest.approx(0.5e-3)


def test_the_loops_drafting_is_priced_by_how_often_the_round_before_accepted_every_draft():
    # alpha 0.8, gamma 4, B=1: a round rejects with P = 1 - 0.8^4 = 0.5904 and drafts as timed
    # ("draft" 0.28 ms); after the other 0.4096 the loop first feeds the drafter its last draft
    # ("draft_caught_up" 0.40 ms): 0.5904 * 0.28 + 0.4096 * 0.40 = 0.329152 ms. With the verify
    # as above (1.1 ms after 0.1 ms hidden): round 1.429152 ms, S = 3.3616 * 0.9 / 1.429152.
    parts = {"verify": 1.2e-3, "target_step": 1.0e-3, "draft": 0.28e-3, "draft_caught_up": 0.40e-3}
    out = round_prediction(parts, 0.9e-3, 0.8, 4, catch_up=True)
    assert out["draft_s"] == pytest.approx(0.329152e-3) and out["round_s"] == pytest.approx(1.429152e-3)
    assert out["speedup"] == pytest.approx(3.3616 * 0.9 / 1.429152)
    # mlx-lm's batch 1 feeds no catch-up step; the loop's rounds are never priced without the
    # caught-up chain timed (RoundParts times it wherever the loop drafts with a model).
    assert round_prediction(parts, 0.9e-3, 0.8, 4)["draft_s"] == pytest.approx(0.28e-3)
    older = {k: v for k, v in parts.items() if k != "draft_caught_up"}
    with pytest.raises(KeyError):
        round_prediction(older, 0.9e-3, 0.8, 4, catch_up=True)


def test_a_rollback_is_priced_by_how_often_a_round_rejects():
    # A 0.5 ms rollback (a hybrid's restore and re-forward) is paid when some sequence rejects:
    # at alpha 0.8, gamma 4, batch 1 that is 1 - 0.8^4 = 0.5904 of rounds (0.2952 ms), at batch 2
    # 1 - 0.8^8 = 0.83223 (0.41611 ms). S at batch 1: 3.3616*0.9/(0.28 + 1.1 + 0.2952) = 1.80609.
    parts = {"verify": 1.2e-3, "target_step": 1.0e-3, "draft": 0.28e-3, "rollback": 0.5e-3}
    one = round_prediction(parts, 0.9e-3, 0.8, 4)
    assert one["rollback_s"] == pytest.approx(0.2952e-3) and one["speedup"] == pytest.approx(1.80609, abs=1e-4)
    assert round_prediction(parts, 0.9e-3, 0.8, 4, batch=2)["rollback_s"] == pytest.approx(0.41611e-3, abs=1e-8)


def test_the_loops_bookkeeping_is_priced_in_every_round():
    # test_a_rollback_...'s round (1.38 ms before its rollback) with 0.25 ms of bookkeeping a
    # round, paid whatever was accepted: S = 3.3616*0.9/(1.38 + 0.25) = 1.85610.
    parts = {"verify": 1.2e-3, "target_step": 1.0e-3, "draft": 0.28e-3, "bookkeeping": 0.25e-3}
    out = round_prediction(parts, 0.9e-3, 0.8, 4)
    assert out["bookkeeping_s"] == 0.25e-3 and out["round_s"] == pytest.approx(1.63e-3)
    assert out["speedup"] == pytest.approx(1.85610, abs=1e-4)


def test_the_empty_round_runs_the_loops_own_decision(monkeypatch):
    import mlx.core as mx
    import numpy as np

    from mac_moesd.measure.decoding import bookkeeping

    called = []

    def spy(name):
        real = getattr(bookkeeping, name)
        return lambda *args, **kwargs: called.append(name) or real(*args, **kwargs)

    for name in ("accept", "advance"):
        monkeypatch.setattr(bookkeeping, name, spy(name))
    from mac_moesd.measure.decoding.sd_loop import sample

    point = bookkeeping.bookkeeping_point(2, 3, 50, "real", lambda logits: sample(logits, 0.0))
    kept, following, drafted, emitted = point.run()
    assert called == ["accept", "advance"]
    # the stand-in drafts match nothing the argmax chose (or only by chance): shapes as a round's
    assert following.shape == (2, 1) and kept.shape[0] == 2 and drafted.shape[0] == 2
    replica = bookkeeping.mlx_lm_bookkeeping(3, 50).run()
    assert replica.dtype == mx.uint32 and replica.shape in ((1,), (2,))
    assert np.isfinite(timing.finite_time(point))


@pytest.mark.slow  # loads and times models end to end
def test_every_run_records_its_precision_and_both_predictions():
    cfg = speedup.SpecConfig(target="tiny-moe", draft="tiny-draft", batches=(1,), gammas=(2,), context=8,
                          new_tokens=4, repeats=3, precision=0.5, budget_s=0.5)
    (run,) = speedup.run_spec(cfg, sweep_step=lambda batch: 1.0)["runs"]
    assert 3 <= run["pairs"] and run["budget_s"] == 0.5 and run["precision"] == 0.5
    low, high = run["measured_ci"]
    assert low <= run["measured_speedup"] <= high
    assert run["precision_met"] == ((high - low) / 2 / run["measured_speedup"] <= 0.5 and run["pairs"] >= 6)
    assert run["predicted_from"] == "measured" and run["predicted_by"]["model"] is None
    # one sample of the parts a pair, topped up towards PARTS_SAMPLES while the 0.5 s budget lasts
    assert run["pairs"] <= run["round"]["samples"] <= max(run["pairs"], speedup.PARTS_SAMPLES)
    assert set(run["round"]["median_s"]) == {"verify", "target_step", "draft", "draft_caught_up", "reject",
                                             "rollback", "bookkeeping"}
    assert run["round"]["bookkeeping_s"] == run["round"]["median_s"]["bookkeeping"] > 0
    # Plain KV caches trim: the round's rollback is counted, and every run is audited.
    assert run["round"]["rollback_s"] >= 0 and run["rollback"]["strategy"] in ("none", "trim")
    assert run["rollback"]["audit"]["ok"] and run["valid"]
    assert run["plain_vs_sweep"] == pytest.approx(run["plain_step_s"])  # a 1 s "sweep" step


@pytest.mark.parametrize("speedups, quick, elapsed, reason", [
    # CI [0.79, 0.81] (8 values: their whole range) about a median of 0.80: within +-3%, quick or not
    ([0.80, 0.81, 0.79, 0.80, 0.80, 0.81, 0.79, 0.80], False, 0.0, "precision"),
    # CI [0.6, 0.9], half-width 20% of 0.735: wide, but wholly below 1 - 0.03: SD does not pay
    ([0.6, 0.9, 0.65, 0.85, 0.7, 0.8, 0.75, 0.72], True, 0.0, "decided"),
    ([0.6, 0.9, 0.65, 0.85, 0.7, 0.8, 0.75, 0.72], False, 0.0, None),  # a full run goes on...
    ([0.6, 0.9, 0.65, 0.85, 0.7, 0.8, 0.75, 0.72], False, 30.0, "budget"),  # ...until its budget
    # CI [1.3, 1.6], wholly above 1 + 0.03: SD pays off
    ([1.3, 1.6, 1.35, 1.55, 1.4, 1.5, 1.45, 1.42], True, 0.0, "decided"),
    # CI [0.8, 1.2] straddles 1: undecided, so even a quick run goes on to its budget
    ([0.8, 1.2, 0.9, 1.1, 0.95, 1.05, 0.85, 1.15], True, 0.0, None),
    ([0.8, 1.2, 0.9, 1.1, 0.95, 1.05, 0.85, 1.15], True, 30.0, "budget"),
    ([0.6, 0.9, 0.65], True, 0.0, None),  # fewer than the minimum pairs
])
def test_why_a_configuration_stops(speedups, quick, elapsed, reason):
    precision = speedup.Precision(min_pairs=8 if len(speedups) == 8 else 4, target=0.03, budget_s=30.0,
                               stop_when_decided=quick)
    assert precision.stop_reason(speedups, elapsed) == reason


def test_a_quick_runs_rows_say_what_stopped_them():
    from mac_moesd.reporting import formatting

    run = {"measured_speedup": 0.74, "measured_ci": [0.65, 0.85], "pairs": 8}
    assert formatting.measured_speedup({**run, "stopped": "decided"}) == "0.74 [0.65-0.85] 8 pairs, stopped: decided"
    assert formatting.measured_speedup({**run, "stopped": "budget"}) == "0.74 [0.65-0.85] 8 pairs, budget spent"
    assert formatting.measured_speedup({**run, "stopped": "precision"}) == "0.74 [0.65-0.85] 8 pairs"
    assert formatting.measured_speedup({**run, "pairs": 3, "stopped": "repeats"}) == (
        "0.74 [0.65-0.85] 3 pairs, the fewest pairs asked (too few for a 95% interval)")
    assert formatting.measured_speedup({**run, "precision_met": False}) == "0.74 [0.65-0.85] 8 pairs, budget spent"


def test_the_measured_round_beside_its_priced_parts():
    from mac_moesd.reporting import formatting

    # 2 sequences, 1.5 drafts accepted a round: 2.5 tokens a sequence a round; SD at 500 tok/s in
    # all is 250 a sequence, so a round took 2.5/250 = 10 ms.
    run = {"batch": 2, "mean_accepted": 1.5, "tokens_per_s_sd": 500.0}
    assert speedup.measured_round_s(run) == pytest.approx(0.010)
    assert speedup.measured_round_s({**run, "mean_accepted": None}) is None
    parts = {"draft_s": 0.002, "verify_s": 0.006, "reject_s": 0.0, "rollback_s": 0.0005, "round_s": 0.0085}
    assert formatting.round_cell({"round": {**parts, "measured_s": 0.010}}).endswith("= 8.5 ms (measured 10 ms)")
    assert formatting.round_cell({"round": parts}).endswith("= 8.5 ms")


class _Clock:
    """A clock that only the fake models below move."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _CostedModel:
    """A stand-in model whose every forward of B x t tokens costs ``fixed + per_token * B * t``
    seconds on ``clock`` (and nothing else costs anything), with one plain KV cache layer."""

    def __init__(self, clock: _Clock, fixed: float, per_token: float, vocab: int = 16):
        self.clock, self.fixed, self.per_token, self.vocab = clock, fixed, per_token, vocab

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def __call__(self, tokens, cache=None):
        import mlx.core as mx

        batch, length = tokens.shape
        self.clock.now += self.fixed + self.per_token * batch * length
        if cache:
            cache[0].update_and_fetch(*[mx.zeros((batch, 1, length, 4))] * 2)
        return mx.zeros((batch, length, self.vocab))


@pytest.mark.parametrize("batch, gamma", [(1, 2), (2, 3)])
def test_the_round_adds_up_to_the_measured_round_on_a_fake_clock(monkeypatch, batch, gamma):
    # Self-draft on a model whose forwards cost 1 ms + 0.25 ms a token, nothing else taking time:
    # every round is gamma one-token drafts, a verify of gamma+1 tokens per sequence and, since
    # every draft is accepted, the drafter fed its last draft: the priced parts (draft with its
    # catch-up, verify, rejection, rollback, bookkeeping) must add up to the measured round.
    import time

    import numpy as np

    from mac_moesd.measure.sd.round_parts import RoundParts, round_prediction

    clock = _Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    model = _CostedModel(clock, 1e-3, 0.25e-3)
    rng = np.random.default_rng(0)
    cfg = speedup.SpecConfig(target="fake", draft="fake", batches=(batch,), gammas=(gamma,), mode="self-draft",
                          new_tokens=2 * (gamma + 1), repeats=3)
    decoders = speedup.Decoders(model, model, batch, speedup.PromptIds(speedup.RANDOM_IDS, None, "random"), 8, rng,
                             model.vocab)
    parts = RoundParts(batch, gamma, model.vocab, with_reject=False, mode="self-draft")
    row, _, spec_out = speedup.loop_run(decoders, cfg, gamma, None, 0.0, rng, parts)

    def step(tokens):
        return 1e-3 + 0.25e-3 * batch * tokens

    assert row["plain_step_s"] == pytest.approx(step(1))
    priced = round_prediction(parts.medians(), row["plain_step_s"], 1.0, gamma, batch, catch_up=True)
    measured = speedup.measured_round_s({**row, "mean_accepted": gamma, "batch": batch})
    # by hand: (gamma + 1) one-token steps and one verify of gamma + 1 tokens per sequence
    assert measured == pytest.approx((gamma + 1) * step(1) + step(gamma + 1))
    assert priced["round_s"] == pytest.approx(measured)
    assert priced["speedup"] == pytest.approx(row["measured_speedup"])


def test_the_reports_note_names_how_its_rows_were_measured():
    from mac_moesd.reporting.formatting import precision_note

    base = {"measured_speedup": 0.9, "measured_ci": [0.88, 0.92], "precision": 0.03, "precision_met": True,
            "budget_s": 120.0, "repeats": 8, "stopped": "precision"}
    new = {**base, "measured_ci_method": "order statistics", "pooled_tokens_per_round": 2.8}
    assert "distribution-free 95% confidence interval (order statistics)" in precision_note([new])
    assert "one run's luck in acceptance" in precision_note([new])
    old = precision_note([base])  # recorded before 2026-12-07
    assert "95% bootstrap confidence interval" in old and "luck" not in old
    assert "bootstrap in older rows, order statistics in newer" in precision_note([base, new])
    assert "; in 1 of 2 rows)" in precision_note([base, new])
