import math

import numpy as np
import pytest

from mac_moesd.analysis import theory


@pytest.mark.parametrize(
    "experts, top_k, expected",
    [(64, 8, 23), (64, 4, 47), (128, 4, 95), (8, 2, 11), (16, 16, 1)],
)
def test_saturation_threshold_worked_values(experts, top_k, expected):
    assert theory.saturation_threshold(theory.sparsity(experts, top_k), 0.95) == expected


def test_threshold_is_the_first_t_reaching_tau():
    for experts, top_k in [(64, 8), (60, 4), (128, 8), (8, 2)]:
        t = theory.saturation_threshold(top_k / experts, 0.95)
        fractions = theory.activated_experts([t - 1, t], experts, top_k) / experts
        assert fractions[0] < 0.95 <= fractions[1]


def test_activated_experts_hand_values():
    n = theory.activated_experts([1, 2, 4], 64, 8)
    np.testing.assert_allclose(n, [8.0, 15.0, 64 * (1 - 0.875**4)])
    assert n[2] == pytest.approx(26.484, abs=1e-3)
    np.testing.assert_allclose(theory.activated_fraction([1, 2], 0.25), [0.25, 0.4375])


def test_tokens_per_expert():
    assert theory.tokens_per_expert(1, 0.125) == pytest.approx(1.0)
    assert theory.tokens_per_expert(2, 0.125) == pytest.approx(0.25 / 0.234375)
    # Far past saturation every expert is hit: rho * t tokens each.
    assert theory.tokens_per_expert(400, 0.125) == pytest.approx(50.0)


def test_anchored_correlation_keeps_one_token_at_k_experts():
    # The earlier form N(c*t) gave 5.4 experts for one token at c = 0.67 (E = 128, K = 8).
    for c in (0.3, 0.56, 0.67, 1.0):
        assert theory.correlated_activated_experts(1, 128, 8, c) == pytest.approx(8.0)
    # N_c(t) = N(1 + c*(t-1)): N_c(10) at c = 0.5 is N(1 + 0.5*9) = N(5.5)
    #   = 64*(1 - (7/8)**5.5) = 64*(1 - 0.479782) = 33.29393
    assert theory.correlated_activated_experts(10, 64, 8, 0.5) == pytest.approx(33.29393, abs=1e-5)
    # Cohere's window: c ~ 0.56 reproduces 20.36 unique of 128 top-8 at t = 4.
    assert theory.correlated_activated_experts(4, 128, 8, 0.5613) == pytest.approx(20.36, abs=0.01)


def test_within_sequence_threshold_is_the_first_t_reaching_tau():
    rho = 8 / 64
    base = theory.saturation_threshold(rho)
    assert theory.correlated_threshold(rho, 1.0) == base
    for c in (0.3, 0.5, 0.67):
        t = theory.correlated_threshold(rho, c)
        assert theory.correlated_activated_experts(t, 64, 8, c) >= 0.95 * 64
        assert theory.correlated_activated_experts(t - 1, 64, 8, c) < 0.95 * 64
    assert theory.correlated_threshold(rho, 0.67) == 33  # ceil(1 + (22.43 - 1)/0.67) = ceil(32.99)


def test_acceptance():
    assert theory.expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert theory.normalised_acceptance(0.8, 4) == pytest.approx(3.3616 / 5)
    np.testing.assert_allclose(theory.expected_tokens_per_round([0.0, 1.0], 3), [1.0, 4.0])
    with pytest.raises(ValueError):
        theory.expected_tokens_per_round(1.2, 3)


def test_speedup_and_target_efficiency():
    s = theory.speedup(sigma=0.5, gamma=3, target_plain=10, target_verify=12, draft_step=1, reject=0.5)
    assert s == pytest.approx(20 / 15.5)
    assert theory.target_efficiency(10, 12) == pytest.approx(10 / 12)
    # Perfect acceptance, free drafting and a verify that costs one plain step: gamma+1 tokens.
    assert theory.speedup(1.0, 4, 1.0, 1.0, 0.0, 0.0) == pytest.approx(5.0)


def test_compute_transition_is_exponential_then_tangent():
    g = theory.compute_transition([2, 4, 6], knee=4, s=1.5)
    assert g[0] == pytest.approx(2.25)
    assert g[1] == pytest.approx(1.5**4)
    assert g[2] == pytest.approx(1.5**4 * (1 + math.log(1.5) * 2))
    eps = 1e-6
    left = (theory.compute_transition(4, 4, 1.5) - theory.compute_transition(4 - eps, 4, 1.5)) / eps
    right = (theory.compute_transition(4 + eps, 4, 1.5) - theory.compute_transition(4, 4, 1.5)) / eps
    assert left == pytest.approx(right, rel=1e-4)
    np.testing.assert_allclose(theory.compute_transition([1, 50], 3, 1.0), [1.0, 1.0])


