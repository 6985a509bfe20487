"""Unified-memory accounting: what a stage may allocate here, and what each stage will need.

Usable memory is the smaller of the ceiling (Metal's recommended working set on a Mac, device
memory on CUDA, RAM elsewhere) and what is free now, less a margin, and capped by
``--memory-limit`` / ``MAC_MOESD_MEMORY_LIMIT``. MLX does not refuse an allocation past the
working set (docs/design.md §5), so every stage estimates its peak from shapes alone, before
allocating, with the formulas below, and records ``mx.get_peak_memory()`` beside the estimate.
"""

from __future__ import annotations

import gc
import os
import platform
import re
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mac_moesd.machine import hardware
from mac_moesd.inputs import zoo
from mac_moesd.inputs.cache_kinds import leaf_kind, leaves
from mac_moesd.inputs.trees import flatten
from mac_moesd.errors import BadInput
from mac_moesd.results import schema
from mac_moesd.units import GiB

__all__ = [
    "ENV_LIMIT", "CacheShape", "GiB", "Usable", "cache_shape", "activation_bytes", "init_transient_bytes", "kv_slots",
    "limit_bytes", "parse_vm_stat", "release", "usable", "usable_from", "working_set_bytes",
]

ENV_LIMIT = "MAC_MOESD_MEMORY_LIMIT"
# MLX's Metal allocator starts collecting its buffer cache at 0.95 x the recommended working set
# (gc_limit_ in mlx/backend/metal/allocator.cpp): plan within that, not at the ceiling itself.
MARGIN = 0.05
# mlx-lm's KVCache grows in steps of this many slots (mlx_lm/models/cache.py, KVCache.step).
KV_STEP = KVCache.step
SCORE_BYTES = 4  # attention scores and softmax in float32 where the fused kernel does not apply
LOGIT_BYTES = 4  # logits counted in float32: the widest dtype mlx-lm models return
# mlx-lm's Mamba2 scan of a multi-token forward works in chunks of 256 tokens (ssm_attn's step,
# mlx_lm/models/ssm.py), holding about six (batch, heads, chunk, chunk) float32 matrices at once:
# 5.5-5.7 times one, measured with MLX 0.32 on the CPU backend at batch 1 and 4.
SSM_CHUNK = 256
SSM_MATRICES = 6


# ---- what is usable ----


def parse_vm_stat(text: str) -> dict[str, int]:
    """``vm_stat`` output as {"page_size": bytes, "free": pages, "inactive": pages, ...}."""
    out = {}
    size = re.search(r"page size of (\d+) bytes", text)
    if size:
        out["page_size"] = int(size.group(1))
    for name, value in re.findall(r'^(?:Pages|"Pages)\s+([^:"]+)"?:\s+(\d+)\.?\s*$', text, flags=re.MULTILINE):
        out[name.strip().replace(" ", "_")] = int(value)
    return out


def vm_stat_free_bytes(text: str) -> int | None:
    """Memory macOS would hand out now: free, speculative and inactive pages.

    vm_stat prints "Pages free" as the free count less the speculative pages, so the two add up
    without overlap. Purgeable pages are not added: they are resident pages of purgeable objects
    and already sit in the active and inactive queues (XNU's purgeable count tallies pages across
    those queues; it is not a queue of its own), so adding them would count them twice."""
    stats = parse_vm_stat(text)
    if "page_size" not in stats or "free" not in stats:
        return None
    pages = sum(stats.get(k, 0) for k in ("free", "speculative", "inactive"))
    return pages * stats["page_size"]


def working_set_bytes(memory_bytes: int) -> int:
    """Metal's recommended working set for a Mac with this much RAM when it cannot be asked:
    about 2/3 of RAM up to 32 GiB, 3/4 above (docs/design.md §5)."""
    return memory_bytes * 2 // 3 if memory_bytes <= 32 * GiB else memory_bytes * 3 // 4


def limit_bytes(gib: float | None, environ: Mapping[str, str] = os.environ) -> int | None:
    """The cap from ``--memory-limit`` GiB, else from the environment variable, else None."""
    source = f"--memory-limit {gib}"
    if gib is None:
        raw = environ.get(ENV_LIMIT, "").strip()
        if not raw:
            return None
        source = f"{ENV_LIMIT}={raw}"
        try:
            gib = float(raw)
        except ValueError:
            raise BadInput(f"{source} is not a number of GiB") from None
    if not gib > 0:
        raise BadInput(f"{source}: the memory limit must be > 0 GiB")
    return int(gib * GiB)


