"""The pair verdict: best gamma from the fitted model, and the deciding term when SD does not pay."""

import json
from pathlib import Path

import pytest

from mac_moesd.analysis import theory, verdict
from mac_moesd.analysis.fit import FittedModel

# Today's recorded `run --quick`: its fit has pipelined forwards and a timed one-row forward, which
# the round's cost must price as FittedModel.speedup does (the early fixture has neither, so a
# synchronous account and the speedup's coincided on it and hid their difference).
FIXTURE = Path(__file__).parent / "data" / "results_quick_cpu.json"


@pytest.fixture(scope="module")
def fit_doc():
    return json.loads(FIXTURE.read_text())["fits"]["tiny-moe"]


def test_round_cost_worked_by_hand():
    # pairs loads, K = 2, G = 1 (s = 1): T(n) = bias + k2*2n, so T(1) = 0.95 + 0.05 = 1.0 ms and
    # T(5) = 0.95 + 0.25 = 1.2 ms; T_D = 0.1 ms = 0.1 T_T(1); no rejection, nothing pipelined.
    # alpha 0.8, gamma 4: Omega = (1 - 0.8^5) / 0.2 = 3.3616; round = 4*0.1 + 1.2 = 1.6 ms;
    # S = 3.3616 * 1.0 / 1.6 = 2.101.
    model = FittedModel.from_document(_fit(bias=0.95e-3, k1=0.0, k2=0.025e-3, draft_bias=0.1e-3,
                                           draft_k=0.0, chosen="pairs"))
    cost = verdict.round_cost(model, 1, 4, 64, 0.7)
    assert (cost.plain, cost.verify, cost.draft, cost.reject) == pytest.approx((1.0e-3, 1.2e-3, 0.4e-3, 0.0))
    assert cost.speedup(3.3616) == pytest.approx(2.101)
    assert float(model.speedup(1, 4, 0.8, 64)) == pytest.approx(2.101)


def test_a_model_that_re_forwards_pays_its_rollback_in_the_round():
    # The model above, its target a hybrid (a recurrent state: a rolled-back round re-forwards the
    # tokens it keeps). alpha 0.8, gamma 4, B = 1: a round rolls back with p = 1 - 0.8^4 = 0.5904;
    # E[accepted] = 0.8 + 0.64 + 0.512 + 0.4096 = 2.3616, so given a rejection it is
    # (2.3616 - 4*0.4096) / 0.5904 = 1.22493 and 2.22493 tokens are re-forwarded:
    # T(2.22493) = 0.95 + 0.05*2.22493 = 1.06125 ms; rollback 0.5904 * 1.06125 = 0.62656 ms a round;
    # S = 3.3616 / (1.6 + 0.62656) = 1.50977 (2.101 without the rollback).
    doc = _fit(bias=0.95e-3, k1=0.0, k2=0.025e-3, draft_bias=0.1e-3, draft_k=0.0, chosen="pairs")
    doc["reforward"] = ["target"]
    model = FittedModel.from_document(doc)
    assert float(theory.kept_on_rollback(0.8, 4, 1)) == pytest.approx(2.22493, abs=1e-5)
    cost = verdict.round_cost(model, 1, 4, 64, 0.8)
    assert cost.rollback == pytest.approx(0.62656e-3, rel=1e-4)
    assert float(model.speedup(1, 4, 0.8, 64)) == pytest.approx(1.50977, abs=1e-4) == cost.speedup(3.3616)
    # Every draft accepted: nothing rolls back; none accepted at B = 4: one token kept, p = 1.
    assert float(model.rollback_time(1, 4, 1.0, 64)) == 0.0
    assert float(theory.kept_on_rollback(0.0, 4, 4)) == 1.0 and float(theory.rollback_probability(0.0, 4, 4)) == 1.0
    assert verdict.deciding_term(model, 1, 4, 0.8, 64)["round_share"]["rollback"] == pytest.approx(
        0.62656 / 2.22656, rel=1e-4)


def test_a_re_forwarding_drafter_rolls_back_only_when_a_draft_before_its_last_is_rejected():
    # The drafter forwarded the pending token and gamma - 1 = 3 drafts: a rejection of the 4th
    # leaves it holding exactly what is kept. alpha 0.8, B = 1: it rolls back with
    # p = 1 - 0.8^3 = 0.488 and re-forwards about one step, T_D = 0.1 ms: 0.0488 ms a round;
    # S = 3.3616 / (1.6 + 0.0488) = 2.03881. With gamma 1 it never rolls back.
    doc = _fit(bias=0.95e-3, k1=0.0, k2=0.025e-3, draft_bias=0.1e-3, draft_k=0.0, chosen="pairs")
    doc["reforward"] = ["draft"]
    model = FittedModel.from_document(doc)
    assert float(model.rollback_time(1, 4, 0.8, 64)) == pytest.approx(0.0488e-3, rel=1e-9)
    assert float(model.speedup(1, 4, 0.8, 64)) == pytest.approx(2.03881, abs=1e-5)
    assert float(model.rollback_time(1, 1, 0.3, 64)) == 0.0


