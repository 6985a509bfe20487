import numpy as np
import pytest

from mac_moesd.analysis import acceptance


def chain_rounds(alpha, gamma, rounds, seed=0):
    """Accepted draft tokens per round when each draft token is accepted with probability alpha
    until the first rejection."""
    draws = np.random.default_rng(seed).random((rounds, gamma)) < alpha
    return np.cumprod(draws, axis=1).sum(axis=1)


def test_alpha_is_solved_from_the_mean_accepted_length():
    # L = alpha + alpha**2 + ... + alpha**gamma (Leviathan et al., Eq. 1, less the bonus token):
    #   gamma 1, alpha 0.5: 0.5;  gamma 2, alpha 0.5: 0.5 + 0.25 = 0.75
    #   gamma 4, alpha 0.8: 0.8 + 0.64 + 0.512 + 0.4096 = 2.3616
    #   gamma 8, alpha 0.1: 0.1 + 0.01 + ... + 1e-8 = 0.11111111
    #   gamma 8, alpha 0.95: 0.95*(1 - 0.95**8)/0.05 = 0.95*(1 - 0.66342043128906)/0.05 = 6.395011805507812
    for L, gamma, alpha in [(0.5, 1, 0.5), (0.75, 2, 0.5), (2.3616, 4, 0.8), (0.11111111, 8, 0.1),
                            (6.395011805507812, 8, 0.95)]:
        assert acceptance.solve_alpha(L, gamma) == pytest.approx(alpha, abs=1e-9)
    assert acceptance.solve_alpha(0.0, 4) == 0.0 and acceptance.solve_alpha(4.0, 4) == 1.0
    with pytest.raises(ValueError):
        acceptance.solve_alpha(4.5, 4)


def test_measured_rounds_give_alpha_not_accepted_over_drafted():
    # At alpha 0.8 and gamma 4, accepted/drafted is 0.59: the old predictor input.
    counts = chain_rounds(0.8, 4, 20_000)
    assert counts.mean() / 4 == pytest.approx(0.59, abs=0.01)
    stats = acceptance.summarise_rounds(counts, 4)
    assert stats["alpha"] == pytest.approx(0.8, abs=0.01)
    # sigma = Omega/(gamma + 1) = (1 - 0.8**5)/0.2/5 = 3.3616/5 = 0.67232
    assert stats["sigma"] == pytest.approx(0.67232, abs=0.01)
    np.testing.assert_allclose(stats["acceptance_by_position"], [0.8, 0.64, 0.512, 0.4096], atol=0.01)


def flags_of(rounds_accepted, gamma, max_tokens):
    """The from_draft flags mlx-lm's speculative_generate_step yields for these rounds."""
    flags = []
    for accepted in rounds_accepted:
        left = max_tokens - len(flags)
        drafted = min(left, gamma)
        n = min(accepted, drafted)
        flags += [True] * n
        if len(flags) == max_tokens:
            break
        flags.append(False)
        if len(flags) == max_tokens:
            break
    return flags


def test_mlx_lm_flags_give_alpha_not_from_draft_over_emitted():
    gamma, max_tokens = 4, 10_000
    counts = chain_rounds(0.8, gamma, 5_000, seed=1)
    flags = flags_of(counts, gamma, max_tokens)
    # from-draft / emitted is about 0.70 at alpha 0.8: the old predictor input.
    assert sum(flags) / len(flags) == pytest.approx(0.70, abs=0.01)
    rounds = acceptance.mlx_lm_rounds(flags, gamma, max_tokens)
    assert rounds == list(counts[: len(rounds)])
    assert acceptance.summarise_rounds(rounds, gamma)["alpha"] == pytest.approx(0.8, abs=0.01)


def test_mlx_lm_rounds_drop_the_shortened_last_rounds():
    # max_tokens 7, gamma 4: round 1 accepts 4 (+1), leaving 2, so mlx-lm drafts only 2 next.
    flags = [True, True, True, True, False, True, False]
    assert acceptance.mlx_lm_rounds(flags, 4, 7) == [4]
    assert acceptance.mlx_lm_rounds([False, False], 2, 7) == [0, 0]


def test_mlx_lm_verifies_count_every_round_the_decode_ran():
    assert acceptance.mlx_lm_verifies([True, True, True, True, False, True, False]) == 2
    # max_tokens 9, gamma 4: a round of 4 accepted (+1), then 4 drafted and accepted, ending the
    # decode inside the round: its verify ran, its target token was never yielded.
    assert flags_of([4, 4], 4, 9) == [True] * 4 + [False] + [True] * 4
    assert acceptance.mlx_lm_verifies(flags_of([4, 4], 4, 9)) == 2
    assert acceptance.mlx_lm_verifies([False, False, False]) == 3
    assert acceptance.mlx_lm_verifies([]) == 0


def test_expected_rounds_of_a_constant_rule_is_the_chain():
    # Every position accepted with probability a, whatever the drafted token: alpha = a exactly.
    a, gamma = 0.6, 4
    probs = np.full((50, gamma), a)
    stats = acceptance.expected_rounds(probs, probs)
    np.testing.assert_allclose(stats["acceptance_by_position"], [0.6, 0.36, 0.216, 0.1296])  # a**i
    assert stats["alpha"] == pytest.approx(a)
    # sigma = (1 - 0.6**5)/0.4/5 = (1 - 0.07776)/0.4/5 = 2.3056/5 = 0.46112
    assert stats["sigma"] == pytest.approx(0.46112)


def test_expected_rounds_matches_sampled_acceptance():
    # Random p, q over 5 tokens; drafts drawn from q; both rules' realised acceptance over many
    # rounds agrees with the expectation computed from the same distributions.
    rng = np.random.default_rng(0)
    rounds, gamma, vocab = 4000, 3, 5
    p = rng.dirichlet(np.ones(vocab), (rounds, gamma))
    q = rng.dirichlet(np.ones(vocab), (rounds, gamma))
    x = np.array([[rng.choice(vocab, p=q[r, j]) for j in range(gamma)] for r in range(rounds)])
    p_x = np.take_along_axis(p, x[..., None], -1)[..., 0]
    q_x = np.take_along_axis(q, x[..., None], -1)[..., 0]
    u = rng.random((rounds, gamma))
    y = (p.cumsum(-1) > u[..., None]).argmax(-1)  # the target's own sample at each position
    realised = {"mlx-lm": np.cumprod(y == x, axis=1).sum(1),
                "rejection": np.cumprod(u < np.minimum(1, p_x / q_x), axis=1).sum(1)}
    expected = {"mlx-lm": acceptance.expected_rounds(p_x, (p * q).sum(-1)),
                "rejection": acceptance.expected_rounds(np.minimum(1, p_x / q_x), np.minimum(p, q).sum(-1))}
    for rule in acceptance.RULES:
        assert realised[rule].mean() == pytest.approx(expected[rule]["mean_accepted"], abs=0.04)
    # Exact rejection sampling accepts more than mlx-lm's rule: min(p, q) >= p*q pointwise.
    assert expected["rejection"]["mean_accepted"] > expected["mlx-lm"]["mean_accepted"]


def test_expected_rounds_refuses_mismatched_shapes():
    with pytest.raises(ValueError):
        acceptance.expected_rounds(np.ones((3, 2)), np.ones((3, 3)))