@dataclass(frozen=True)
class Usable:
    """What a stage may allocate, and the figures it came from (bytes)."""

    usable_bytes: int
    ceiling_bytes: int | None  # working set (Metal), device memory (CUDA), RAM (CPU)
    free_bytes: int | None  # free now, plus what MLX itself holds (it can reuse that)
    limit_bytes: int | None
    margin_bytes: int
    source: str

    def to_dict(self) -> dict:
        return asdict(self)


def usable_from(ceiling: int | None, free: int | None, limit: int | None, source: str) -> Usable:
    """Pure rule: min(ceiling, free) less the margin, then the cap."""
    known = [v for v in (ceiling, free) if v is not None]
    if known:
        base = min(known)
    elif limit is not None:
        base = limit
    else:
        raise BadInput("cannot tell how much memory is usable here: set --memory-limit")
    margin = int(base * MARGIN)
    usable_bytes = base - margin
    if limit is not None:
        usable_bytes = min(usable_bytes, limit)
    return Usable(usable_bytes, ceiling, free, limit, margin, source)


def mlx_held_bytes() -> int:
    """Memory MLX holds now (active arrays and its buffer cache): free to this process."""
    return mx.get_active_memory() + mx.get_cache_memory()


def usable(limit_bytes: int | None = None) -> Usable:
    """Usable memory on this machine now."""
    info = hardware.mlx_device_info()
    held = mlx_held_bytes()
    if mx.metal.is_available():
        ceiling = info.get("max_recommended_working_set_size")
        text = hardware.run_tool(["vm_stat"])
        free = vm_stat_free_bytes(text)
        free = None if free is None else free + held
        return usable_from(ceiling, free, limit_bytes, "Metal working set and vm_stat")
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return usable_from(info.get("memory_size"), None, limit_bytes, "CUDA device memory")
    free = None
    if platform.system() == "Linux":
        free = hardware.parse_meminfo(hardware.read_text("/proc/meminfo")).get("MemAvailable")
    free = None if free is None else free + held
    total = info.get("memory_size")
    return usable_from(total, free, limit_bytes, "MemAvailable" if free is not None else "device memory")


def release() -> None:
    """Return freed arrays' memory: drop unreachable objects, then MLX's buffer cache."""
    gc.collect()
    mx.clear_cache()


def start_stage() -> None:
    """Before a measured stage: free what earlier ones left, and restart the peak counter."""
    release()
    mx.reset_peak_memory()


def record(estimate: Mapping, usable_bytes: int | None) -> schema.Memory:
    """A stage's memory entry for results.json: the estimate beside the measured peak."""
    return {"estimate_bytes": int(estimate["peak_bytes"]), "peak_bytes": int(mx.get_peak_memory()),
            "usable_bytes": usable_bytes, "phase": estimate["phase"], "parts": dict(estimate["parts"])}


# ---- what a stage needs (shapes only, nothing allocated) ----


def kv_slots(forwards: Iterable[int], step: int = KV_STEP) -> tuple[int, int]:
    """(slots allocated after, peak slots during) a sequence of forwards of these token counts,
    replaying KVCache.update_and_fetch (mlx_lm/models/cache.py): a buffer grows by whole steps,
    by concatenating the old one (cut to the offset when that is not a step boundary) with the
    new zeros; the zeros are a broadcast, but the old buffer and the result exist together."""
    allocated = offset = peak = 0
    for n in forwards:
        if allocated == 0 or offset + n > allocated:
            new = (step + n - 1) // step * step
            if allocated:
                kept = offset if offset % step else allocated
                peak = max(peak, allocated + kept + new)
                allocated = kept + new
            else:
                allocated = new
        offset += n
        peak = max(peak, allocated)
    return allocated, peak


def prefill_forwards(context: int, chunk: int) -> list[int]:
    return [min(chunk, context - start) for start in range(0, context, chunk)]