def test_round_cost_prices_forwards_as_the_loops_run_them():
    # The model above with pipelining hiding 0.1 ms of each target forward and 0.04 ms of each
    # drafter step. Plain step 1.0 - 0.1 = 0.9 ms; verify 1.2 - 0.1 = 1.1 ms; the first draft
    # step of a round pays its graph build, the other three hide 0.04 ms: 4*0.1 - 3*0.04 = 0.28 ms.
    # S = 3.3616 * 0.9 / (0.28 + 1.1) = 2.1924 (synchronous prices would say 3.3616 / 1.6 = 2.101).
    doc = _fit(bias=0.95e-3, k1=0.0, k2=0.025e-3, draft_bias=0.1e-3, draft_k=0.0, chosen="pairs")
    doc["pipelining"] = {"target_s": 0.1e-3, "draft_s": 0.04e-3, "target_points": 4, "draft_points": 4}
    model = FittedModel.from_document(doc)
    cost = verdict.round_cost(model, 1, 4, 64, 0.7)
    assert (cost.plain, cost.verify, cost.draft) == pytest.approx((0.9e-3, 1.1e-3, 0.28e-3))
    assert cost.speedup(3.3616) == pytest.approx(2.19235, abs=1e-4)
    assert float(model.speedup(1, 4, 0.8, 64)) == pytest.approx(cost.speedup(3.3616))


def test_deciding_term_parts_add_up_to_the_predicted_speedup(fit_doc):
    # On a recorded fit with pipelined forwards: the verdict's S, its round shares and the
    # round itself are one account with FittedModel.speedup.
    model = FittedModel.from_document(fit_doc)
    for batch, gamma, alpha in ((1, 2, 0.6), (4, 4, 0.9)):
        d = verdict.deciding_term(model, batch, gamma, alpha, 64)
        assert d["speedup"] == pytest.approx(float(model.speedup(batch, gamma, alpha, 64)))
        assert sum(d["round_share"].values()) == pytest.approx(1.0)


def test_best_gamma_is_the_argmax_over_gamma(fit_doc):
    model = FittedModel.from_document(fit_doc)
    gamma, s = verdict.best_gamma(model, 1, 0.8, 64)
    assert s == max(float(model.speedup(1, g, 0.8, 64)) for g in theory.CANDIDATE_GAMMAS)
    assert s == pytest.approx(float(model.speedup(1, gamma, 0.8, 64)))


def test_low_acceptance_is_decided_by_acceptance():
    # Verify costs one plain step and the drafter little: at alpha 0.05 acceptance decides.
    doc = _fit(bias=1e-3, k1=0.0, k2=0.0, draft_bias=2e-4, draft_k=0.0)
    (row,) = verdict.verdict_rows(doc, [{"prompts": "code", "temperature": 0.0, "alpha": 0.05}], 64)
    assert row["pays_off"] is False and row["gamma"] == 1
    assert row["deciding"]["term"] == "acceptance"
    assert row["deciding"]["speedup_without"]["acceptance"] == pytest.approx(2e-3 / 1.2e-3)


def test_costly_drafter_is_named():
    doc = _fit(bias=1e-3, k1=0.0, k2=0.0, draft_bias=5e-3, draft_k=0.0)
    (row,) = verdict.verdict_rows(doc, [{"prompts": "chat", "temperature": 1.0, "alpha": 0.9}], 64)
    assert row["pays_off"] is False
    assert row["deciding"]["term"] == "drafter cost"
    assert row["deciding"]["round_share"]["drafter"] > 0.5


def test_costly_verify_is_named():
    # Every extra token costs a full step (pairs regime, large k2); the drafter is nearly free.
    doc = _fit(bias=1e-4, k1=0.0, k2=2e-3, draft_bias=1e-6, draft_k=0.0, chosen="pairs")
    (row,) = verdict.verdict_rows(doc, [{"prompts": "code", "temperature": 0.0, "alpha": 0.6}], 64)
    assert row["pays_off"] is False
    assert row["deciding"]["term"] == "verify cost"
    assert row["deciding"]["verify_over_plain"] > 1.5


def test_a_cheap_system_with_good_acceptance_pays_off():
    doc = _fit(bias=1e-3, k1=0.0, k2=0.0, draft_bias=1e-5, draft_k=0.0)
    (row,) = verdict.verdict_rows(doc, [{"prompts": "code", "temperature": 0.0, "alpha": 0.9}], 64,
                                  batches=(1,))
    assert row["pays_off"] and row["gamma"] == 8 and "deciding" not in row


