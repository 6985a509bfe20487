"""The MoESD analytic model: expert activation, acceptance, speedup, and the fitted time model.

Pure numpy, vectorised over tokens ``t`` and batch ``B``; never imports MLX.

Sources:
- MoESD, "MoE speculative decoding batch-size regimes", arXiv 2505.19645 (activation, threshold,
  speedup, the compute-transition curve G and the Algorithm-1 time model).
- MagicDec, arXiv 2408.11049 (the KV-cache term that dominates at long context).
- Leviathan et al., arXiv 2211.17192 (expected tokens per speculative round).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Callable

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "CANDIDATE_GAMMAS",
    "DEFAULT_ALPHA",
    "EXPERT_LOADS",
    "MLX_SORT_THRESHOLD",
    "WEIGHT_FORMATS",
    "TimeModel",
    "activated_experts",
    "activated_fraction",
    "best_gamma",
    "bytes_per_param",
    "compute_transition",
    "kept_on_rollback",
    "rollback_probability",
    "correlated_activated_experts",
    "correlated_threshold",
    "correlated_tokens",
    "expert_loads",
    "expected_tokens_per_round",
    "kv_time",
    "mean_accepted_length",
    "normalised_acceptance",
    "ridge_in_tokens",
    "saturation_threshold",
    "sparsity",
    "speedup",
    "summarise",
    "target_efficiency",
    "tokens_per_expert",
]

# Slack for ceil() of a ratio of logarithms that is an integer up to rounding.
_CEIL_SLACK = 1e-9

# The acceptance assumed wherever none was measured (predictions, an MTP head's imposed runs, a
# pair's ETA before its acceptance pass), and the draft lengths a recommendation is chosen from.
DEFAULT_ALPHA = 0.7
CANDIDATE_GAMMAS = tuple(range(1, 9))


def best_gamma(speedup_at: Callable[[int], float | None],
               gammas: tuple[int, ...] = CANDIDATE_GAMMAS) -> tuple[int, float] | None:
    """(gamma, S) of the draft length with the highest speedup ``speedup_at(gamma)`` (None where
    it has none); None when no gamma has one. Ties go to the shorter draft."""
    speeds = [(g, s) for g in gammas if (s := speedup_at(g)) is not None]
    return max(speeds, key=lambda gs: (gs[1], -gs[0])) if speeds else None


def sparsity(experts: int, top_k: int) -> float:
    """rho = K / E, the fraction of experts one token activates."""
    if experts < 1:
        raise ValueError(f"experts must be >= 1, got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, experts={experts}], got {top_k}")
    return top_k / experts


def _check_rho(rho: float) -> None:
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho must be in (0, 1], got {rho}")


def _check_tau(tau: float) -> None:
    if not 0.0 < tau < 1.0:
        raise ValueError(f"tau must be in (0, 1), got {tau}")


def activated_experts(t: ArrayLike, experts: int, top_k: int) -> np.ndarray:
    """N(t) = E * (1 - (1 - rho)^t): expected distinct experts hit by t i.i.d. uniform tokens."""
    rho = sparsity(experts, top_k)
    return experts * (1.0 - (1.0 - rho) ** np.asarray(t, dtype=float))


def activated_fraction(t: ArrayLike, rho: float) -> np.ndarray:
    """N(t) / E = 1 - (1 - rho)^t."""
    _check_rho(rho)
    return 1.0 - (1.0 - rho) ** np.asarray(t, dtype=float)


def saturation_threshold(rho: float, tau: float = 0.95) -> int:
    """T_thres = ceil(log(1 - tau) / log(1 - rho)): fewest tokens with N(t) >= tau * E."""
    _check_rho(rho)
    _check_tau(tau)
    if rho == 1.0:
        return 1
    return int(np.ceil(np.log(1.0 - tau) / np.log(1.0 - rho) - _CEIL_SLACK))


def tokens_per_expert(t: ArrayLike, rho: float) -> np.ndarray:
    """Average tokens each activated expert processes: rho*t / (1 - (1 - rho)^t)."""
    t = np.asarray(t, dtype=float)
    return rho * t / activated_fraction(t, rho)


def correlated_activated_experts(
    t: ArrayLike, experts: int, top_k: int, correlation: float
) -> np.ndarray:
    """N_c(t) = N(1 + c*(t - 1)): t consecutive tokens of one sequence act like 1 + c*(t-1) uniform ones.

    Anchored at one token, which always activates exactly K experts; c = 1 is uniform routing,
    c < 1 models consecutive tokens reusing experts (Cohere: 128 experts top-8, 20.36 unique in a
    4-token window against 29.1 uniform, c ~ 0.56). Applies per sequence, not across a batch.
    """
    _check_correlation(correlation)
    return activated_experts(correlated_tokens(t, correlation), experts, top_k)


def correlated_tokens(t: ArrayLike, correlation: float) -> np.ndarray:
    """1 + c*(t - 1): the uniform-token equivalent of t correlated tokens (anchored at t = 1)."""
    return 1.0 + correlation * (np.asarray(t, dtype=float) - 1.0)


def correlated_threshold(rho: float, correlation: float, tau: float = 0.95) -> int:
    """Within-sequence threshold: fewest consecutive tokens t of one sequence with N_c(t) >= tau*E.

    1 + c*(t - 1) >= log(1 - tau) / log(1 - rho); not MoESD's batch threshold T_thres, which counts
    independent tokens.
    """
    _check_rho(rho)
    _check_tau(tau)
    _check_correlation(correlation)
    if rho == 1.0:
        return 1
    uniform = np.log(1.0 - tau) / np.log(1.0 - rho)
    return max(1, int(np.ceil(1.0 + (uniform - 1.0) / correlation - _CEIL_SLACK)))


def _check_correlation(correlation: float) -> None:
    if not 0.0 < correlation <= 1.0:
        raise ValueError(f"correlation must be in (0, 1], got {correlation}")


def expected_tokens_per_round(alpha: ArrayLike, gamma: ArrayLike) -> np.ndarray:
    """Omega = (1 - alpha^(gamma+1)) / (1 - alpha): tokens produced per draft-verify round."""
    alpha = np.asarray(alpha, dtype=float)
    gamma = np.asarray(gamma, dtype=float)
    if np.any((alpha < 0) | (alpha > 1)):
        raise ValueError("alpha must be in [0, 1]")
    if np.any(gamma < 0):
        raise ValueError("gamma must be >= 0")
    with np.errstate(divide="ignore", invalid="ignore"):
        omega = (1.0 - alpha ** (gamma + 1.0)) / (1.0 - alpha)
    # alpha -> 1: every draft token is accepted, plus the bonus token.
    return np.where(alpha == 1.0, gamma + 1.0, omega)


def mean_accepted_length(alpha: ArrayLike, gamma: ArrayLike) -> np.ndarray:
    """L = alpha*(1 - alpha^gamma)/(1 - alpha): draft tokens accepted per round (Omega less the bonus)."""
    return expected_tokens_per_round(alpha, gamma) - 1.0


def rollback_probability(alpha: ArrayLike, gamma: ArrayLike, batch: ArrayLike = 1) -> np.ndarray:
    """The chance that an SD round must roll its caches back: some sequence of the batch rejects
    one of its gamma drafts, each accepted with probability alpha: 1 - alpha^(gamma*B)."""
    alpha, gamma, batch = (np.asarray(x, dtype=float) for x in (alpha, gamma, batch))
    return 1.0 - alpha ** (gamma * batch)


def kept_on_rollback(alpha: ArrayLike, gamma: int, batch: ArrayLike = 1) -> np.ndarray:
    """Tokens a rolled-back round keeps (and a re-forward feeds again): the batch's shortest
    accepted prefix, which the loops share, plus the token after it, given that some draft was
    rejected. The shortest prefix m of B sequences has P(m >= j) = alpha^(jB), so
    E[m] = sum_{j=1..gamma} alpha^(jB), and E[m | m < gamma] = (E[m] - gamma alpha^(gamma B)) / p
    with p the ``rollback_probability``; 1 where a round never rolls back."""
    alpha, batch = (np.asarray(x, dtype=float) for x in (alpha, batch))
    gamma = int(gamma)
    mean_min = sum(alpha ** (j * batch) for j in range(1, gamma + 1))
    p = rollback_probability(alpha, gamma, batch)
    with np.errstate(divide="ignore", invalid="ignore"):
        kept = 1.0 + (mean_min - gamma * alpha ** (gamma * batch)) / p
    return np.where(p > 0, kept, 1.0)


def normalised_acceptance(alpha: ArrayLike, gamma: ArrayLike) -> np.ndarray:
    """sigma = Omega / (gamma + 1), in (0, 1]."""
    return expected_tokens_per_round(alpha, gamma) / (np.asarray(gamma, dtype=float) + 1.0)


def speedup(
    sigma: ArrayLike,
    gamma: ArrayLike,
    target_plain: ArrayLike,
    target_verify: ArrayLike,
    draft_step: ArrayLike,
    reject: ArrayLike,
) -> np.ndarray:
    """S(B, gamma) = sigma*(gamma+1)*T_T(B,1) / (gamma*T_D(B,1) + T_T(B,gamma) + T_rej(B))."""
    gamma = np.asarray(gamma, dtype=float)
    numerator = np.asarray(sigma) * (gamma + 1.0) * np.asarray(target_plain)
    return numerator / (
        gamma * np.asarray(draft_step) + np.asarray(target_verify) + np.asarray(reject)
    )


def target_efficiency(target_plain: ArrayLike, target_verify: ArrayLike) -> np.ndarray:
    """T_T(B,1) / T_T(B,gamma): the system term of the speedup, free of acceptance."""
    return np.asarray(target_plain, dtype=float) / np.asarray(target_verify, dtype=float)


def compute_transition(t: ArrayLike, knee: float, s: float) -> np.ndarray:
    """G(t; knee, s): s^t up to t = knee (= lam*RP), then the tangent line of s^t at the knee.

    Models the turn from memory-bound (cost flat in t when s ~ 1) to compute-bound (linear in t).
    """
    if s < 1.0:
        raise ValueError(f"s must be >= 1, got {s}")
    t = np.asarray(t, dtype=float)
    before = s ** np.minimum(t, knee)
    after = s**knee * (1.0 + np.log(s) * (t - knee))
    return np.where(t <= knee, before, after)


def kv_time(batch: ArrayLike, context: ArrayLike, k_kv: float, k_seq: float = 0.0) -> np.ndarray:
    """MagicDec's KV-read term k_kv * B * L (the cache every step streams grows with B and L), plus
    a cost per sequence k_seq * B that does not grow with L (only timings at two contexts tell
    the two apart; at one, k_seq is held at 0 and k_kv carries both)."""
    batch = np.asarray(batch, dtype=float)
    return batch * (k_seq + k_kv * np.asarray(context, dtype=float))


# How a forward reads the experts its tokens picked (docs/design.md §2.7).
# unique: each activated expert once per forward (MoESD Algorithm 1, k2*N(n));
# pairs: one read per (token, expert) pair (k2*n*K), what an unsorted gather does;
# mlx: pairs below mlx-lm's sort threshold on indices.size = n*K, unique at and above it.
EXPERT_LOADS = ("unique", "pairs", "mlx")
MLX_SORT_THRESHOLD = 64  # mlx_lm/models/switch_layers.py: `indices.size >= 64` sorts by expert


def expert_loads(
    n: ArrayLike, experts: int, top_k: int, loads: str = "unique", sort_threshold: int = MLX_SORT_THRESHOLD,
    active: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(expert reads, tokens per read) for n tokens in one forward, under an expert-load variant.
    ``active``: the unique experts the forward activates (default N(n), uniform routing).

    A read that serves one token (an unsorted pair) has tokens per read 0 here: its one-token
    product is memory-bound at any n, so its cost is all in the per-read term k2 and the
    expert-compute term k3*G(.) must not add to it (k3*G(1) would only duplicate the bias).
    """
    if loads not in EXPERT_LOADS:
        raise ValueError(f"unknown expert-load variant {loads!r} (known: {', '.join(EXPERT_LOADS)})")
    n = np.asarray(n, dtype=float)
    active = activated_experts(n, experts, top_k) if active is None else np.asarray(active, dtype=float)
    unique_reads, unique_tokens = active, n * top_k / active
    pair_reads, pair_tokens = n * top_k, np.zeros_like(n)
    if loads == "unique":
        return unique_reads, unique_tokens
    if loads == "pairs":
        return pair_reads, pair_tokens
    sorted_ = n * top_k >= sort_threshold
    return np.where(sorted_, unique_reads, pair_reads), np.where(sorted_, unique_tokens, pair_tokens)