def kv_bytes_per_slot(config: dict, dtype_bytes: int) -> int:
    """Bytes one cached token takes in one layer (keys plus values, all KV heads)."""
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if "kv_lora_rank" in config:  # MLA as mlx-lm's deepseek_v2 caches it: full keys and values
        k_dim = config.get("qk_nope_head_dim", 128) + config.get("qk_rope_head_dim", 64)
        return heads * (k_dim + config.get("v_head_dim", 128)) * dtype_bytes
    return 2 * kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class CacheShape:
    """One sequence's caches of a built model: bytes per token slot over the layers that keep
    every token (``per_slot``) and over the sliding-window ones (``window_per_slot``, which stop
    growing at ``window`` slots, plus ``S - 1`` while a forward of S tokens runs: mlx-lm's
    multi-token forward keeps a window's ``max_size + S - 1`` entries), and the recurrent states
    (``state``, fixed whatever the context)."""

    per_slot: int
    window_per_slot: int = 0
    window: int | None = None
    state: int = 0

    @property
    def plain_kv(self) -> bool:
        """Only layers that keep every token: a cache that trims back, with no snapshot."""
        return not self.window_per_slot and not self.state

    def bytes(self, slots: int, forward: int = 1) -> int:
        """A sequence's caches holding ``slots`` token slots, the last ``forward`` of them written
        by one forward."""
        windowed = min(slots, (self.window or slots) + forward - 1)
        return self.per_slot * slots + self.window_per_slot * windowed + self.state

    def snapshot_bytes(self, slots: int, forward: int = 1) -> int:
        """What the SD loops copy before a round may reject (``measure.caches.rollback``): the windows
        and the recurrent states, never the plain KV layers."""
        return self.bytes(slots, forward) - self.per_slot * slots


def recurrent_state_bytes(model: nn.Module) -> int:
    """Bytes of one sequence's recurrent states (GatedDeltaNet, Mamba2), all layers: read off the
    arrays a one-token forward writes into fresh caches. MLX is lazy, so the forward only builds
    the graph (nothing is computed or allocated) and the arrays' shapes and dtypes are the ones a
    real forward writes."""
    caches = make_prompt_cache(model)
    recurrent = [leaf for leaf in leaves(caches) if leaf_kind(leaf) == "recurrent"]
    if not recurrent:
        return 0
    model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    return sum(a.nbytes for leaf in recurrent for a in leaf.cache if a is not None)


def cache_shape(built) -> CacheShape:
    """The ``CacheShape`` of a built model (or of the layers a pipeline stage runs: the config's),
    kept on it: the estimates ask for it at every point they price."""
    if "cache_shape" not in built.__dict__:
        built.__dict__["cache_shape"] = _cache_shape(built)
    return built.__dict__["cache_shape"]


def _cache_shape(built) -> CacheShape:
    config, db = built.config, _dtype_bytes(built)
    layers = config["num_hidden_layers"]
    one = kv_bytes_per_slot(config, db)
    kinds = built.footprint["layer_kinds"]
    if not kinds or not any(kinds.get(k) for k in ("attention", "sliding", "linear")):
        return CacheShape(per_slot=one * layers)
    share = layers / built.footprint["layers"]  # 1, or a pipeline stage's part of the model
    state = recurrent_state_bytes(built.model) if kinds["linear"] else 0
    return CacheShape(per_slot=round(one * kinds["attention"] * share),
                      window_per_slot=round(one * kinds["sliding"] * share),
                      window=config.get("sliding_window") if kinds["sliding"] else None,
                      state=round(state * share))


def activation_bytes(config: dict, dtype_bytes: int, batch: int, tokens: int, kv_len: int) -> int:
    """Live activations of one decoder layer for a forward of batch x tokens over kv_len keys
    (MLX frees each layer's temporaries once the next consumes them):
    - residual, normed input, attention output and its projection, FFN output and the next
      layer's input (a dequantized embedding row for the first): 6 x hidden;
    - q, k, v: (heads + 2 kv_heads) x head_dim;
    - FFN, the larger of dense gate/up/product (3 x intermediate) and MoE: per chosen expert
      gate/up/product (3 x moe_intermediate) plus the token copies SwitchGLU gathers and
      scatters when it sorts (2 x hidden; mlx_lm/models/switch_layers.py), shared experts
      (3 x their width) and the router's logits;
    - attention scores and their softmax, batch x heads x tokens x kv_len in float32; in a Mamba2
      layer (Nemotron-H), its scan's (batch, heads, chunk, chunk) float32 matrices instead, where larger."""
    hidden = config["hidden_size"]
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    if "kv_lora_rank" in config:
        head_dim = config.get("qk_nope_head_dim", 128) + config.get("qk_rope_head_dim", 64)
        kv_heads = heads
    ffn = 3 * config.get("intermediate_size", 4 * hidden)
    shape = zoo.expert_shape(config)
    if shape:
        experts, top_k = shape
        moe_width = config.get("moe_intermediate_size") or config.get("intermediate_size", 4 * hidden)
        shared = config.get("shared_expert_intermediate_size") or (
            (config.get("n_shared_experts") or 0) * moe_width)
        ffn = max(ffn, top_k * (3 * moe_width + 2 * hidden) + 3 * shared + experts)
    per_token = 6 * hidden + (heads + 2 * kv_heads) * head_dim + ffn
    scores = 2 * batch * heads * tokens * kv_len * SCORE_BYTES
    if config.get("mamba_num_heads"):  # a Mamba2 layer's chunked scan, where it is the larger
        chunk = min(tokens, SSM_CHUNK)
        scores = max(scores, SSM_MATRICES * batch * config["mamba_num_heads"] * chunk * chunk * SCORE_BYTES)
    return batch * tokens * per_token * dtype_bytes + scores


