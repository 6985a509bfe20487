"""Fit MoESD's Algorithm-1 time model to measured T_T(B,t), T_D(B,1), T_rej(B); predict S(B,gamma).

The 10 parameters, plus MagicDec's KV term k_kv*B*L (identifiable at one context too, since the
grid varies B at a fixed token count n = B*t), are fitted jointly with scipy's trust-region-reflective least squares on
relative residuals (every point weighs alike, as the held-out MAPE does). Bounds follow MoESD:
bias in [V_dense*bytes/BW, 5x], k2 in [V_expert*bytes/BW, 5x], draft_bias likewise from the
drafter's bytes, lam in [0.2, 1], s in [1, 2], the rest >= 0. RP is the measured ridge (or the
chip's published one when no roofline was measured, said in the output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares

from mac_moesd import hardware, theory
from mac_moesd.digest import Digest, full_depth_points
from mac_moesd.errors import BadInput, MacMoesdError

__all__ = ["FitInputs", "FitResult", "fit", "inputs_from_results", "predict", "fit_document"]

DEFAULT_ALPHAS = (0.5, 0.7, 0.9)
DEFAULT_GAMMAS = tuple(range(1, 9))
DEFAULT_BATCHES = tuple(range(1, 65))
HOLDOUT_EVERY = 3  # every third target point is held out (MoESD fitted on every 11th of 228)
MIN_TARGET_TRAIN = 7  # bias, k1, k2, k3, lam, s and k_kv
MIN_SIDE_POINTS = 2  # two parameters each for the drafter and rejection sampling


@dataclass(frozen=True)
class FitInputs:
    model: str
    experts: int
    top_k: int
    ridge: float
    ridge_source: str
    bandwidth: float  # bytes/s
    bandwidth_source: str
    dense_bytes: float
    expert_bytes: float  # one expert, all MoE layers
    draft_bytes: float
    target: list[tuple[int, int, float]]  # (batch, tokens, seconds)
    draft: list[tuple[int, float]]
    reject: list[tuple[int, float]]
    context: int
    draft_model: str = ""
    extrapolated: bool = False
    verify: str = "gamma"  # verify forward has gamma tokens (MoESD) or "gamma+1"


@dataclass(frozen=True)
class FitResult:
    params: theory.TimeModel
    k_kv: float  # MagicDec's KV-read term: seconds per cached token per sequence
    bounds: dict[str, tuple[float, float]]
    train: list[dict]
    heldout: list[dict]
    heldout_mape: float | None
    worst: dict | None
    cost: float
    inputs: FitInputs = field(repr=False)


# ---- reading a results file ----


def _as_pairs(points: dict) -> list[tuple[int, int, float]]:
    out = []
    for key, m in points.items():
        batch, tokens = (int(v) for v in key.split("x"))
        out.append((batch, tokens, float(m["median_s"])))
    return sorted(out)


def inputs_from_results(data: dict, model: str | None = None, verify: str = "gamma") -> FitInputs:
    """Everything the fit needs from one results file; clear errors for what is missing."""
    views = [m for m in Digest(data).models if m.experts and (model is None or m.name == model)]
    if not views:
        which = f" of {model}" if model else ""
        raise MacMoesdError(f"no MoE sweep{which} in the results: run `mac-moesd sweep MODEL` first")
    view = views[0]
    name, full, footprint = view.name, view.full, view.footprint
    points, extrapolated = full_depth_points(view.entries)

    drafts = list(data.get("draft", {}).values())
    if not drafts or not drafts[0]["points"]:
        raise MacMoesdError("no drafter step T_D(B,1) in the results: rerun the sweep with --draft DRAFT")
    draft = drafts[0]
    vocab = full.get("vocab") or None
    rejects = [e for e in data.get("reject", {}).values() if vocab in (None, e.get("vocab"))]
    if not rejects or not rejects[0]["points"]:
        raise MacMoesdError("no rejection-sampling step T_rej(B) in the results: rerun the sweep")

    ridge, ridge_source, bandwidth, bandwidth_source = _roofline_or_spec(data)
    return FitInputs(
        model=name,
        experts=footprint["experts"],
        top_k=footprint["top_k"],
        ridge=ridge,
        ridge_source=ridge_source,
        bandwidth=bandwidth,
        bandwidth_source=bandwidth_source,
        dense_bytes=footprint["bytes_dense_streamed"],
        expert_bytes=footprint["bytes_per_expert"],
        draft_bytes=draft["footprint"]["bytes_dense_streamed"],
        target=_as_pairs(points),
        draft=[(b, s) for b, _, s in _as_pairs(draft["points"])],
        reject=[(b, s) for b, _, s in _as_pairs(rejects[0]["points"])],
        context=full["context"],
        draft_model=draft["model"],
        extrapolated=extrapolated,
        verify=verify,
    )


def _roofline_or_spec(data: dict) -> tuple[float, str, float, str]:
    roof = data.get("roofline")
    if roof:
        return (roof["ridge_flop_per_byte"], f"measured roofline ({roof['ridge_dtype']})",
                roof["bandwidth_ceiling_gbs"] * 1e9, f"measured ({roof['bandwidth_ceiling_source']})")
    meta = data.get("meta", {})
    spec = hardware.lookup_spec(meta.get("chip", ""), meta.get("gpu_cores"))
    if spec is None or spec.ridge_flop_per_byte is None:
        raise MacMoesdError(
            "no roofline in the results and no published FLOPS for this chip: "
            "run `mac-moesd roofline` first"
        )
    return (spec.ridge_flop_per_byte, f"published spec of {spec.name} (no roofline measured)",
            spec.bandwidth_bytes_s, f"published spec of {spec.name} (no roofline measured)")


# ---- the fit ----


def bounds_for(inputs: FitInputs) -> dict[str, tuple[float, float]]:
    inf = math.inf
    bias = inputs.dense_bytes / inputs.bandwidth
    k2 = inputs.expert_bytes / inputs.bandwidth
    draft = inputs.draft_bytes / inputs.bandwidth
    return {
        "bias": (bias, 5 * bias), "k1": (0.0, inf), "k2": (k2, 5 * k2), "k3": (0.0, inf),
        "lam": (0.2, 1.0), "s": (1.0, 2.0), "draft_bias": (draft, 5 * draft), "draft_k": (0.0, inf),
        "reject_bias": (0.0, inf), "reject_k": (0.0, inf),
    }


def split(points: list, every: int = HOLDOUT_EVERY) -> tuple[list, list]:
    """Every ``every``-th point (from the second) is held out; the rest train."""
    held = [p for i, p in enumerate(points) if i % every == 1]
    train = [p for i, p in enumerate(points) if i % every != 1]
    return train, held


def _check_enough(inputs: FitInputs, train: list) -> None:
    short = []
    if len(train) < MIN_TARGET_TRAIN:
        need = next(n for n in range(1, 1000) if len(split(list(range(n)))[0]) >= MIN_TARGET_TRAIN)
        short.append(f"{need - len(inputs.target)} more T_T(B,t) points (have {len(inputs.target)}, "
                     f"need {need} with every {HOLDOUT_EVERY}rd held out)")
    if len({b for b, _ in inputs.draft}) < MIN_SIDE_POINTS:
        short.append(f"T_D at {MIN_SIDE_POINTS - len(inputs.draft)} more batch sizes")
    if len({b for b, _ in inputs.reject}) < MIN_SIDE_POINTS:
        short.append(f"T_rej at {MIN_SIDE_POINTS - len(inputs.reject)} more batch sizes")
    if short:
        raise BadInput("too few points to fit the 11 parameters: need " + "; ".join(short))


def _initial(bounds: dict[str, tuple[float, float]], inputs: FitInputs) -> np.ndarray:
    t1 = min(s for b, t, s in inputs.target if b * t == min(bb * tt for bb, tt, _ in inputs.target))
    guess = {
        "bias": bounds["bias"][0] * 1.5, "k1": t1 * 0.1, "k2": bounds["k2"][0] * 1.5, "k3": t1 * 0.1,
        "lam": 0.5, "s": 1.05, "draft_bias": bounds["draft_bias"][0] * 1.5,
        "draft_k": min(s for _, s in inputs.draft) * 0.1, "reject_bias": min(s for _, s in inputs.reject) * 0.5,
        "reject_k": min(s for _, s in inputs.reject) * 0.1,
    }
    lo = np.array([bounds[n][0] for n in theory.TimeModel.names()])
    hi = np.array([bounds[n][1] for n in theory.TimeModel.names()])
    x0 = np.array([guess[n] for n in theory.TimeModel.names()])
    return np.clip(x0, lo, np.where(np.isfinite(hi), hi, np.inf))


def fit(inputs: FitInputs) -> FitResult:
    train, held = split(inputs.target)
    _check_enough(inputs, train)
    bounds = bounds_for(inputs)
    names = theory.TimeModel.names()
    lo = np.array([bounds[n][0] for n in names])
    hi = np.array([bounds[n][1] for n in names])
    if np.any(lo > hi):
        raise MacMoesdError("inconsistent bounds: check the bandwidth and byte counts")
    E, K, RP = inputs.experts, inputs.top_k, inputs.ridge
    tb = np.array([b for b, _, _ in train], dtype=float)
    tn = np.array([b * t for b, t, _ in train], dtype=float)
    L = inputs.context
    ty = np.array([s for _, _, s in train])
    db = np.array([b for b, _ in inputs.draft], dtype=float)
    dy = np.array([s for _, s in inputs.draft])
    rb = np.array([b for b, _ in inputs.reject], dtype=float)
    ry = np.array([s for _, s in inputs.reject])

    def residuals(x):
        m = theory.TimeModel.from_vector(x[:-1])
        return np.concatenate([
            (m.target_time(tn, E, K, RP) + theory.kv_time(tb, L, x[-1])) / ty - 1,
            m.draft_time(db, RP) / dy - 1,
            m.reject_time(rb) / ry - 1,
        ])

    x0 = np.append(_initial(bounds, inputs), 0.0)
    lo, hi = np.append(lo, 0.0), np.append(hi, np.inf)
    # Multi-start over the two shape parameters: G's knee makes the cost non-convex.
    best = None
    for lam in (0.3, 0.6, 0.95):
        for s in (1.01, 1.2, 1.6):
            start = x0.copy()
            start[names.index("lam")], start[names.index("s")] = lam, s
            res = least_squares(residuals, start, bounds=(lo, hi), method="trf", x_scale="jac")
            if best is None or res.cost < best.cost:
                best = res
    model = theory.TimeModel.from_vector(best.x[:-1])
    k_kv = float(best.x[-1])

    def rows(points):
        out = []
        for b, t, s in points:
            pred = float(model.target_time(b * t, E, K, RP) + theory.kv_time(b, L, k_kv))
            out.append({"batch": b, "tokens": t, "measured_s": s, "predicted_s": pred,
                        "error": pred / s - 1})
        return out

    train_rows, held_rows = rows(train), rows(held)
    mape = float(np.mean([abs(r["error"]) for r in held_rows])) if held_rows else None
    worst = max(held_rows, key=lambda r: abs(r["error"])) if held_rows else None
    return FitResult(model, k_kv, bounds, train_rows, held_rows, mape, worst, float(best.cost), inputs)


# ---- predictions ----


def verify_tokens(gamma: int, verify: str) -> int:
    return gamma + 1 if verify == "gamma+1" else gamma


def predict(
    model: theory.TimeModel,
    experts: int,
    top_k: int,
    ridge: float,
    batches=DEFAULT_BATCHES,
    gammas=DEFAULT_GAMMAS,
    alphas=DEFAULT_ALPHAS,
    verify: str = "gamma",
    kv: tuple[float, int] = (0.0, 0),
) -> list[dict]:
    """S(B, gamma) and target efficiency for every batch, draft length and acceptance rate.

    ``kv`` is (k_kv, context): the KV-read term added to every target forward.
    """
    b = np.asarray(batches, dtype=float)
    kv_term = theory.kv_time(b, kv[1], kv[0])
    plain = model.target_time(b, experts, top_k, ridge) + kv_term
    draft = model.draft_time(b, ridge)
    reject = model.reject_time(b)
    rows = []
    for gamma in gammas:
        verify_t = model.target_time(b * verify_tokens(gamma, verify), experts, top_k, ridge) + kv_term
        efficiency = theory.target_efficiency(plain, verify_t)
        for alpha in alphas:
            sigma = theory.normalised_acceptance(alpha, gamma)
            s = theory.speedup(sigma, gamma, plain, verify_t, draft, reject)
            rows += [{"batch": int(bb), "gamma": gamma, "alpha": alpha, "speedup": float(v),
                      "target_efficiency": float(e)} for bb, v, e in zip(batches, s, efficiency)]
    return rows


def peaks(predictions: list[dict]) -> list[dict]:
    """For each (gamma, alpha): the batch of peak speedup and the batches within peak/sqrt(2)."""
    out = []
    keys = sorted({(p["gamma"], p["alpha"]) for p in predictions})
    for gamma, alpha in keys:
        rows = [p for p in predictions if p["gamma"] == gamma and p["alpha"] == alpha]
        top = max(rows, key=lambda p: p["speedup"])
        window = [p["batch"] for p in rows if p["speedup"] >= top["speedup"] / math.sqrt(2)]
        out.append({"gamma": gamma, "alpha": alpha, "peak_batch": top["batch"],
                    "peak_speedup": top["speedup"], "window": [min(window), max(window)]})
    return out


def sparsity_sweep(model, experts, top_k, ridge, gamma=4, alpha=0.7, batches=DEFAULT_BATCHES,
                   verify="gamma", kv=(0.0, 0)) -> list[dict]:
    """The same fitted model with K changed (as MoESD edits num_experts_per_tok).

    Acceptance is held at ``alpha`` for every K, which is what MoESD's rescaling of raw speedups
    by sigma_K0 / sigma_K achieves for measured runs.
    """
    ks = sorted({k for k in (1, 2, top_k // 2, top_k, 2 * top_k, 4 * top_k) if 1 <= k <= experts})
    out = []
    for k in ks:
        rows = predict(model, experts, k, ridge, batches, (gamma,), (alpha,), verify, kv)
        top = max(rows, key=lambda p: p["speedup"])
        out.append({"top_k": k, "rho": k / experts, "peak_batch": top["batch"],
                    "peak_speedup": top["speedup"],
                    "speedup_batch1": rows[0]["speedup"]})
    return out


def fit_document(result: FitResult, alphas=DEFAULT_ALPHAS) -> dict:
    i = result.inputs
    kv = (result.k_kv, i.context)
    predictions = predict(result.params, i.experts, i.top_k, i.ridge, alphas=alphas, verify=i.verify, kv=kv)
    return {
        "model": i.model,
        "draft_model": i.draft_model,
        "experts": i.experts,
        "top_k": i.top_k,
        "context": i.context,
        "ridge_flop_per_byte": i.ridge,
        "ridge_source": i.ridge_source,
        "bandwidth_bytes_s": i.bandwidth,
        "bandwidth_source": i.bandwidth_source,
        "verify_tokens": i.verify,
        "extrapolated": i.extrapolated,
        "params": result.params.to_dict(),
        "k_kv": result.k_kv,
        "bounds": {k: [lo, hi if math.isfinite(hi) else None] for k, (lo, hi) in result.bounds.items()},
        "train_points": result.train,
        "heldout_points": result.heldout,
        "heldout_mape": result.heldout_mape,
        "worst_point": result.worst,
        "predictions": predictions,
        "peaks": peaks(predictions),
        "sparsity": sparsity_sweep(result.params, i.experts, i.top_k, i.ridge, verify=i.verify, kv=kv),
    }


def speedup_predictor(fit_doc: dict, verify: str = "gamma+1"):
    """A function (batch, gamma, alpha, self_draft) -> predicted S from a stored fit document.

    ``verify`` defaults to gamma+1 tokens, what the measured SD loops feed the target. With a
    self-draft the drafter's step is the target's own one-token forward.
    """
    model = theory.TimeModel(**fit_doc["params"])
    E, K, RP = fit_doc["experts"], fit_doc["top_k"], fit_doc["ridge_flop_per_byte"]
    kv = theory.kv_time(1, fit_doc["context"], fit_doc.get("k_kv", 0.0))

    def predict_one(batch: int, gamma: int, alpha: float, self_draft: bool) -> float:
        plain = model.target_time(batch, E, K, RP) + batch * kv
        verify_t = model.target_time(batch * verify_tokens(gamma, verify), E, K, RP) + batch * kv
        draft = plain if self_draft else model.draft_time(batch, RP)
        sigma = theory.normalised_acceptance(alpha, gamma)
        return float(theory.speedup(sigma, gamma, plain, verify_t, draft, model.reject_time(batch)))

    return predict_one