@dataclass(frozen=True)
class TimeModel:
    """The 10 fitted parameters of MoESD Algorithm 1 (seconds; lam and s dimensionless).

    T_T(n) = bias + k1*G(n) + k2*R(n) + k3*G(n*K/R(n)),  G = G(.; lam*ridge_tokens, s)
    T_D(B) = draft_bias + draft_k*G(B)
    T_rej(B) = reject_bias + reject_k*B
    R(n) is the expert reads of the variant (``expert_loads``): N(n) in MoESD, or the unique
    experts the routing actually activates. The knee of G is
    in tokens per forward: lam * ridge_in_tokens(RP, format); Algorithm 1 writes lam*RP because
    the paper ran 2-byte weights, for which the two agree.
    """

    bias: float
    k1: float
    k2: float
    k3: float
    lam: float
    s: float
    draft_bias: float
    draft_k: float
    reject_bias: float
    reject_k: float

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_vector(cls, values: ArrayLike) -> TimeModel:
        return cls(*(float(v) for v in np.asarray(values, dtype=float)))

    def to_vector(self) -> np.ndarray:
        return np.array([getattr(self, n) for n in self.names()], dtype=float)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def knee(self, ridge_tokens: float) -> float:
        """Tokens per forward where G turns from exponential to linear."""
        return self.lam * ridge_tokens

    def target_time(
        self,
        n: ArrayLike,
        experts: int,
        top_k: int,
        ridge_tokens: float,
        loads: str = "unique",
        sort_threshold: int = MLX_SORT_THRESHOLD,
        active: ArrayLike | None = None,
    ) -> np.ndarray:
        """T_T for n tokens in one forward (n = B plain, n = B*(gamma+1) or B*gamma verify);
        ``active``: the unique experts they activate (default N(n), uniform routing)."""
        n = np.asarray(n, dtype=float)
        knee = self.knee(ridge_tokens)
        reads, per_read = expert_loads(n, experts, top_k, loads, sort_threshold, active)
        batched = compute_transition(np.maximum(per_read, 1.0), knee, self.s)
        expert_compute = np.where(per_read > 0, batched, 0.0)
        return (
            self.bias
            + self.k1 * compute_transition(n, knee, self.s)
            + self.k2 * reads
            + self.k3 * expert_compute
        )

    def draft_time(self, batch: ArrayLike, ridge_tokens: float) -> np.ndarray:
        """T_D(B, 1): one drafter step for B sequences."""
        return self.draft_bias + self.draft_k * compute_transition(batch, self.knee(ridge_tokens), self.s)

    def reject_time(self, batch: ArrayLike) -> np.ndarray:
        """T_rej(B): rejection sampling for B sequences."""
        return self.reject_bias + self.reject_k * np.asarray(batch, dtype=float)


