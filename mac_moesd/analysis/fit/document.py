"""The fit as stored in the results file, and the readers of stored fits: a speedup predictor
from a fit document, the prediction and acceptance beside a timed SD run, and the sweep's plain
step that run is compared with."""

from __future__ import annotations

import datetime as _dt
import json
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from mac_moesd.analysis import cluster
from mac_moesd.analysis.depth import full_depth_points
from mac_moesd.analysis.digest import Digest
from mac_moesd.analysis.fit.inputs import DEFAULT_VERIFY, FitInputs
from mac_moesd.analysis.fit.model import (DEFAULT_ALPHAS, FitResult, FittedModel, VariantFit, paper_comparison,
                                          peaks, predict, sparsity_sweep, verify_tokens)
from mac_moesd.analysis.fit.solve import regime
from mac_moesd.results.keys import DRAFTER_KINDS
from mac_moesd.analysis.spec_runs import decoding_context, feeds_last_draft, run_alpha
from mac_moesd.results import point_key

__all__ = ["FitPredictor", "RunPrediction", "cluster_section", "decoding_context", "fit_document", "kv_section",
           "lookup_predictor", "model_prediction", "predictor_for", "run_alpha", "run_context", "speedup_predictor",
           "store_fit", "sweep_plain_step"]


def fit_document(result: FitResult, alphas=DEFAULT_ALPHAS) -> dict:
    i = result.inputs
    best = result.best
    chosen = result.model()
    predictions = predict(chosen, i.context, alphas=alphas, verify=i.verify)
    sorted_from = (math.ceil(i.sort_threshold / i.top_k) if i.sort_threshold > 0 else 1)
    return {
        "model": i.model,
        # Names this fit: a spec run stores it beside the prediction the fit made (``RunPrediction``).
        "fitted_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds"),
        "draft_model": i.draft_model,
        "drafted": i.drafted,
        "reforward": list(i.reforward),
        "experts": i.experts,
        "top_k": i.top_k,
        "context": i.context,
        "weight_format": i.weight_format,
        "ridge_flop_per_byte": i.ridge,
        "ridge_source": i.ridge_source,
        "ridge_tokens": i.ridge_tokens,
        "knee_tokens": best.params.knee(i.ridge_tokens),
        "bandwidth_bytes_s": i.bandwidth,
        "bandwidth_source": i.bandwidth_source,
        "verify_tokens": i.verify,
        "extrapolated": i.extrapolated,
        "sort_threshold": i.sort_threshold,
        "sort_threshold_source": i.sort_threshold_source,
        "sorted_from_tokens": sorted_from,
        "chosen": result.chosen,
        "regime": regime(result),
        "variants": [{"name": v.name, "heldout_mape": v.heldout_mape, "params": _params_doc(v, i.drafted),
                      "k_kv": v.k_kv, "k_seq": v.k_seq, "k_rec": v.k_rec, "knee_tokens": v.params.knee(i.ridge_tokens),
                      "worst_point": v.worst}
                     for v in result.variants],
        "missing": list(i.missing),
        "pipelining": result.pipelining,
        "bookkeeping": result.bookkeeping,
        "draft_start": result.draft_start,
        "routing": i.routing.to_dict(),
        "one_row": chosen.one_row,
        "params": _params_doc(best, i.drafted),
        "k_kv": best.k_kv,
        "k_seq": best.k_seq,
        "k_rec": best.k_rec,
        "linear_layers": i.linear_layers,
        "kv": kv_section(result),
        "bounds": {k: [lo, hi if math.isfinite(hi) else None] for k, (lo, hi) in best.bounds.items()},
        "train_points": best.train,
        "heldout_points": best.heldout,
        "heldout_mape": best.heldout_mape,
        "worst_point": best.worst,
        "predictions": predictions,
        "peaks": peaks(predictions),
        "sparsity": sparsity_sweep(chosen, i.context, verify=i.verify),
        "paper_comparison": paper_comparison(result, alphas),
        "communication": i.comm.to_dict() if i.comm is not None else None,
        "cluster": cluster_section(chosen, i),
    }


