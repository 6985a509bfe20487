"""Least squares of Algorithm 1 to the measured points: bounds from the bytes each term reads,
one fit per expert-load variant scored on held-out points, the variant chosen by that error,
and the graph-building time pipelining hides."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from mac_moesd.analysis import pipelining, round_terms, theory
from mac_moesd.analysis.fit.inputs import FitInputs
from mac_moesd.analysis.fit.model import FitResult, FittedModel, VariantFit
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.results import schema

__all__ = ["BANDWIDTH_SLACK", "REGIMES", "bounds_for", "draft_start", "fit", "fit_variant", "measure_pipelining", "regime",
           "split"]

HOLDOUT_EVERY = 3  # every third target point is held out (MoESD fitted on every 11th of 228)
MIN_TARGET_TRAIN = 7  # bias, k1, k2, k3, lam, s and k_kv
MIN_SIDE_POINTS = 2  # two parameters each for the drafter and rejection sampling
LAM_BOUNDS = (0.2, 1.0)  # MoESD's bounds on lam, applied to the knee in tokens
# The byte bounds' lower end is half of bytes / measured bandwidth: the measured ceiling is an
# estimate (a quick roofline read 4.7 to 8.8 GB/s between runs on one 2-core Linux box), and reads
# of weights still in cache beat it; a bound at the full figure forced k2 and bias up whenever the
# ceiling read low (held-out MAPE 17-118% instead of 4-11% on the same sweep).
BANDWIDTH_SLACK = 0.5
# Variants closer than this in held-out MAPE are not told apart by the grid.
INDISTINCT_MAPE = 0.005

REGIMES = {
    "unique": "each activated expert is read once per forward (MoESD's assumption)",
    "pairs": "each (token, expert) pair is read separately, so a verify window costs about n*K "
             "expert reads and never saturates",
    "mlx": "pairs below mlx-lm's sort threshold on n*K, each unique expert once at and above it",
}


def fit(inputs: FitInputs, variants: tuple[str, ...] = theory.EXPERT_LOADS) -> FitResult:
    """Every expert-load variant; the lowest held-out MAPE is chosen (ties go to the earlier,
    MoESD's ``unique`` first)."""
    fitted = [fit_variant(inputs, name) for name in variants]
    scored = [(v.heldout_mape, v) for v in fitted if v.heldout_mape is not None]
    chosen = min(scored, key=lambda mv: mv[0])[1] if scored else fitted[0]
    result = FitResult(fitted, chosen.name, inputs, bookkeeping=round_terms.fit(list(inputs.bookkeeping)))
    result = replace(result, pipelining=measure_pipelining(result))
    return replace(result, draft_start=draft_start(result))


def draft_start(result: FitResult) -> schema.RoundTerm:
    """The drafter's start a round: the chains the sweep timed after a verify less the steps the
    fitted drafter prices for them (``FittedModel.drafter_chain``), linear in B and gamma, each
    scaled by its chain (``round_terms.fit_in_gamma``); zero without chains or a fitted drafter."""
    chains = result.inputs.draft_chains
    if not chains or not result.inputs.drafted:
        return round_terms.not_timed()
    model = result.model(timed_one_row=False)
    beyond = [(b, g, s - float(model.drafter_chain(b, g))) for b, g, s in chains]
    return round_terms.fit_in_gamma(beyond, scale=[s for _, _, s in chains])


def regime(result: FitResult) -> str:
    """One sentence: which expert-load regime the held-out error says this chip follows."""
    ordered = sorted(((v.heldout_mape, v) for v in result.variants if v.heldout_mape is not None),
                     key=lambda mv: mv[0])
    if not ordered:
        return f"no held-out points: `{result.chosen}` kept by default"
    best_mape, best = ordered[0]
    text = f"On {result.inputs.platform}, `{best.name}` fits best on held-out points: {REGIMES[best.name]}"
    if len(ordered) > 1 and ordered[1][0] - best_mape < INDISTINCT_MAPE:
        text += (f"; `{ordered[1][1].name}` is within {INDISTINCT_MAPE * 100:.1f} points of held-out MAPE, "
                 "so this grid does not tell them apart")
    return text + "."


def measure_pipelining(result: FitResult) -> schema.Pipelining:
    """The seconds per forward pipelining hides, from the points timed both ways, and how well
    the fitted T_T less that figure matches the pipelined points."""
    i = result.inputs
    # From the one-token points: their chains are as long as decoding's (``Budget.decode_chain``)
    # and their forwards the shortest, so the figure's noise the smallest; a grid without t = 1
    # takes every point.
    pipelined = {(b, t): s for b, t, s in i.target_pipelined}
    decode = {k: s for k, s in pipelined.items() if k[1] == 1}
    target_s, target_n = pipelining.hidden_seconds({(b, t): s for b, t, s in i.target}, decode or pipelined)
    draft_s, draft_n = pipelining.hidden_seconds(dict(i.draft), dict(i.draft_pipelined))
    found: schema.Pipelining = {"target_s": target_s, "draft_s": draft_s, "target_points": target_n,
                                "draft_points": draft_n, "target_mape": None, "weighted": True}
    if not target_n:
        return found
    model = replace(result.model(timed_one_row=False), pipelining=found)
    errors = [float(model.target(b, t, i.context, pipelined=True)) / s - 1 for b, t, s in i.target_pipelined]
    return {**found, "target_mape": float(np.mean(np.abs(errors)))}


def bounds_for(inputs: FitInputs, loads: str = "unique") -> dict[str, tuple[float, float]]:
    inf = math.inf

    def from_bytes(nbytes: float | None) -> tuple[float, float]:
        if inputs.bandwidth is None or nbytes is None:
            return (0.0, inf)
        nominal = nbytes / inputs.bandwidth
        return (nominal * BANDWIDTH_SLACK, 5 * nominal)

    # Within the grid (no ridge known) the knee may sit anywhere from one token to the largest n.
    lam = LAM_BOUNDS if inputs.ridge is not None else (1.0 / inputs.ridge_tokens, 1.0)
    return {
        "bias": from_bytes(inputs.dense_bytes), "k1": (0.0, inf), "k2": from_bytes(inputs.expert_bytes),
        "k3": (0.0, 0.0) if loads == "pairs" else (0.0, inf),
        "lam": lam, "s": (1.0, 2.0),
        # Without a drafter sweep the side terms are held at 0 (equal bounds: not fitted).
        "draft_bias": from_bytes(inputs.draft_bytes) if inputs.drafted else (0.0, 0.0),
        "draft_k": (0.0, inf) if inputs.drafted else (0.0, 0.0),
        "reject_bias": (0.0, inf) if inputs.drafted else (0.0, 0.0),
        "reject_k": (0.0, inf) if inputs.drafted else (0.0, 0.0),
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
    if inputs.drafted and len({b for b, _ in inputs.draft}) < MIN_SIDE_POINTS:
        short.append(f"T_D at {MIN_SIDE_POINTS - len(inputs.draft)} more batch sizes")
    if inputs.drafted and len({b for b, _ in inputs.reject}) < MIN_SIDE_POINTS:
        short.append(f"T_rej at {MIN_SIDE_POINTS - len(inputs.reject)} more batch sizes")
    if short:
        raise BadInput("too few points to fit the time model: need " + "; ".join(short))


def _initial(bounds: dict[str, tuple[float, float]], inputs: FitInputs) -> np.ndarray:
    t1 = min(s for b, t, s in inputs.target if b * t == min(bb * tt for bb, tt, _ in inputs.target))

    def above(name: str, fallback: float) -> float:
        low = bounds[name][0]
        return low * 1.5 if low > 0 else fallback

    guess = {
        "bias": above("bias", t1 * 0.5), "k1": t1 * 0.1, "k2": above("k2", t1 * 0.05), "k3": t1 * 0.1,
        "lam": 0.5, "s": 1.05,
        "draft_bias": above("draft_bias", min((s for _, s in inputs.draft), default=0.0) * 0.5),
        "draft_k": min((s for _, s in inputs.draft), default=0.0) * 0.1,
        "reject_bias": min((s for _, s in inputs.reject), default=0.0) * 0.5,
        "reject_k": min((s for _, s in inputs.reject), default=0.0) * 0.1,
    }
    lo = np.array([bounds[n][0] for n in theory.TimeModel.names()])
    hi = np.array([bounds[n][1] for n in theory.TimeModel.names()])
    x0 = np.array([guess[n] for n in theory.TimeModel.names()])
    return np.clip(x0, lo, hi)


def fit_variant(inputs: FitInputs, loads: str) -> VariantFit:
    """Algorithm 1 with the expert-load term of ``loads``; parameters with equal bounds are held.

    Scored on the held-out points of a fit to the others, then refitted on every point: the
    held-out error is the procedure's, the parameters use all the data. The points at the second
    context train both fits; the held-out error stays at the sweep's own context."""
    train, held = split(inputs.target)
    _check_enough(inputs, train)
    scored = _solve(inputs, loads, train)
    held_rows = _rows(inputs, loads, scored, held)
    fitted = _solve(inputs, loads, inputs.target)
    mape = float(np.mean([abs(r["error"]) for r in held_rows])) if held_rows else None
    worst = max(held_rows, key=lambda r: abs(r["error"])) if held_rows else None
    return VariantFit(loads, fitted.params, fitted.k_kv, bounds_for(inputs, loads),
                      _rows(inputs, loads, fitted, inputs.target), held_rows, mape, worst, fitted.cost,
                      fitted.k_seq, _rows(inputs, loads, fitted, inputs.kv_points), fitted.k_rec)


@dataclass(frozen=True)
class _Solved:
    params: theory.TimeModel
    k_kv: float
    k_seq: float
    cost: float
    k_rec: float = 0.0


def _target_time(inputs: FitInputs, loads: str, solved, batch, tokens, context=None, active=None):
    """The fitted T_T at the sweep's points: the routing's own unique experts (``active``, where
    already counted up), the sweep's context (or the points' own) and a sharded sweep's measured
    communication (``FittedModel.target``, synchronous)."""
    fitted = FittedModel(solved.params, solved.k_kv, inputs.experts, inputs.top_k, inputs.ridge_tokens, loads,
                         inputs.sort_threshold, inputs.drafted, comm=inputs.comm, routing=inputs.routing,
                         k_seq=solved.k_seq, k_rec=solved.k_rec, linear_layers=inputs.linear_layers)
    return fitted.target(batch, tokens, inputs.context if context is None else context, active=active)


def _rows(inputs: FitInputs, loads: str, solved, points) -> list[dict]:
    """Fitted against measured at ``points``: (batch, tokens, seconds) at the sweep's context, or
    (batch, tokens, context, seconds) at their own, which the rows then record."""
    out = []
    for *shape, s in points:
        b, t, context = (*shape, None) if len(shape) == 2 else shape
        pred = float(_target_time(inputs, loads, solved, b, t, context))
        row = {"batch": b, "tokens": t, "measured_s": s, "predicted_s": pred, "error": pred / s - 1}
        out.append(row if context is None else {**row, "context": context})
    return out


def _solve(inputs: FitInputs, loads: str, points: list) -> _Solved:
    """Least squares on relative residuals of ``points``, the points at the second context and
    the drafter and rejection steps. k_seq is free only where a second context separates it,
    k_rec only on a target with recurrent layers (a term in t alone, told from the others, which
    are functions of n = B t, by the grid's points of one n at several t)."""
    bounds = bounds_for(inputs, loads)
    names = theory.TimeModel.names()
    seq_hi = np.inf if inputs.kv_points else 0.0
    rec_hi = np.inf if inputs.linear_layers else 0.0
    lo_all = np.append([bounds[n][0] for n in names], [0.0, 0.0, 0.0])
    hi_all = np.append([bounds[n][1] for n in names], [np.inf, seq_hi, rec_hi])
    if np.any(lo_all > hi_all):
        raise MacMoesdError("inconsistent bounds: check the bandwidth and byte counts")
    free = lo_all < hi_all
    R = inputs.ridge_tokens
    rows = [(b, t, inputs.context, s) for b, t, s in points] + list(inputs.kv_points)
    tb, tt, tl, ty = (np.array(column, dtype=float) for column in zip(*rows))
    active = inputs.routing.unique(tb, tt, inputs.experts, inputs.top_k)  # fixed: counted once
    db = np.array([b for b, _ in inputs.draft], dtype=float)
    dy = np.array([s for _, s in inputs.draft])
    rb = np.array([b for b, _ in inputs.reject], dtype=float)
    ry = np.array([s for _, s in inputs.reject])

    def full_vector(x):
        out = lo_all.copy()
        out[free] = x
        return out

    def solved(v) -> _Solved:
        return _Solved(theory.TimeModel.from_vector(v[:-3]), float(v[-3]), float(v[-2]), 0.0, float(v[-1]))

    def residuals(x):
        fitted = solved(full_vector(x))
        m = fitted.params
        return np.concatenate([
            _target_time(inputs, loads, fitted, tb, tt, tl, active) / ty - 1,
            m.draft_time(db, R) / dy - 1,
            m.reject_time(rb) / ry - 1,
        ])

    x0 = np.append(_initial(bounds, inputs), [0.0, 0.0, 0.0])
    lam_i, s_i = names.index("lam"), names.index("s")
    lam_lo, lam_hi = bounds["lam"]
    # Multi-start over the two shape parameters: G's knee makes the cost non-convex.
    best = None
    for lam_frac in (0.1, 0.5, 0.95):
        for s in (1.01, 1.2, 1.6):
            start = x0.copy()
            start[lam_i], start[s_i] = lam_lo + lam_frac * (lam_hi - lam_lo), s
            res = least_squares(residuals, start[free], bounds=(lo_all[free], hi_all[free]),
                                method="trf", x_scale="jac")
            if best is None or res.cost < best.cost:
                best = res
    assert best is not None  # the loops above always run
    return replace(solved(full_vector(best.x)), cost=float(best.cost))