# Bytes per parameter for each weight format. Quantized formats as mlx-lm stores them: b-bit
# weights plus one float16 scale and one float16 bias per group of 64 weights.
WEIGHT_FORMATS: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "8bit": (8 + 2 * 16 / 64) / 8,  # 1.0625
    "4bit": (4 + 2 * 16 / 64) / 8,  # 0.5625
}


def bytes_per_param(weight_format: str) -> float:
    """Bytes per parameter of a format of WEIGHT_FORMATS, or of any "<b>bit" checkpoint (3-, 5-,
    6-bit models are published too), stored as mlx-lm stores them with groups of 64."""
    if weight_format in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[weight_format]
    bits = weight_format[:-3] if weight_format.endswith("bit") else ""
    if bits.isdigit() and 1 <= int(bits) <= 8:
        return (int(bits) + 2 * 16 / 64) / 8
    known = ", ".join(WEIGHT_FORMATS)
    raise ValueError(f"unknown weight format {weight_format!r} (known: {known}, or <b>bit)")


def ridge_in_tokens(ridge_flop_per_byte: float, weight_format: str) -> float:
    """Tokens per forward at which a weight-streaming matmul turns compute-bound.

    One token costs 2 FLOP per weight and reads b bytes per weight once per forward, so the
    arithmetic intensity of t tokens is 2t/b FLOP/byte; it meets the ridge RP at t = RP*b/2.
    """
    if ridge_flop_per_byte <= 0:
        raise ValueError(f"ridge must be > 0, got {ridge_flop_per_byte}")
    return ridge_flop_per_byte * bytes_per_param(weight_format) / 2.0