def _params_doc(v: VariantFit, drafted: bool) -> dict[str, float | None]:
    side = ("draft_bias", "draft_k", "reject_bias", "reject_k")
    return {k: (None if (not drafted and k in side) else val) for k, val in v.params.to_dict().items()}


def kv_section(result: FitResult) -> dict:
    """How the KV term was identified: the two contexts, and the chosen fit at the second one."""
    i, best = result.inputs, result.best
    return {"context": i.context, "second_context": i.kv_points[0][2] if i.kv_points else None,
            "separated": bool(i.kv_points), "k_kv": best.k_kv, "k_seq": best.k_seq,
            "mape": float(np.mean([abs(r["error"]) for r in best.kv_rows])) if best.kv_rows else None,
            "points": best.kv_rows}


def cluster_section(model: FittedModel, inputs: FitInputs) -> dict | None:
    """Predicted SD on the cluster the sweep ran on, with and without its communication."""
    if inputs.comm is None or inputs.cluster is None:
        return None
    L, verify = inputs.context, inputs.verify

    def target(batch, tokens):
        return model.target(batch, tokens, L, pipelined=True)

    def speedup(batch, gamma, alpha, with_comm):
        if not model.drafted:
            return None
        return float(model.speedup(batch, gamma, alpha, L, verify, comm=with_comm)[()])

    return {**inputs.cluster, "verify_tokens": verify,
            "rows": cluster.cluster_rows(target, inputs.comm, speedup, lambda g: verify_tokens(g, verify))}


# ---- readers of a stored fit ----


def store_fit(data: dict, name: str, document: dict) -> dict:
    """Put ``document`` into the results' ``fits`` under ``name`` and return what is stored there:
    the stored fit itself where the new one is the same fit (equal in every field but when it was
    made and the stage's thermal record, as a resumed run refits), so that the SD runs it priced
    still name it."""
    fits = data.setdefault("fits", {})
    previous = fits.get(name)
    if previous is not None and _without_date(previous) == _without_date(document):
        return previous
    fits[name] = document
    return document


_NOT_THE_FIT = ("fitted_at", "thermal_pressure")  # when it was fitted, and the machine around the stage


def _without_date(document: dict) -> str:
    # Compared as JSON: a stored fit has lists where a fresh one may hold tuples.
    return json.dumps({k: v for k, v in document.items() if k not in _NOT_THE_FIT}, sort_keys=True)


def run_context(run: dict, doc: dict) -> float:
    """``decoding_context`` of one row of a stored spec document."""
    return decoding_context(run["context"] if "context" in run else doc["context"], doc.get("new_tokens", 0))


SAME_PREDICTION = 0.005  # two predictions closer than this print alike (two decimals): one is shown


@dataclass(frozen=True)
class RunPrediction:
    """A timed SD run's prediction by the fitted model: ``stored``, as the SD stage computed it
    with the fit of ``stored_fit`` (its ``fitted_at``; None for runs and fits made before fits
    were named), and ``now``, by the results' current fit where that is another fit and
    predicts otherwise (else None). Readers print ``stored``, and ``now`` beside it, saying so."""

    stored: float | None
    stored_fit: str | None = None
    now: float | None = None
    now_fit: str | None = None

    @property
    def shown(self) -> float | None:
        """The one figure a plot can show: the stored prediction, else the current fit's."""
        return self.stored if self.stored is not None else self.now

    @property
    def newer(self) -> bool:
        """Whether a newer fit than the stored prediction's predicts this run otherwise."""
        return self.now is not None


def model_prediction(fit_doc: dict | None, run: dict, doc: dict) -> RunPrediction:
    """``run``'s fitted-model prediction as stored with it, and by ``fit_doc`` (the results'
    fit of its target; None: none) where that fit is not the one the stored value came from and
    the two differ at two decimals (or nothing was stored)."""
    by = run.get("predicted_by") or {}  # older runs have theirs from results.schema.upgrade
    stored, stored_fit = by.get("model"), by.get("fit")
    if fit_doc is None or (stored_fit is not None and fit_doc.get("fitted_at") == stored_fit):
        return RunPrediction(stored, stored_fit)
    now = _recomputed(predictor_for(fit_doc, run.get("drafter_kind", "model")), run, doc)
    if now is None or (stored is not None and abs(now - stored) < SAME_PREDICTION):
        return RunPrediction(stored, stored_fit)
    return RunPrediction(stored, stored_fit, now, fit_doc.get("fitted_at"))


