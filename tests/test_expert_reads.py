import numpy as np
import pytest

from mac_moesd.analysis import expert_reads, theory

E, K = 64, 4


def counts_from(c, cb, batches=(1, 2, 4, 8), tokens=(1, 2, 4, 8)):
    form = expert_reads.Routing(c, cb)
    return {(b, t): float(form.unique(b, t, E, K)) for b in batches for t in tokens}


def test_both_correlations_recovered_from_counts():
    routing = expert_reads.fit_routing(counts_from(0.4, 0.8), E, K)
    assert routing.correlation == pytest.approx(0.4, abs=1e-4)
    assert routing.batch_correlation == pytest.approx(0.8, abs=1e-4)


def test_uniform_counts_give_moesds_n_of_bt():
    counts = {(b, t): float(theory.activated_experts(b * t, E, K)) for b in (1, 2, 4) for t in (1, 3, 5)}
    routing = expert_reads.fit_routing(counts, E, K)
    assert routing.correlation == pytest.approx(1.0, abs=1e-3)
    assert routing.batch_correlation == pytest.approx(1.0, abs=1e-3)
    # c = c_batch = 1: 3 sequences of 7 tokens are 21 uniform tokens,
    # N(21) = 64*(1 - (15/16)**21) = 64*(1 - 0.257868) = 47.49647
    assert routing.form_only().unique(3, 7, E, K) == pytest.approx(47.49647, rel=1e-3)


def test_counted_points_are_used_as_counted_and_the_form_between():
    counts = counts_from(0.5, 1.0)
    counts[(2, 4)] = 11.0  # a measured count off the form
    routing = expert_reads.fit_routing(counts, E, K)
    got = routing.unique(np.array([2, 3, 1]), np.array([4, 4, 1]), E, K)
    assert got[0] == 11.0
    assert got[2] == pytest.approx(4.0)  # one token always activates K = 4 experts
    # The off-form count pulls the fitted c below 0.5, so the form between is worked on the
    # Routing built with c = 0.5, c_batch = 1 and that count: (3, 4) is (1 + 1*2)*(1 + 0.5*3)
    # = 3*2.5 = 7.5 uniform tokens, N = 64*(1 - (15/16)**7.5) = 64*(1 - 0.616289) = 24.55749.
    direct = expert_reads.Routing(0.5, 1.0, {(2, 4): 11.0})
    got = direct.unique(np.array([2, 3, 1]), np.array([4, 4, 1]), E, K)
    np.testing.assert_allclose(got, [11.0, 24.55749, 4.0], rtol=1e-6)


def test_routing_form_worked_by_hand():
    # c = 0.5 within a sequence, c_batch = 0.8 across 3 sequences of 5 tokens:
    # (1 + 0.8*(3 - 1))*(1 + 0.5*(5 - 1)) = 2.6*3 = 7.8 uniform tokens,
    # N = 64*(1 - (15/16)**7.8) = 64*(1 - 0.604472) = 25.31381
    assert expert_reads.Routing(0.5, 0.8).unique(3, 5, E, K) == pytest.approx(25.31381, abs=1e-5)
    # One sequence of one token: (1 + 0)*(1 + 0) = 1 uniform token, exactly K = 4 experts.
    assert expert_reads.Routing(0.5, 0.8).unique(1, 1, E, K) == pytest.approx(4.0)


def test_a_correlation_the_grid_cannot_see_stays_uniform():
    only_b1 = {(1, t): v for (b, t), v in counts_from(0.3, 0.5).items() if b == 1}
    routing = expert_reads.fit_routing(only_b1, E, K)
    assert routing.correlation == pytest.approx(0.3, abs=1e-3)
    assert routing.batch_correlation == 1.0
    assert expert_reads.fit_routing({}, E, K) == expert_reads.Routing()


def test_round_trip_through_a_document():
    routing = expert_reads.fit_routing(counts_from(0.4, 0.9), E, K)
    again = expert_reads.Routing.from_dict(routing.to_dict())
    assert again == routing
    assert expert_reads.Routing.from_dict(None) == expert_reads.Routing()
