"""A read-only view of a results document: what the fit, the report and the plots all need.

Full-depth points (measured, or extrapolated from an n/2n pair of layer slices), footprints
scaled to full depth, and the derived curves, computed once here rather than in each reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mac_moesd.analysis import theory
from mac_moesd.analysis.depth import full_depth_points
from mac_moesd.results import pair_spec_key, parse_point_key
from mac_moesd.results.keys import drafter_kind


def prices_drafter(fitted: dict, draft: str | None) -> bool:
    """Whether the fit ``fitted`` may price runs drafted by ``draft`` (None: any): a drafter model
    other than its target must be the one whose step it was made with, since a fit stored by a
    later run with another drafter would price these rounds with the wrong drafter."""
    return (draft is None or draft == fitted.get("model") or drafter_kind(draft) != "model"
            or fitted.get("draft_model") in (None, draft))


VERIFY_WINDOW = 4  # tokens in "the verify window" of figures and text: gamma = 3 drafts plus one


def scaled_footprint(entry: dict) -> dict:
    """The footprint at full depth: per-layer bytes and parameters scale with the layer count."""
    fp = dict(entry["footprint"])
    if entry["layers"] == entry["layers_full"]:
        return fp
    scale = entry["layers_full"] / entry["layers"]
    tied = fp["bytes_embedding"] if fp["params_head"] == 0 else 0
    outside = fp["bytes_head"] + tied  # read once per forward whatever the depth
    fp["bytes_dense_streamed"] = outside + (fp["bytes_dense_streamed"] - outside) * scale
    fp["bytes_per_expert"] *= scale
    fp["bytes_expert"] *= scale
    per_layer_params = fp["params_active"] - fp["params_head"]
    fp["params_active"] = fp["params_head"] + per_layer_params * scale
    return fp


def weight_format(entry: dict) -> str:
    """The weight format of a measured entry: "4bit", "8bit", ... or its dtype's short name."""
    bits = entry.get("bits")
    if bits:
        return f"{bits}bit"
    return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[entry["dtype"]]