def test_time_model():
    names = theory.TimeModel.names()
    assert names == (
        "bias", "k1", "k2", "k3", "lam", "s",
        "draft_bias", "draft_k", "reject_bias", "reject_k",
    )
    model = theory.TimeModel(1.0, 0.1, 0.2, 0.3, 0.5, 1.2, 0.05, 0.01, 0.002, 0.001)
    assert theory.TimeModel.from_vector(model.to_vector()) == model
    ridge = 10.0  # knee = 5 tokens
    # One token: N(1) = K experts, one token each.
    assert model.target_time(1, 64, 4, ridge) == pytest.approx(1.0 + 0.1 * 1.2 + 0.2 * 4 + 0.3 * 1.2)
    # 16 tokens, past the knee of 5:
    #   G(16) = 1.2**5 * (1 + ln(1.2)*(16 - 5)) = 2.48832 * 3.005537 = 7.478738
    #   N(16) = 64*(1 - (15/16)**16) = 41.211256 reads; 16*4/41.211256 = 1.552974 tokens per read,
    #   below the knee: G = 1.2**1.552974 = 1.327292
    #   T = 1 + 0.1*7.478738 + 0.2*41.211256 + 0.3*1.327292
    #     = 1 + 0.747874 + 8.242251 + 0.398188 = 10.388312
    assert model.target_time(16.0, 64, 4, ridge) == pytest.approx(10.388312, abs=1e-6)
    assert model.draft_time(2, ridge) == pytest.approx(0.05 + 0.01 * 1.2**2)
    assert model.reject_time(8) == pytest.approx(0.002 + 0.008)


def test_expert_load_variants():
    E, K = 64, 4
    n = np.array([1.0, 4.0, 15.0, 16.0, 32.0])
    unique, per_unique = theory.expert_loads(n, E, K, "unique")
    # N(n) = 64*(1 - (15/16)**n): n = 1 -> 4; 4 -> 64*(1 - 0.772476) = 14.561523;
    # 15 -> 39.692006; 16 -> 41.211256; 32 -> 55.885518. Tokens per read 4n/N(n).
    np.testing.assert_allclose(unique, [4.0, 14.561523, 39.692006, 41.211256, 55.885518], rtol=1e-6)
    np.testing.assert_allclose(per_unique, [1.0, 1.098786, 1.511639, 1.552974, 2.290397], rtol=1e-6)
    pairs, per_pair = theory.expert_loads(n, E, K, "pairs")
    np.testing.assert_allclose(pairs, [4.0, 16.0, 60.0, 64.0, 128.0])  # n*K
    np.testing.assert_allclose(per_pair, 0.0)  # one-token reads: no expert-compute term
    # mlx-lm sorts once indices.size = n*K reaches 64: n = 16 at K = 4. Pairs below, N(n) from there.
    mlx, _ = theory.expert_loads(n, E, K, "mlx", sort_threshold=64)
    np.testing.assert_allclose(mlx, [4.0, 16.0, 60.0, 41.211256, 55.885518], rtol=1e-6)
    with pytest.raises(ValueError, match="unknown expert-load variant"):
        theory.expert_loads(n, E, K, "sorted")


def test_time_model_pairs_has_no_expert_compute_term():
    model = theory.TimeModel(1.0, 0.1, 0.2, 0.3, 0.5, 1.2, 0.0, 0.0, 0.0, 0.0)
    n = 8.0
    # knee 0.5*10 = 5; G(8) = 1.2**5 * (1 + ln(1.2)*3) = 2.48832 * 1.546965 = 3.849343;
    # 8*4 = 32 one-token reads and no k3 term: T = 1 + 0.1*3.849343 + 0.2*32 = 7.784934
    expected = 7.784934
    assert model.target_time(n, 64, 4, 10.0, "pairs") == pytest.approx(expected, abs=1e-6)
    # Below the sort threshold mlx is pairs; at and above it, unique.
    assert model.target_time(n, 64, 4, 10.0, "mlx", 64) == pytest.approx(expected, abs=1e-6)
    # n = 16: n*K = 64 sorts, so unique reads as in test_time_model: 10.388312
    assert model.target_time(16, 64, 4, 10.0, "mlx", 64) == pytest.approx(10.388312, abs=1e-6)


def test_mean_accepted_length():
    assert theory.mean_accepted_length(0.8, 4) == pytest.approx(0.8 + 0.64 + 0.512 + 0.4096)
    assert theory.mean_accepted_length(1.0, 3) == pytest.approx(3.0)


def test_kv_time():
    assert theory.kv_time(4, 1024, 1e-9) == pytest.approx(4 * 1024e-9)


def test_ridge_in_tokens_per_format():
    assert theory.ridge_in_tokens(30, "fp16") == pytest.approx(30)
    assert theory.ridge_in_tokens(30, "8bit") == pytest.approx(30 * 1.0625 / 2)
    assert theory.ridge_in_tokens(36, "4bit") == pytest.approx(36 / 3.5556, rel=1e-3)
    # Checkpoints of other bit widths (3-, 5-, 6-bit are published) with mlx-lm's groups of 64.
    assert theory.ridge_in_tokens(32, "3bit") == pytest.approx(32 * (3.5 / 8) / 2)
    for unknown in ("fp8", "12bit", "bit"):
        with pytest.raises(ValueError, match="unknown weight format"):
            theory.ridge_in_tokens(30, unknown)


@pytest.mark.parametrize("experts, top_k", [(0, 1), (8, 0), (8, 9)])
def test_sparsity_rejects_bad_shapes(experts, top_k):
    with pytest.raises(ValueError):
        theory.sparsity(experts, top_k)


def test_summarise_reaches_saturation_by_default():
    doc = theory.summarise(128, 4)
    assert doc["threshold_tokens"] == 95
    assert doc["activated"][-1]["t"] == 128
    assert doc["activated"][-1]["fraction"] >= 0.95


def test_the_best_gamma_is_the_fastest_and_the_shorter_of_a_tie():
    speeds = {1: 0.9, 2: 1.2, 3: 1.2, 4: 1.1, 5: None}
    assert theory.best_gamma(speeds.get, (1, 2, 3, 4, 5)) == (2, 1.2)
    assert theory.best_gamma(lambda g: None) is None
    assert theory.best_gamma(lambda g: 1.0 - 0.01 * (g - 3) ** 2) == (3, 1.0)  # over gamma 1..8