def logits_bytes(config: dict, batch: int, tokens: int) -> int:
    return batch * tokens * config["vocab_size"] * LOGIT_BYTES


def _elements(module: nn.Module) -> int:
    if hasattr(module, "bits"):  # quantized: the weights it packs
        return module.weight.size * 32 // module.bits
    return max((v.size for _, v in flatten(module.parameters())), default=0)


def init_transient_bytes(model: nn.Module, dtype: str, quantized: bool) -> int:
    """Memory above the finished weights while the largest tensor is materialised on its own.

    mlx-lm initialises every Linear, SwitchLinear and Embedding in float32 (mx.random.uniform /
    normal; mlx_lm/models/switch_layers.py) before set_dtype and quantize: the float32 tensor
    lives while its cast is written, and the cast while it is quantized. Measured with MLX 0.32
    on one SwitchLinear, in bytes per parameter: float16 then 4-bit peaks at 6.56 (4 + 2 +
    0.56), float32 then 4-bit at 4.63, float16 unquantized at 6, float32 unquantized at 4."""
    cast = dtype != "float32"
    if not cast and not quantized:
        return 0
    per_param = 4 + (mx.float16.size if cast and quantized else 0)
    largest = max((_elements(m) for _, m in flatten(
        model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))), default=0)
    return largest * per_param


def phases(**named: dict[str, int]) -> dict:
    """The peak of several phases, each a dict of parts in bytes: which one, its parts, its sum."""
    totals = {name: sum(parts.values()) for name, parts in named.items()}
    phase = max(totals, key=totals.__getitem__)
    return {"peak_bytes": totals[phase], "phase": phase, "parts": named[phase]}


def rejection_bytes(vocab: int, batch: int, gamma: int) -> int:
    """Rejection sampling (mac_moesd/sampling.py) over batch x (2 gamma + 1) logit rows in
    float32: the inputs, their softmaxes, the residual and the concatenated choices, at most
    four times the inputs alive at once."""
    return 4 * batch * (2 * gamma + 1) * vocab * LOGIT_BYTES


def _dtype_bytes(built) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}[built.dtype]


def _materialise(built) -> dict[str, int]:
    return {"weights": built.footprint["bytes_total"],
            "init_transient": init_transient_bytes(built.model, built.dtype, built.bits is not None)}


def sweep_estimate(built, batches: tuple[int, ...], tokens: tuple[int, ...], context: int,
                   chunk: int, shortened: bool = False) -> dict:
    """Peak of one sweep slice: the largest batch's cache is prefilled once, every smaller batch
    gets a copy of its rows, and all are timed in one schedule (so all are alive together); a
    forward grows a cache by its tokens before the rollback. With ``shortened``, every batch also
    has a copy trimmed to a second context (a trimmed cache keeps its buffer). A cache that does
    not trim (windows, recurrent states) is restored from a snapshot of each, taken after the prefill."""
    config, db = built.config, _dtype_bytes(built)
    shape = cache_shape(built)  # of the layers this process caches (a pipeline stage holds fewer)
    big = max(batches)
    rows = sum(b for b in set(batches) if b < big) + (sum(set(batches)) if shortened else 0)
    prefill = prefill_forwards(context, chunk)
    _, prefill_peak = kv_slots(prefill)
    grown, grow_peak = kv_slots(prefill + [max(tokens)])
    step = max(tokens)
    first = min(chunk, context)
    # A cache that does not trim keeps a snapshot per copy, and with ``shortened`` the prefill's
    # copy at the second context (counted at full length: an upper bound).
    copies = big + rows + (big if shortened else 0)
    snapshots = 0 if shape.plain_kv else copies * shape.bytes(prefill_peak, first)
    weights = built.footprint["bytes_total"]
    forward = {"activations": activation_bytes(config, db, big, step, context + step),
               "logits": logits_bytes(config, big, step)}
    return phases(
        materialise=_materialise(built),
        prefill={"weights": weights, "kv": big * shape.bytes(prefill_peak, first),
                 "activations": activation_bytes(config, db, big, first, context)},
        grid={"weights": weights, "kv": big * shape.bytes(grow_peak, step), "snapshots": snapshots, **forward},
        rows={"weights": weights, "kv": big * shape.bytes(grown, step),
              "kv_rows": rows * shape.bytes(grow_peak, step), "snapshots": snapshots, **forward},
    )


