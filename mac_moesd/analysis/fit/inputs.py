"""What the fit reads from a results file: the target sweep at full depth, the drafter and
rejection-sampling steps, the roofline (or the chip's published spec) and the sort threshold,
gathered into ``FitInputs``. What is missing is named, with what it would take."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from mac_moesd.analysis import cluster, expert_reads, theory
from mac_moesd.analysis.depth import depth_entries, full_depth_points, second_context_points
from mac_moesd.analysis.digest import Digest
from mac_moesd.errors import MacMoesdError
from mac_moesd.machine.chips import lookup_spec
from mac_moesd.results import keys, parse_point_key, point_key

__all__ = ["DEFAULT_VERIFY", "FitInputs", "NO_DRAFT", "NO_PIPELINED", "NO_REJECT", "NO_SECOND_CONTEXT",
           "NO_CHAINS", "ONE_CONTEXT_ONLY", "inputs_from_results", "mlx_sort_threshold"]

DEFAULT_VERIFY = "gamma+1"  # what the measured loops and mlx-lm feed the target; MoESD writes gamma
NO_DRAFT = "speedups need the drafter step T_D(B,1): rerun the sweep with --draft DRAFT"
NO_REJECT = "speedups need the rejection-sampling step T_rej(B): rerun the sweep with --draft DRAFT"
ONE_CONTEXT_ONLY = ("the model's KV cache could not go back to a shorter context (a chunked cache, or a "
                    "window or state-space cache in a sweep made before they were copied), so the sweep "
                    "timed one context: the KV term k_kv*B*L "
                    "also carries every cost per sequence, and predictions at other contexts overstate its growth")
NO_SECOND_CONTEXT = ("no one-token points at a second context: the KV term k_kv*B*L also carries every "
                     "cost per sequence, so predictions at other contexts overstate its growth; rerun "
                     "the sweep (it times them at a quarter of --context unless --kv-context 0)")
NO_CHAINS = ("no drafter chains timed after a verify of the target: the drafter's start a round is not "
             "priced; a sweep with --draft times them where the target (or its larger slice) and the "
             "drafter fit in memory together on one machine")
NO_PIPELINED = ("no pipelined timings in this sweep (made before they were recorded): predictions use "
                "synchronous forwards for plain decode and drafter steps too; rerun the sweep to add them")


def mlx_sort_threshold() -> tuple[int, str]:
    """mlx-lm's SwitchGLU sort threshold on indices.size, read from the installed source."""
    try:
        from mlx_lm.models import switch_layers

        source = inspect.getsource(switch_layers)
    except (ImportError, OSError, TypeError) as err:
        return theory.MLX_SORT_THRESHOLD, f"default (mlx_lm's switch_layers not readable: {err})"
    found = sorted({int(v) for v in re.findall(r"indices\.size\s*>=\s*(\d+)", source)})
    if len(found) != 1:
        return (theory.MLX_SORT_THRESHOLD,
                "default (no single `indices.size >= N` in mlx_lm's switch_layers.py)")
    version = getattr(__import__("mlx_lm"), "__version__", "?")
    return found[0], f"mlx_lm {version} switch_layers.py: indices.size >= {found[0]}"