def _fit(bias, k1, k2, draft_bias, draft_k, chosen="unique"):
    params = {"bias": bias, "k1": k1, "k2": k2, "k3": 0.0, "lam": 1.0, "s": 1.0,
              "draft_bias": draft_bias, "draft_k": draft_k, "reject_bias": 0.0, "reject_k": 0.0}
    return {"chosen": chosen, "experts": 16, "top_k": 2, "ridge_tokens": 10.0, "sort_threshold": 64,
            "drafted": True, "variants": [{"name": chosen, "params": params, "k_kv": 0.0}]}


# The hand-worked model of test_round_cost_worked_by_hand: T(n) = 0.95 + 0.05 n ms (pairs loads,
# K = 2, k2 = 0.025 ms), T_D = 0.1 ms, no rejection, nothing pipelined.
HAND = dict(bias=0.95e-3, k1=0.0, k2=0.025e-3, draft_bias=0.1e-3, draft_k=0.0, chosen="pairs")


def test_alpha_0_recommends_the_shortest_draft_and_names_acceptance():
    # Omega = 1 at alpha 0; gamma 1: S = 1 / (0.1 + T(2) = 1.05) = 0.8696, larger gammas only add cost.
    # Without the acceptance term: 2 / 1.15 = 1.7391; without the drafter: 1 / 1.05 = 0.9524;
    # verify at a plain step's price: 1 / (0.1 + 1.0) = 0.9091.
    (row,) = verdict.verdict_rows(_fit(**HAND), [{"prompts": "code", "temperature": 0.0, "alpha": 0.0}], 64)
    assert row["gamma"] == 1 and row["predicted_speedup"] == pytest.approx(0.8696, abs=1e-4)
    assert not row["pays_off"] and row["deciding"]["term"] == "acceptance"
    assert row["deciding"]["speedup_without"] == pytest.approx(
        {"acceptance": 1.7391, "drafter cost": 0.9524, "verify cost": 0.9091}, abs=1e-4)


def test_alpha_1_recommends_the_longest_draft():
    # Omega = gamma + 1 at alpha 1: S(g) = (g + 1) / (0.1 g + 0.95 + 0.05 (g + 1)) rises with g, so
    # the longest draft of the list wins: gamma 8, S = 9 / (0.8 + 1.4) = 4.0909.
    (row,) = verdict.verdict_rows(_fit(**HAND), [{"prompts": "code", "temperature": 0.0, "alpha": 1.0}], 64)
    assert row["gamma"] == 8 and row["predicted_speedup"] == pytest.approx(4.0909, abs=1e-4)
    assert row["pays_off"] and "deciding" not in row


def test_gamma_1_round():
    # gamma 1 at alpha 0.5: Omega = (1 - 0.25) / 0.5 = 1.5; round = 0.1 + T(2) = 1.15 ms; S = 1.3043.
    model = FittedModel.from_document(_fit(**HAND))
    cost = verdict.round_cost(model, 1, 1, 64, 0.7)
    assert cost.round == pytest.approx(1.15e-3)
    assert float(model.speedup(1, 1, 0.5, 64)) == pytest.approx(1.3043, abs=1e-4)


def test_a_speedup_of_exactly_1_does_not_pay_off():
    # A free drafter, a verify at a plain step's price and alpha 0: S = 1 * 1 ms / 1 ms = 1 exactly
    # at every gamma; SD gains nothing, so it "does not pay off", and acceptance decides (2 / 1).
    doc = _fit(bias=1e-3, k1=0.0, k2=0.0, draft_bias=0.0, draft_k=0.0)
    (row,) = verdict.verdict_rows(doc, [{"prompts": "code", "temperature": 0.0, "alpha": 0.0}], 64)
    assert row["predicted_speedup"] == 1.0 and row["pays_off"] is False
    assert row["deciding"]["term"] == "acceptance" and row["deciding"]["speedup_without"]["acceptance"] == 2.0


def test_break_even_acceptance_and_drafter_cost_worked_by_hand():
    from mac_moesd.analysis.break_even import break_even_alpha, break_even_draft_ratio

    # gamma 1: round 0.1 + 1.05 = 1.15 ms must yield 1.15 tokens: L = alpha = 0.15 exactly.
    assert break_even_alpha(1.0, 1.05, 0.1, 0.0, 1) == pytest.approx(0.15)
    # gamma 4: round 0.4 + 1.2 = 1.6 ms: alpha + alpha^2 + alpha^3 + alpha^4 = 0.6 at 0.379949
    # (0.38 gives 0.600123, 0.3799 gives 0.599987).
    assert break_even_alpha(1.0, 1.2, 0.1, 0.0, 4) == pytest.approx(0.379949, abs=1e-6)
    assert break_even_alpha(1.0, 0.5, 0.1, 0.0, 4) == 0.0  # a round cheaper than a step pays at any alpha
    assert break_even_alpha(1.0, 5.0, 0.1, 0.0, 4) is None  # 5.4 ms: not even 5 tokens a round pay
    # At alpha 0.8 the drafter may cost up to (3.3616 * 1.0 - 1.2) / 4 = 0.5404 of a plain step.
    assert break_even_draft_ratio(1.0, 1.2, 0.0, 4, 0.8) == pytest.approx(0.5404)
    assert break_even_draft_ratio(1.0, 4.0, 0.0, 4, 0.8) is None  # even a free drafter loses