@dataclass
class ModelView:
    name: str
    entries: list[dict]

    @cached_property
    def _points(self) -> tuple[dict, bool]:
        return full_depth_points(self.entries)

    @cached_property
    def points(self) -> dict[tuple[int, int], dict]:
        return {parse_point_key(k): m for k, m in self._points[0].items()}

    @property
    def extrapolated(self) -> bool:
        return self._points[1]

    @cached_property
    def pipelined(self) -> dict[tuple[int, int], dict]:
        """Seconds per forward in a pipelined chain (as mlx-lm generates), where measured."""
        points, _ = full_depth_points(self.entries, "pipelined_points")
        return {parse_point_key(k): m for k, m in points.items()}

    @property
    def full(self) -> dict:
        return max(self.entries, key=lambda e: e["layers"])

    @property
    def routing(self) -> str:
        """Experts the timed forwards ran: model (its own router), uniform, correlated:C, trace:FILE."""
        return self.full.get("routing", "model")

    @property
    def gather(self) -> str:
        """mlx-lm (as mlx-lm runs it) or sorted (mlx-lm's sorted gather at every size)."""
        return self.full.get("gather", "mlx-lm")

    @property
    def as_run(self) -> bool:
        """Measured as generation runs it: mlx-lm's gather, with the model's own routing, either
        of the sweep's random ids or replayed from a trace the model routed on real prompts (a
        pair run's sweep); forced routing (uniform, correlated) is a what-if."""
        return self.gather == "mlx-lm" and (self.routing == "model" or self.routing.startswith("trace:"))

    def unique_experts(self, batch: int, tokens: int) -> float | None:
        m = self.points.get((batch, tokens))
        return None if m is None else m.get("unique_experts")

    @cached_property
    def footprint(self) -> dict:
        return scaled_footprint(self.full)

    @property
    def experts(self) -> int | None:
        return self.footprint.get("experts")

    @property
    def top_k(self) -> int | None:
        return self.footprint.get("top_k")

    @property
    def batches(self) -> list[int]:
        return sorted({b for b, _ in self.points})

    @property
    def tokens(self) -> list[int]:
        return sorted({t for _, t in self.points})

    @property
    def weight_format(self) -> str:
        return weight_format(self.full)

    @property
    def verify_window(self) -> int:
        return VERIFY_WINDOW

    def median(self, batch: int, tokens: int) -> float | None:
        m = self.points.get((batch, tokens))
        return None if m is None else m["median_s"]

    def ratio_curve(self, batch: int) -> tuple[list[int], list[float]]:
        base = self.median(batch, 1)
        if not base:
            return [], []
        medians = {t: m for t in self.tokens if (m := self.median(batch, t)) is not None}
        return list(medians), [m / base for m in medians.values()]

    def efficiency_curve(self, tokens: int) -> tuple[list[int], list[float]]:
        """Measured T_T(B,1)/T_T(B,tokens) for every batch that has both points."""
        pairs = [(b, one, many) for b in self.batches
                 if (one := self.median(b, 1)) and (many := self.median(b, tokens))]
        return [b for b, _, _ in pairs], [one / many for _, one, many in pairs]

    def operating_point(self, tokens: int) -> tuple[float, float] | None:
        """(FLOP per byte read, achieved FLOP/s) of a batch-1 forward of ``tokens`` tokens."""
        seconds = self.median(1, tokens)
        if seconds is None:
            return None
        fp = self.footprint
        flop = 2 * fp["params_active"] * tokens
        experts, top_k = self.experts, self.top_k
        if experts:
            assert top_k is not None, "a footprint with experts names its top_k"
        experts_read = theory.activated_experts(tokens, experts, top_k) if experts and top_k else 0
        nbytes = fp["bytes_dense_streamed"] + experts_read * fp.get("bytes_per_expert", 0)
        return flop / nbytes, flop / seconds

    def cv_stats(self) -> tuple[float, float, int]:
        """(median CV, max CV, total repeats) over the measured points of every slice."""
        cvs, repeats = [], 0
        for e in self.entries:
            for m in e["points"].values():
                cvs.append(m["cv"])
                repeats += m["repeats"]
        cvs.sort()
        return (cvs[len(cvs) // 2] if cvs else 0.0), (cvs[-1] if cvs else 0.0), repeats


class Digest:
    def __init__(self, data: dict):
        self.data = data

    @property
    def meta(self) -> dict:
        return self.data.get("meta", {})

    @property
    def roofline(self) -> dict | None:
        return self.data.get("roofline")

    @cached_property
    def _views(self) -> dict[tuple, list[ModelView]]:
        """Sweeps of one model (name, dtype, bits, context), as-run first, then its what-ifs
        (forced routing, sorted gather) in the order they were measured."""
        groups: dict[tuple, dict[tuple, list[dict]]] = {}
        for entry in self.data.get("sweeps", {}).values():
            model = (entry["model"], entry["dtype"], entry["bits"], entry["context"])
            how = (entry.get("routing", "model"), entry.get("gather", "mlx-lm"))
            groups.setdefault(model, {}).setdefault(how, []).append(entry)
        return {model: sorted((ModelView(model[0], entries) for entries in by_how.values()),
                              key=lambda v: not v.as_run)
                for model, by_how in groups.items()}

    @property
    def models(self) -> list[ModelView]:
        """One view per swept model: as generation runs it when measured, else its first what-if."""
        return [views[0] for views in self._views.values()]

    def what_ifs(self, view: ModelView) -> list[ModelView]:
        """The other sweeps of ``view``'s model: forced routings and the sorted gather."""
        for views in self._views.values():
            if views[0] is view:
                return views[1:]
        return []

    def model(self, name: str) -> ModelView | None:
        return next((m for m in self.models if m.name == name), None)

    @property
    def routing(self) -> list[dict]:
        return list(self.data.get("routing", {}).values())

    @property
    def fits(self) -> list[dict]:
        """Fits in the current format (every expert-load variant fitted, one chosen)."""
        return [f for f in self.data.get("fits", {}).values() if "chosen" in f]

    @property
    def stale_fits(self) -> list[str]:
        """Models whose stored fit predates the variant fit: `mac-moesd fit` redoes them."""
        return [f["model"] for f in self.data.get("fits", {}).values() if "chosen" not in f]

    def fit_of(self, model: str, draft: str | None = None) -> dict | None:
        """The fit of ``model``; with ``draft`` (the drafter of the runs it is to price), only one
        that prices that drafter's runs (``prices_drafter``)."""
        fitted = next((f for f in self.fits if f["model"] == model), None)
        return fitted if fitted is not None and prices_drafter(fitted, draft) else None

    @property
    def spec(self) -> list[dict]:
        return list(self.data.get("spec", {}).values())

    @property
    def drafts(self) -> list[dict]:
        return list(self.data.get("draft", {}).values())

    @property
    def pairs(self) -> list[dict]:
        """Pairs of the user's own measured by `run --target --draft` (what each run measured)."""
        return list(self.data.get("pairs", {}).values())

    @property
    def pair_search(self) -> dict | None:
        """The default GPU run's latest search of the Hugging Face cache for a known pair."""
        return self.data.get("pair_search", {}).get("latest")

    def pair_spec(self, pair: dict) -> dict[str, dict]:
        """A pair's real-mode SD documents by prompt set, as `run --target` stores them."""
        stored = self.data.get("spec", {})
        kind = pair.get("drafter_kind", "model")
        keys = {s: pair_spec_key(pair["target"], pair["draft"], kind, s) for s in pair["prompt_sets"]}
        return {s: stored[k] for s, k in keys.items() if k in stored}

    def draft_entry(self, name: str, context: int | None = None) -> dict | None:
        """The drafter step measured for ``name``, at ``context`` when there is one."""
        found = [e for e in self.drafts if e["model"] == name]
        found.sort(key=lambda e: e.get("context") != context)
        return found[0] if found else None