@dataclass(frozen=True)
class FitInputs:
    model: str
    experts: int
    top_k: int
    weight_format: str
    ridge: float | None  # FLOP/byte for the model's compute dtype; None: knee fitted within the grid
    ridge_source: str
    ridge_tokens: float  # the knee's scale in tokens per forward: knee = lam * ridge_tokens
    bandwidth: float | None  # bytes/s; None: bias and k2 bounded below by 0 only
    bandwidth_source: str
    dense_bytes: float
    expert_bytes: float  # one expert, all MoE layers
    draft_bytes: float | None
    target: list[tuple[int, int, float]]  # (batch, tokens, seconds)
    draft: list[tuple[int, float]]
    reject: list[tuple[int, float]]
    context: int
    draft_model: str | None = None
    extrapolated: bool = False
    verify: str = DEFAULT_VERIFY
    sort_threshold: int = theory.MLX_SORT_THRESHOLD
    sort_threshold_source: str = "default"
    missing: tuple[str, ...] = ()  # what the fit could not use, and what it would take
    platform: str = "this machine"  # chip, backend and MLX versions the sweep ran on
    comm: cluster.CommTerm | None = None  # measured communication per forward (a sharded sweep)
    cluster: dict | None = None  # ranks, backend, hosts, parallel of a sharded sweep
    target_pipelined: tuple[tuple[int, int, float], ...] = ()  # (batch, tokens, seconds per forward)
    draft_pipelined: tuple[tuple[int, float], ...] = ()
    routing: expert_reads.Routing = expert_reads.Routing()  # unique experts per (B, t); uniform default
    kv_points: tuple[tuple[int, int, int, float], ...] = ()  # (batch, tokens, context, seconds) at a second context
    reforward: tuple[str, ...] = ()  # models whose rollback re-forwards (``_re_forwards``)
    linear_layers: int = 0  # the target's recurrent (linear-attention, Mamba2) layers: k_rec's multiplier
    bookkeeping: tuple[tuple[int, float], ...] = ()  # (batch, seconds): the SD loop's empty round
    draft_chains: tuple[tuple[int, int, float], ...] = ()  # (batch, gamma, seconds): chains after a verify

    @property
    def drafted(self) -> bool:
        """Whether T_D(B,1) and T_rej(B) were measured, so speedups can be predicted."""
        return bool(self.draft) and bool(self.reject)


def _as_pairs(points: dict) -> list[tuple[int, int, float]]:
    return sorted((*parse_point_key(key), float(m["median_s"])) for key, m in points.items())


def inputs_from_results(data: dict, model: str | None = None, verify: str = DEFAULT_VERIFY,
                        draft_model: str | None = None, context: int | None = None) -> FitInputs:
    """Everything the fit needs from one results file; what is missing is named, not fatal,
    unless the target sweep itself is. The drafter step is ``draft_model``'s when named, else
    the first measured at the target's context (a file may hold several runs' drafters); the
    sweep is the one at ``context`` when named (a quick run's and a full run's differ), else the
    first stored."""
    view = _target_view(data, model, context)
    full, footprint = view.full, view.footprint
    points, extrapolated = full_depth_points(view.entries)
    target = _as_pairs(points)
    counts = {(b, t): float(points[point_key(b, t)]["unique_experts"]) for b, t, _ in target
              if points[point_key(b, t)].get("unique_experts") is not None}
    target_pipelined = _as_pairs(full_depth_points(view.entries, "pipelined_points")[0])
    kv_points = _second_context(view.entries)
    draft, rejects = _drafter(data, full, draft_model)
    ridge, ridge_source, bandwidth, bandwidth_source = _roofline_or_spec(data, full["dtype"])
    if ridge is not None:
        ridge_tokens = theory.ridge_in_tokens(ridge, view.weight_format)
    else:
        ridge_tokens = float(max(b * t for b, t, _ in target))
        ridge_source = (f"{ridge_source}: knee fitted in tokens within the measured grid "
                        f"(n = B*t up to {ridge_tokens:g})")
    shape = data.get("meta", {}).get("cluster")
    # A sharded footprint is the largest rank's; a pipeline's stages stream theirs in turn.
    stages = shape["ranks"] if shape and shape["parallel"] == "pipeline" else 1
    threshold, threshold_source = _sort_threshold(data, full)
    side = draft if draft and rejects else None  # the drafter's points count only with T_rej's
    chains = (keys.chain_record([e for e in view.entries if e["context"] == full["context"]], draft["model"])[0]
              if draft else {"points": {}})
    return FitInputs(
        model=view.name,
        experts=footprint["experts"],
        top_k=footprint["top_k"],
        weight_format=view.weight_format,
        ridge=ridge,
        ridge_source=ridge_source,
        ridge_tokens=ridge_tokens,
        bandwidth=bandwidth,
        bandwidth_source=bandwidth_source,
        dense_bytes=footprint["bytes_dense_streamed"] * stages,
        expert_bytes=footprint["bytes_per_expert"] * stages,
        draft_bytes=draft["footprint"]["bytes_dense_streamed"] if draft else None,
        target=target,
        draft=[(b, s) for b, _, s in _as_pairs(side["points"])] if side else [],
        reject=[(b, s) for b, _, s in _as_pairs(rejects[0]["points"])] if side else [],
        bookkeeping=tuple((b, s) for b, _, s in _as_pairs(
            next((e["bookkeeping_points"] for e in rejects if e.get("bookkeeping_points")), {}))),
        draft_chains=tuple(keys.chain_points(chains)) if side else (),
        context=full["context"],
        draft_model=draft["model"] if draft else None,
        extrapolated=extrapolated,
        verify=verify,
        sort_threshold=threshold,
        sort_threshold_source=threshold_source,
        missing=tuple(_missing(view, draft, rejects, ridge, bandwidth, target_pipelined, kv_points, chains)),
        platform=_platform(data.get("meta", {})),
        comm=cluster.comm_term(data, view.name),
        cluster=shape,
        target_pipelined=tuple(target_pipelined),
        draft_pipelined=tuple((b, s) for b, _, s in _as_pairs(side.get("pipelined_points", {})))
        if side else (),
        routing=expert_reads.fit_routing(counts, footprint["experts"], footprint["top_k"]),
        kv_points=kv_points,
        reforward=tuple(who for who, fp in (("target", footprint), ("draft", draft and draft.get("footprint")))
                        if fp and _re_forwards(fp.get("layer_kinds", {}))),
        linear_layers=int(footprint.get("layer_kinds", {}).get("linear", 0)),
    )


