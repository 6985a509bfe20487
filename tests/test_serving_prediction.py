"""The serving stage's predicted lines and crossover, from a committed fit and hand-worked numbers."""

import json
from pathlib import Path

import pytest

from mac_moesd.analysis import serving_prediction as prediction
from mac_moesd.pipeline import serving_stage

from test_fit import hand_fit_doc

RESULTS = json.loads((Path(__file__).parent / "data" / "results_quick_cpu.json").read_text())
FIT = RESULTS["fits"]["tiny-moe"]


def test_acceptance_from_counters_solves_alpha():
    # 30 drafted at gamma 3 = 10 rounds; 15 accepted = 1.5 per round = alpha + alpha^2 + alpha^3.
    alpha = prediction.acceptance_from_counters({"drafted": 30, "accepted": 15}, 3)
    assert alpha + alpha**2 + alpha**3 == pytest.approx(1.5)
    assert 0.6 < alpha < 0.7  # 0.6 gives 1.176, 0.7 gives 1.533
    assert prediction.acceptance_from_counters({"drafted": 0, "accepted": 0}, 3) is None


def test_predicted_lines_plain_batched_and_all_or_nothing():
    # test_fit's hand-worked fit: T_T(n) = 0.95 + 0.05n ms for n = B*t tokens, T_D = 0.1 ms, no KV
    # term (so the context, 20 + 64/2 = 52, changes nothing). gamma 3, alpha 0.7: Omega = 1 + 0.7 +
    # 0.49 + 0.343 = 2.533 tokens a round.
    #   B = 1: plain T(1) = 1.0 ms, 1000 tok/s; round 3*0.1 + T(4) = 0.3 + 1.15 = 1.45 ms,
    #          S = 2.533*1.0/1.45 = 1.746897, 1746.897 tok/s.
    #   B = 4: plain T(4) = 1.15 ms, 4/1.15 ms = 3478.261 tok/s; round 0.3 + T(16) = 2.05 ms,
    #          S = 2.533*1.15/2.05 = 1.420951, 4942.439 tok/s. All or nothing: a position counts
    #          when all four accept, alpha^4 = 0.2401, Omega = 1.311589, 2559.199 tok/s.
    rows = prediction.predicted_rows(hand_fit_doc(), (1, 4), gamma=3, prompt_tokens=20, new_tokens=64,
                                     alpha=0.7, source="test")
    assert [r["context"] for r in rows] == [52, 52]
    one, four = rows
    assert one["plain_tok_s"] == pytest.approx(1000.0)
    assert one["sd_batched_tok_s"] == pytest.approx(1746.897, abs=1e-3)
    assert one["sd_all_or_nothing_tok_s"] == pytest.approx(1746.897, abs=1e-3)  # alpha^1: the same
    assert four["plain_tok_s"] == pytest.approx(3478.261, abs=1e-3)
    assert four["sd_batched_tok_s"] == pytest.approx(4942.439, abs=1e-3)
    assert four["sd_all_or_nothing_tok_s"] == pytest.approx(2559.199, abs=1e-3)


def test_predicted_sd_lines_are_null_with_why_without_acceptance():
    row = prediction.predicted_rows(FIT, (2,), 3, 20, 64, None, "no acceptance pass")[0]
    assert row["plain_tok_s"] > 0
    assert row["sd_batched_tok_s"] is None and row["sd_all_or_nothing_tok_s"] is None
    assert row["why"] == "no acceptance pass"
    json.dumps(row, allow_nan=False)


def leg(server, c, tok_s, prompts="code", status="ok", counters=None):
    return {"server": server, "concurrency": c, "aggregate_tok_s": tok_s, "prompts": prompts, "status": status,
            "prompt_tokens_mean": 20.0, "sd_counters": counters or {"reported": False}}