def _recomputed(predictor, run: dict, doc: dict) -> float | None:
    """A timed SD run's speedup as ``predictor`` (``speedup_predictor``) gives it at the run's
    realised alpha and context; None without a predictor or alpha, and for prompt lookup and an
    MTP head, whose predictions need what the SD stage timed (the verify widths, the head's step)."""
    alpha = run_alpha(run)
    # A prompt-lookup run's prediction needs its verify widths, an MTP head's its timed step: as stored.
    if predictor is None or alpha is None or run.get("drafter_kind") in DRAFTER_KINDS:
        return None
    return predictor(run["batch"], run["gamma"], alpha, run["mode"] == "self-draft", run_context(run, doc),
                     catch_up=feeds_last_draft(run))


def sweep_plain_step(data: dict, model: str, context: int | None = None):
    """A function batch -> the sweep's pipelined T_T(B,1) of ``model`` at full depth (seconds),
    or None where the sweep did not time it; None when the results hold no sweep of ``model``
    (at ``context`` when named)."""
    views = [m for m in Digest(data).models if m.name == model and context in (None, m.full["context"])]
    if not views:
        return None
    points, _ = full_depth_points(views[0].entries, "pipelined_points")

    def step(batch: int) -> float | None:
        point = points.get(point_key(batch, 1))
        return float(point["median_s"]) if point else None

    return step


def speedup_predictor(fit_doc: dict, verify: str = DEFAULT_VERIFY, drafter: bool = True):
    """A function (batch, gamma, alpha, self_draft, context, draft_step=None) -> predicted S from a
    stored fit document's chosen variant, or None when the fit had no drafter to predict speedups
    with. ``drafter=False``: for a drafter timed elsewhere (an MTP head), whose ``draft_step``
    (and, where the fit has none, ``reject``) the caller passes, so the fit needs none.

    The KV term is taken at the context passed in (the SD run's own), not the fit's.
    """
    if (drafter and not fit_doc.get("drafted")) or "chosen" not in fit_doc:
        return None
    model = FittedModel.from_document(fit_doc)

    def predict_one(batch: int, gamma: int, alpha: float, self_draft: bool, context: int,
                    draft_step: float | None = None, reject: float | None = None,
                    catch_up: bool | None = None) -> float:
        return float(model.speedup(batch, gamma, alpha, context, verify, self_draft, draft_step=draft_step,
                                   reject=reject, catch_up=catch_up)[()])

    return FitPredictor(predict_one, fit_doc.get("fitted_at"))


def predictor_for(fit_doc: dict, drafter_kind: str):
    """The SD stage's predictor for a drafter of that kind: ``lookup_predictor`` for prompt lookup,
    else ``speedup_predictor`` (needing a fitted drafter only for a drafter model or self-draft;
    an MTP head's step is the SD stage's own timing); None where the fit cannot predict."""
    if drafter_kind == "prompt-lookup":
        return lookup_predictor(fit_doc)
    return speedup_predictor(fit_doc, drafter=drafter_kind != "mtp-head")


def lookup_predictor(fit_doc: dict):
    """A function (batch, widths, tokens_per_round, lookup_s, rolled_back_share, context) ->
    predicted S of prompt-lookup rounds (``FittedModel.lookup_speedup``) from a stored fit's
    chosen variant, which needs no drafter; None for a fit made before the expert-load variants."""
    if "chosen" not in fit_doc:
        return None
    return FitPredictor(FittedModel.from_document(fit_doc).lookup_speedup, fit_doc.get("fitted_at"))


@dataclass(frozen=True)
class FitPredictor:
    """A stored fit's prediction as a function, and the fit it came from (its ``fitted_at``,
    None for a fit made before fits were named), which the SD stage stores beside what it priced."""

    predict: Callable[..., float]
    fitted_at: str | None

    def __call__(self, *args, **kwargs) -> float:
        return self.predict(*args, **kwargs)