def _re_forwards(kinds: dict) -> bool:
    """Whether SD's default rollback re-forwards a model with these ``layer_kinds``: recurrent
    layers it cannot take back per position (every one, in sweeps made before it could)."""
    return kinds.get("linear", 0) > kinds.get("per_position", 0)


def _target_view(data: dict, model: str | None, context: int | None = None):
    """The digest's view of the first MoE sweep (of ``model`` at ``context`` when named);
    refuses without one."""
    moe = [m for m in Digest(data).models if m.experts]
    views = [m for m in moe if (model is None or m.name == model) and context in (None, m.full["context"])]
    if not views:
        which = (f" of {model}" if model else "") + (f" at context {context}" if context is not None else "")
        named = [m for m in moe if model is None or m.name == model]
        held = (sorted({f"{m.name} at context {m.full['context']}" for m in named}) if named
                else sorted({m.name for m in moe}))
        listed = f" (they hold {', '.join(held)})" if held else ""
        raise MacMoesdError(f"no MoE sweep{which} in the results{listed}: run `mac-moesd sweep MODEL` first")
    return views[0]


def _drafter(data: dict, full: dict, draft_model: str | None) -> tuple[dict | None, list[dict]]:
    """The drafter document (``draft_model``'s, else the first at the target's context) and the
    rejection-sampling documents at the target's vocabulary."""
    drafts = [d for d in data.get("draft", {}).values() if d.get("points")
              and (draft_model is None or d["model"] == draft_model)]
    drafts.sort(key=lambda d: d.get("context") != full["context"])  # same context first
    vocab = full.get("vocab") or None
    rejects = [e for e in data.get("reject", {}).values()
               if vocab in (None, e.get("vocab")) and e.get("points")]
    return (drafts[0] if drafts else None), rejects