def test_crossover_is_the_largest_concurrency_where_sd_as_served_wins_on_every_set():
    doc = {"prompts": ["code", "chat"], "legs": [
        leg("plain", 1, 100), leg("plain", 4, 300), leg("plain", 16, 500),
        leg("sd", 1, 120), leg("sd", 4, 310), leg("sd", 16, 260),
        leg("plain", 1, 100, "chat"), leg("plain", 4, 300, "chat"),
        leg("sd", 1, 130, "chat"), leg("sd", 4, 200, "chat")]}
    # code: SD wins at 1 and 4; chat: at 1 only -> 1.
    assert serving_stage.crossover(doc) == (1, None)
    doc["legs"][3]["aggregate_tok_s"] = 90  # SD loses at 1 on code too
    assert serving_stage.crossover(doc) == (None, "SD as served never beat plain")
    # A failed SD leg does not count as a win.
    doc = {"prompts": ["code"], "legs": [leg("plain", 1, 100), leg("sd", 1, 150, status="failed")]}
    assert serving_stage.crossover(doc)[0] is None


def test_predictions_take_the_acceptance_pass_of_the_same_pair_and_prompts():
    spec = {"prompts": {"name": "code"}, "runs": [],
            "acceptance": [{"temperature": 0.0, "gamma": 3, "rule_run": "greedy",
                            "measured": {"alpha": 0.6, "rounds": 10}}]}
    data = {"fits": {"tiny-moe": FIT}, "spec": {"tiny-moe|tiny-draft|real|code": spec}}
    doc = {"target_name": "tiny-moe", "draft_name": "tiny-draft", "gamma": 3, "tokens": 64, "prompts": ["code"],
           "concurrency": [1, 2], "legs": [leg("plain", 1, 100), leg("sd", 1, 90)]}
    rows, why = serving_stage.predictions(doc, data, "this results file")
    assert why is None and [r["concurrency"] for r in rows] == [1, 2]
    assert all(r["acceptance"] == 0.6 and "acceptance pass" in r["acceptance_source"] for r in rows)
    # The server's own counters come first: 15 of 30 drafted at gamma 3 (alpha about 0.69).
    doc["legs"][1]["sd_counters"] = {"drafted": 30, "accepted": 15}
    rows, _ = serving_stage.predictions(doc, data, "this results file")
    assert rows[0]["acceptance_source"] == "the server's draft counters"
    assert rows[0]["acceptance"] == pytest.approx(prediction.acceptance_from_counters(
        {"drafted": 30, "accepted": 15}, 3))
    # No fit of the target: no lines, and why.
    rows, why = serving_stage.predictions({**doc, "target_name": "other"}, data, "this results file")
    assert rows == [] and "no fit of other" in why


def test_a_target_served_without_a_drafter_gets_plain_lines_and_says_why_no_sd_line():
    data = {"fits": {"tiny-moe": FIT}}
    doc = {"target_name": "tiny-moe", "draft_name": None, "gamma": None, "tokens": 64, "prompts": ["code"],
           "concurrency": [1, 4], "legs": [leg("plain", 1, 100), leg("plain", 4, 300)]}
    rows, why = serving_stage.predictions(doc, data, "this results file")
    assert why is None and [r["concurrency"] for r in rows] == [1, 4]
    assert all(r["plain_tok_s"] > 0 and r["sd_batched_tok_s"] is None for r in rows)
    assert all(r["why"] == "no DRAFT named, so no acceptance pass to look up" for r in rows)


def test_a_fit_made_with_another_drafters_step_predicts_no_serving_line():
    from mac_moesd.pipeline import serving_stage

    doc = {"target_name": "T", "draft_name": "D1", "prompts": ["code"], "legs": [], "gamma": 4}
    data = {"fits": {"T": {"model": "T", "chosen": "mlx", "draft_model": "D2"}}}
    rows, why = serving_stage.predictions(doc, data, "results.json")
    assert rows == [] and "made with D2's step, not D1's" in why