def summarise(
    experts: int,
    top_k: int,
    tau: float = 0.95,
    max_tokens: int | None = None,
    correlation: float | None = None,
    gammas: tuple[int, ...] = (1, 2, 4, 8),
    alphas: tuple[float, ...] = (0.8,),
) -> dict:
    """Threshold, N(t) for t = 1..max_tokens, tokens per expert and acceptance, as one document.

    ``max_tokens`` defaults to the first power of two at or past the (corrected) threshold.
    """
    rho = sparsity(experts, top_k)
    threshold = saturation_threshold(rho, tau)
    corrected = None if correlation is None else correlated_threshold(rho, correlation, tau)
    if max_tokens is None:
        reach = max(threshold, corrected or 0)
        max_tokens = 1 << (reach - 1).bit_length()
    ts = list(range(1, max_tokens + 1))
    uniform = activated_experts(ts, experts, top_k)
    activated = [
        {"t": t, "uniform": float(n), "fraction": float(n / experts)} for t, n in zip(ts, uniform)
    ]
    if correlation is not None:
        correlated = correlated_activated_experts(ts, experts, top_k, correlation)
        for row, n in zip(activated, correlated):
            row["correlated"] = float(n)
    per_expert = tokens_per_expert(ts, rho)
    acceptance = [
        {
            "alpha": a,
            "gamma": g,
            "omega": float(expected_tokens_per_round(a, g)),
            "sigma": float(normalised_acceptance(a, g)),
        }
        for a in alphas
        for g in gammas
    ]
    return {
        "experts": experts,
        "top_k": top_k,
        "rho": rho,
        "tau": tau,
        "threshold_tokens": threshold,
        "correlation": correlation,
        "threshold_corrected": corrected,
        "activated": activated,
        "tokens_per_expert": [{"t": t, "tokens": float(v)} for t, v in zip(ts, per_expert)],
        "acceptance": acceptance,
    }