def test_a_verdict_row_carries_the_break_even_values_and_its_measurement():
    # HAND at alpha 0.8: best gamma 5 (S 3.68928 / 1.75 = 2.10816); round 0.5 + T(6) = 1.25 ms, so
    # break-even alpha solves a + ... + a^5 = 0.75: 0.432301; drafter (3.68928 - 1.25) / 5 = 0.487856.
    run = {"batch": 1, "gamma": 5, "temperature": 0.0, "measured_speedup": 2.0, "measured_ci": [1.9, 2.05],
           "measured_alpha": 0.8, "round": {"plain_s": 1.0e-3, "verify_s": 1.25e-3, "draft_s": 0.8e-3}}
    doc = {**_fit(**HAND), "heldout_mape": 0.04}
    (row,) = verdict.verdict_rows(doc, [{"prompts": "code", "temperature": 0.0, "rule": "greedy", "alpha": 0.8}],
                                  64, runs=[run])
    assert row["gamma"] == 5 and row["predicted_speedup"] == pytest.approx(2.10816, abs=1e-5)
    assert row["break_even_alpha"] == pytest.approx(0.432301, abs=1e-6)
    assert row["break_even_draft_ratio"] == pytest.approx(0.487856, abs=1e-6)
    # Agreement: inside [1.9 * 0.96, 2.05 * 1.04] = [1.824, 2.132].
    assert row["measured_speedup"] == 2.0 and row["agrees"] is True
    assert row["agreement_band"] == pytest.approx([1.824, 2.132])
    # The timed drafter phase took 0.8 ms where the model prices 0.5 ms: that term differs most.
    assert row["differs_most"]["term"] == "drafter steps"
    assert row["differs_most"]["model_over_measured"] == pytest.approx(0.625)
    # Run by the suite's loop, whose timed draft part counts the catch-up step after the 0.8^5 of
    # rounds that accepted every draft, the model's counts it too: (0.5 + 0.32768 x 0.1) / 0.8.
    fed = verdict.differing_term(FittedModel.from_document(doc), {**run, "engine": "mac-moesd loop"}, 64, 0.8)
    assert fed["ratios"]["drafter steps"] == pytest.approx((0.5 + 0.8 ** 5 * 0.1) / 0.8)
    run["measured_ci"] = [1.5, 1.6]
    (row,) = verdict.verdict_rows(doc, [{"prompts": "code", "temperature": 0.0, "rule": "greedy", "alpha": 0.8}],
                                  64, runs=[run])
    assert row["agrees"] is False  # 2.108 > 1.6 * 1.04


def test_the_differing_term_is_the_one_that_moves_the_speedup_most():
    # HAND prices at B=1, gamma 5: plain 1.0 ms, verify 1.25 ms, drafter 0.5 ms. The run timed
    # plain 0.8 ms (ratio 1.25: the speedup 25% high) and the drafter 1.0 ms (ratio 0.5, but half
    # of 1.0 ms in a 2.25 ms round: the round 22.2% short, the speedup about that much high).
    model = FittedModel.from_document({**_fit(**HAND), "heldout_mape": 0.04})
    run = {"batch": 1, "gamma": 5, "measured_alpha": 0.8,
           "round": {"plain_s": 0.8e-3, "verify_s": 1.25e-3, "draft_s": 1.0e-3}}
    term = verdict.differing_term(model, run, 64, 0.8)
    assert term["term"] == "plain step" and term["model_over_measured"] == pytest.approx(1.25)
    assert term["ratios"]["drafter steps"] == pytest.approx(0.5)
    assert term["effects"] == pytest.approx({"plain step": 0.25, "verify": 0.0, "drafter steps": 0.5 / 2.25,
                                             "acceptance": 0.0})
    # The drafter timed at 2.0 ms (ratio 0.25, 2.0 of a 3.25 ms round: 0.75 x 2.0 / 3.25 = 0.46): it leads.
    run["round"]["draft_s"] = 2.0e-3
    assert verdict.differing_term(model, run, 64, 0.8)["term"] == "drafter steps"