def _missing(view, draft: dict | None, rejects: list, ridge: float | None, bandwidth: float | None,
             target_pipelined: list, kv_points: tuple, chains: dict) -> list[str]:
    """What the fit could not use, in the order the output lists it, each with what it would take."""
    missing = []
    if draft is None:
        missing.append(NO_DRAFT)
    if draft is not None and not rejects:
        missing.append(NO_REJECT)
    if draft is not None and rejects and not chains["points"]:
        why = chains.get("skipped")
        missing.append(NO_CHAINS + (f" (this sweep: {why})" if why else ""))
    if ridge is None:
        missing.append("no roofline and no published FLOPS for this chip: the knee is fitted within "
                       "the grid; run `mac-moesd roofline` to anchor it")
    if bandwidth is None:
        missing.append("no measured or published bandwidth: bias and k2 are bounded below by 0 only")
    if not target_pipelined:
        missing.append(NO_PIPELINED)
    if not kv_points:
        untrimmable = any(e.get("kv_untrimmable") for e in depth_entries(view.entries))
        missing.append(ONE_CONTEXT_ONLY if untrimmable else NO_SECOND_CONTEXT)
    if not view.as_run:
        missing.append(f"only a what-if sweep of {view.name} was found (routing {view.routing}, gather "
                       f"{view.gather}): the fit describes that, not generation as mlx-lm runs it; "
                       "rerun `mac-moesd sweep` without --routing/--gather")
    return missing


def _sort_threshold(data: dict, full: dict) -> tuple[int, str]:
    """The n*K at which mlx-lm sorts the gather (0: the sweep forced it sorted), and its source."""
    if full.get("gather") == "sorted":
        return 0, "the sweep forced mlx-lm's sorted gather at every size"
    threshold, source = mlx_sort_threshold()
    swept = data.get("meta", {}).get("versions", {}).get("mlx_lm")
    if swept and f"mlx_lm {swept} " not in source:
        source += f"; the sweep ran mlx-lm {swept}"
    return threshold, source


def _second_context(entries: list[dict]) -> tuple[tuple[int, int, int, float], ...]:
    """The one-token points timed at the sweep's second context beside its grid, at full depth;
    none where the sweep timed none (or its slices were timed at different second contexts)."""
    context, points = second_context_points(entries)
    if context is None:
        return ()
    return tuple((b, t, context, s) for b, t, s in _as_pairs(points))


def _platform(meta: dict) -> str:
    versions = meta.get("versions", {})
    return (f"{meta.get('chip', 'this machine')} ({meta.get('backend', '?')} backend) with MLX "
            f"{versions.get('mlx', '?')} and mlx-lm {versions.get('mlx_lm', '?')}")


def _roofline_or_spec(data: dict, dtype: str) -> tuple[float | None, str, float | None, str]:
    """(ridge FLOP/byte for ``dtype`` compute, its source, bandwidth bytes/s, its source)."""
    roof = data.get("roofline")
    if roof:
        bandwidth = roof["bandwidth_ceiling_gbs"] * 1e9
        bw_source = f"measured ({roof['bandwidth_ceiling_source']})"
        by_dtype = roof.get("ridge_by_dtype") or {}
        if dtype in by_dtype:
            return by_dtype[dtype], f"measured roofline ({dtype} matmul peak)", bandwidth, bw_source
        return (roof["ridge_flop_per_byte"], f"measured roofline ({roof['ridge_dtype']} peak; no {dtype} "
                "matmul measured)", bandwidth, bw_source)
    meta = data.get("meta", {})
    spec = lookup_spec(meta.get("chip", ""), meta.get("gpu_cores"))
    if spec is None:
        return None, "no roofline and no published spec", None, "none (no roofline, no published spec)"
    where = f"published spec of {spec['name']} (no roofline measured)"
    if spec["ridge_flop_per_byte"] is None:
        return None, f"{where} without FLOPS", spec["bandwidth_bytes_s"], where
    note = "" if dtype == "float32" else f"; Apple publishes FP32 only, taken as the {dtype} peak too"
    return spec["ridge_flop_per_byte"], f"{where}, FP32 peak{note}", spec["bandwidth_bytes_s"], where