def routing_estimate(built, sequences: int, length: int) -> dict:
    """Peak of routing: one forward of sequences x length tokens without a cache, evaluated only
    as far as the captured expert indices (no logits)."""
    config, db = built.config, _dtype_bytes(built)
    return phases(
        materialise=_materialise(built),
        forward={"weights": built.footprint["bytes_total"],
                 "activations": activation_bytes(config, db, sequences, length, length)},
    )


def spec_estimate(target, draft, batch: int, gamma: int, context: int, new_tokens: int,
                  chunk: int, mlx_lm_batch1: bool, mtp_head: bool = False) -> dict:
    """Peak of measured SD at one batch: target and drafter weights, both prefilled caches grown
    to context + new_tokens + gamma (the furthest a round reaches before its trim), the verify
    forward of gamma + 1 tokens, both logits and rejection sampling, and the recurrent states a
    rollback keeps (``CacheShape.snapshot_bytes``, per position), and the audit's fresh caches
    beside the decode's. ``draft`` None: self-draft,
    prompt lookup, or with ``mtp_head`` an MTP head (one of the target's layers, its share of the
    weights, a 2d x d projection, and one attention layer's cache). With ``mlx_lm_batch1``,
    mlx-lm's own generate loops hold a second pair of batch-1 caches."""
    db = _dtype_bytes(target)
    shapes = [cache_shape(m) for m in ([target] if draft is None else [target, draft])]
    if mtp_head:
        shapes.append(CacheShape(per_slot=kv_bytes_per_slot(target.config, db)))
    prefill = prefill_forwards(context, chunk)
    _, prefill_peak = kv_slots(prefill)
    _, decode_peak = kv_slots(prefill + [new_tokens + gamma])
    first = min(chunk, context)
    kv_prefill = sum(s.bytes(prefill_peak, first) for s in shapes)
    kv_decode = sum(s.bytes(decode_peak, gamma + 1) for s in shapes)
    kv_batch1 = kv_decode if mlx_lm_batch1 else 0
    # A cache that does not trim keeps its prefill's snapshot (to reset between timed runs) and
    # the rollback's copy of its windows and states from before the round; a per-position
    # rollback keeps gamma more recurrent states (one after each verify position but the last).
    snapshots = sum(0 if s.plain_kv else s.bytes(prefill_peak, first) + s.snapshot_bytes(decode_peak, gamma + 1)
                    + gamma * s.state for s in shapes)
    weights = {"weights": target.footprint["bytes_total"]}
    if draft is not None:
        weights["draft_weights"] = draft.footprint["bytes_total"]
    if mtp_head:
        dims = target.config["hidden_size"]
        weights["head_weights"] = target.footprint["bytes_total"] // target.footprint["layers"] + 2 * dims * dims * db
    vocab = target.config["vocab_size"]
    named = {"materialise": _materialise(target)}
    if draft is not None:
        named["materialise_draft"] = {**weights, "init_transient": _materialise(draft)["init_transient"]}
    named["prefill"] = {**weights, "kv": batch * kv_prefill,
                        "activations": activation_bytes(target.config, db, batch, min(chunk, context), context)}
    named["decode"] = {
        **weights, "kv": batch * kv_decode + kv_batch1, "snapshots": batch * snapshots,
        "activations": activation_bytes(target.config, db, batch, gamma + 1, context + new_tokens + gamma),
        "logits": logits_bytes(target.config, batch, 2 * gamma + 1) + rejection_bytes(vocab, batch, gamma),
    }
    # The audit (untimed, after the pairs; ``measure.caches.rollback_audit``): the decode's caches stay
    # while one model at a time gets fresh caches of the prompt (with their prefill's snapshot
    # where they do not trim) and is fed the emitted tokens in prefill chunks.
    fed = min(new_tokens + 1, chunk)
    audited = shapes[:1] if draft is None else shapes[:2]  # an MTP head is not replayed
    reference = max(s.bytes(decode_peak, fed) + (0 if s.plain_kv else s.bytes(prefill_peak, first)) for s in audited)
    named["audit"] = {
        **weights, "kv": batch * (kv_decode + reference) + kv_batch1, "snapshots": batch * snapshots,
        "activations": activation_bytes(target.config, db, batch, fed, context + new_tokens),
        "logits": logits_bytes(target.config, batch, fed),
    }
    return phases(**named)
