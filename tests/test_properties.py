"""Properties of the formulas that hold for every input: monotonicity, limits, invariances.

The hand-worked values sit in each module's own tests; these check the shape of each formula over
inputs hypothesis draws (derandomised, so every run draws the same examples, and no database).
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mac_moesd.analysis import acceptance, cluster, expert_reads, fit, pipelining, round_terms, theory
from test_fit import hand_fit_doc

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True, database=None)
REL = 1e-9  # rounding slack in comparisons of two evaluations of one formula

alphas = st.floats(0.0, 1.0)
gammas = st.integers(1, 16)
tokens = st.floats(0.0, 500.0)


@st.composite
def moe_shapes(draw):
    """(E, K) with 1 <= K <= E."""
    experts = draw(st.integers(1, 256))
    return experts, draw(st.integers(1, experts))


@SETTINGS
@given(shape=moe_shapes(), t1=tokens, t2=tokens)
def test_activated_experts_rise_with_tokens_within_e_and_t_times_k(shape, t1, t2):
    experts, top_k = shape
    lo, hi = sorted((t1, t2))
    n_lo, n_hi = theory.activated_experts([lo, hi], experts, top_k)
    assert 0.0 <= n_lo <= n_hi * (1 + REL) and n_hi <= experts * (1 + REL)
    # No t tokens activate more than t*K experts (Bernoulli: (1 - rho)^t >= 1 - t*rho for t >= 1).
    if lo >= 1:
        assert n_lo <= lo * top_k * (1 + REL)
    assert theory.activated_experts(1, experts, top_k) == pytest.approx(top_k)


@SETTINGS
@given(shape=moe_shapes(), tau=st.floats(0.5, 0.99))
def test_activated_experts_tend_to_e_first_reaching_tau_at_the_threshold(shape, tau):
    experts, top_k = shape
    t = theory.saturation_threshold(top_k / experts, tau)
    at, before = theory.activated_experts([t, t - 1], experts, top_k)
    assert at >= tau * experts * (1 - REL)
    assert t == 1 or before < tau * experts * (1 + REL)


@SETTINGS
@given(shape=moe_shapes(), c=st.floats(0.001, 1.0))
def test_one_token_activates_k_experts_at_any_correlation(shape, c):
    experts, top_k = shape
    assert theory.correlated_activated_experts(1, experts, top_k, c) == pytest.approx(top_k)


@SETTINGS
@given(a1=alphas, a2=alphas, gamma=gammas)
def test_tokens_per_round_lie_between_1_and_gamma_plus_1_and_rise_with_alpha(a1, a2, gamma):
    lo, hi = sorted((a1, a2))
    omega_lo, omega_hi = theory.expected_tokens_per_round([lo, hi], gamma)
    assert 1.0 * (1 - REL) <= omega_lo <= omega_hi * (1 + REL)
    assert omega_hi <= (gamma + 1) * (1 + REL)
    # one more draft token never produces fewer tokens per round
    assert theory.expected_tokens_per_round(hi, gamma + 1) >= omega_hi * (1 - REL)


@SETTINGS
@given(alpha=alphas, gamma=gammas)
def test_alpha_solved_from_the_mean_accepted_length_is_the_alpha_it_came_from(alpha, gamma):
    mean = float(theory.mean_accepted_length(alpha, gamma))
    assert acceptance.solve_alpha(mean, gamma) == pytest.approx(alpha, abs=1e-9)


@SETTINGS
@given(t1=tokens, t2=tokens, knee=st.floats(1.0, 100.0), s=st.floats(1.0, 1.5))
def test_compute_transition_rises_from_1_and_is_continuous_at_the_knee(t1, t2, knee, s):
    lo, hi = sorted((t1, t2))
    g_lo, g_hi = theory.compute_transition([lo, hi], knee, s)
    assert 1.0 * (1 - REL) <= g_lo <= g_hi * (1 + REL)
    # both branches give s**knee at the knee
    assert theory.compute_transition(knee, knee, s) == pytest.approx(s**knee)
    assert theory.compute_transition(knee * (1 + 1e-12), knee, s) == pytest.approx(s**knee)


@SETTINGS
@given(b1=st.integers(1, 64), b2=st.integers(1, 64), t1=st.integers(1, 16), t2=st.integers(1, 16),
       c=st.floats(0.01, 1.0), cb=st.floats(0.01, 1.0), dc=st.floats(0.0, 0.5))
def test_routing_form_rises_with_batch_tokens_and_correlation_between_k_and_e(b1, b2, t1, t2, c, cb, dc):
    experts, top_k = 64, 4
    (b_lo, b_hi), (t_lo, t_hi) = sorted((b1, b2)), sorted((t1, t2))
    routing = expert_reads.Routing(c, cb)
    n_lo, n_hi = routing.unique([b_lo, b_hi], [t_lo, t_hi], experts, top_k)
    assert top_k * (1 - REL) <= n_lo <= n_hi * (1 + REL) <= experts * (1 + REL)
    # less reuse of experts (a correlation nearer 1) never activates fewer of them
    looser = expert_reads.Routing(min(1.0, c + dc), min(1.0, cb + dc))
    assert looser.unique(b_hi, t_hi, experts, top_k) >= n_hi * (1 - REL)
    # uniform routing is MoESD's N(B*t)
    assert expert_reads.Routing().unique(b_hi, t_hi, experts, top_k) == pytest.approx(
        float(theory.activated_experts(b_hi * t_hi, experts, top_k)))


@SETTINGS
@given(sync=st.floats(1e-6, 1.0), hidden=st.floats(0.0, 2.0), gamma=gammas)
def test_pipelining_hides_at_most_half_a_forward_and_a_draft_step_at_most_that(sync, hidden, gamma):
    piped = float(pipelining.pipelined(sync, hidden))
    step = float(pipelining.draft_step(sync, hidden, gamma))
    assert sync / 2 * (1 - REL) <= piped <= sync
    assert piped * (1 - REL) <= step <= sync  # the round's first draft step is not pipelined


@SETTINGS
@given(n1=st.integers(1, 4096), n2=st.integers(1, 4096), latency=st.floats(0.0, 1e-3),
       per_byte=st.floats(1e-12, 1e-8), count=st.integers(1, 64))
def test_communication_per_token_falls_with_tokens_per_forward(n1, n2, latency, per_byte, count):
    comm = cluster.CommTerm(({"op": "all_sum", "count": count, "bytes_per_token": 2048.0, "latency_s": latency,
                                      "seconds_per_byte": per_byte, "points": 3},))
    lo, hi = sorted((n1, n2))
    c_lo, c_hi = comm.time([lo, hi])
    assert c_lo <= c_hi * (1 + REL)  # more tokens, more bytes
    assert c_hi / hi <= c_lo / lo * (1 + REL)  # the latency is paid once per forward


@SETTINGS
@given(a1=alphas, a2=alphas, gamma=gammas, batch=st.integers(1, 64), context=st.integers(1, 4096),
       k_kv=st.floats(0.0, 1e-5), target_s=st.floats(0.0, 1e-3), draft_s=st.floats(0.0, 1e-4))
def test_predicted_speedup_rises_with_alpha_and_spans_gamma_plus_1(a1, a2, gamma, batch, context, k_kv,
                                                                   target_s, draft_s):
    doc = hand_fit_doc(k_kv=k_kv)
    doc["pipelining"] = {"target_s": target_s, "draft_s": draft_s, "target_points": 4, "draft_points": 4}
    model = fit.FittedModel.from_document(doc)
    lo, hi = sorted((a1, a2))
    s_lo, s_hi = (float(model.speedup(batch, gamma, a, context)) for a in (lo, hi))
    assert 0 < s_lo <= s_hi * (1 + REL)
    # Every draft accepted against none: gamma + 1 tokens per round instead of 1, at one cost
    # where the drafter's last draft rides the next round's first step (mlx-lm), and at one more
    # drafter step a round where the suite's loop feeds it on its own.
    s0, s1 = (float(model.speedup(batch, gamma, a, context, catch_up=False)) for a in (0.0, 1.0))
    assert s1 / s0 == pytest.approx(gamma + 1)
    plain, verify, draft, reject = (float(x) for x in model.step_times(batch, gamma, context))
    fixed = reject + float(round_terms.seconds(model.bookkeeping, batch))
    looped = float(model.speedup(batch, gamma, 1.0, context, catch_up=True))
    assert looped / s0 == pytest.approx((gamma + 1) * (gamma * draft + verify + fixed)
                                        / ((gamma + 1) * draft + verify + fixed))


@SETTINGS
@given(l1=st.integers(1, 8192), l2=st.integers(1, 8192), k_kv=st.floats(1e-9, 1e-5), alpha=alphas,
       gamma=gammas, batch=st.integers(1, 64))
def test_a_longer_context_never_lowers_the_speedup_when_only_the_target_reads_a_cache(l1, l2, k_kv, alpha,
                                                                                     gamma, batch):
    # The KV read adds the same k_kv*B*L to plain decode and to the verify forward, which costs at
    # least a plain step: S = Omega*(p + kv)/(gamma*T_D + v + kv) rises with kv (MagicDec).
    model = fit.FittedModel.from_document(hand_fit_doc(k_kv=k_kv))
    lo, hi = sorted((l1, l2))
    s_lo, s_hi = (float(model.speedup(batch, gamma, alpha, L)) for L in (lo, hi))
    assert s_lo <= s_hi * (1 + REL)
    assert math.isfinite(s_hi)
