"""Built-in model configs with real dimensions, and building them through mlx-lm's own classes.

A config dict goes in, mlx-lm's ``Model`` comes out, with random weights (nothing is downloaded).
MLX arrays are lazy, so a model is built and measured (parameters, bytes) before any weight is
allocated: the memory guard runs on the shapes alone.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mac_moesd.errors import MacMoesdError

__all__ = ["ZOO", "ZooEntry", "by_name", "expert_shape", "largest_slice", "miniature", "normalise", "slice_config"]

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")


@dataclass(frozen=True)
class ZooEntry:
    name: str
    role: str  # "moe", "dense", "drafter" or "test"
    config: dict = field(repr=False)
    source: str = ""  # where the dimensions come from

    def __post_init__(self):
        object.__setattr__(self, "config", normalise(self.config))  # read as every config is

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


def normalise(config: dict) -> dict:
    """The config as the suite reads it, still one mlx-lm builds: a multimodal checkpoint's text
    model fields (under ``text_config``, as Qwen3.5/3.6 ship them) also at the top, where they
    win as mlx-lm reads them from there (``model_type`` stays the checkpoint's); a layer pattern
    (``hybrid_override_pattern``, Nemotron-H) gives the layer count, as in mlx-lm."""
    out = copy.deepcopy(config)
    text = out.get("text_config")
    if isinstance(text, dict):
        out.update({k: copy.deepcopy(v) for k, v in text.items() if k != "model_type"})
    pattern = out.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        out["num_hidden_layers"] = len(pattern)
    return out


def slice_config(config: dict, layers: int) -> dict:
    """A (normalised) config of the same model cut to its first ``layers`` decoder layers, with
    every per-layer list and pattern cut alike, nested ones included. A slice of a hybrid that
    would keep none of its attention layers (or, on Nemotron-H, none of its Mamba ones) is
    refused: mlx-lm's hybrids index their first such layer."""
    sliced = copy.deepcopy(config)
    for where in (sliced, sliced.get("text_config")):
        if not isinstance(where, dict):
            continue
        where["num_hidden_layers"] = layers
        if isinstance(where.get("layer_types"), list):
            where["layer_types"] = where["layer_types"][:layers]
        if isinstance(where.get("hybrid_override_pattern"), str):
            where["hybrid_override_pattern"] = where["hybrid_override_pattern"][:layers]
    interval = sliced.get("full_attention_interval")
    if interval and layers < interval and not sliced.get("layer_types"):
        raise MacMoesdError(f"a {layers}-layer slice of this hybrid keeps no full-attention layer (one in every "
                            f"{interval}): slice it to {interval} layers or more")
    pattern = sliced.get("hybrid_override_pattern")
    if isinstance(pattern, str) and not ("*" in pattern and "M" in pattern):
        raise MacMoesdError(f"a {layers}-layer slice of this hybrid ({pattern!r}) lacks an attention (*) or a "
                            "Mamba (M) block, which mlx-lm's Nemotron-H needs")
    return sliced


def slice_unit(config: dict) -> int:
    """The fewest layers a slice of this (normalised) config takes at a time: a hybrid's period
    (a full-attention layer every ``full_attention_interval``, or the period of its
    ``layer_types`` / ``hybrid_override_pattern``), so that a slice of whole periods has the
    kinds of layers of the whole model in proportion and a sweep's N and 2N layers extrapolate
    to it; for a pattern with no period, its shortest start holding every kind; 1 for a model
    whose layers are all alike."""
    pattern = config.get("hybrid_override_pattern") or config.get("layer_types")
    if isinstance(pattern, (str, list)) and pattern:
        kinds = list(pattern)
        period = next(p for p in range(1, len(kinds) + 1)
                      if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
        if period <= len(kinds) // 2:
            return period
        return next(n for n in range(1, len(kinds) + 1) if set(kinds[:n]) == set(kinds))
    interval = config.get("full_attention_interval")
    return int(interval) if interval else 1


def smaller_slice(layers: int, unit: int) -> int | None:
    """The next slice to try below ``layers``: about half of it, in whole ``unit``s and at least
    one; None when ``layers`` is one unit already."""
    if layers <= unit:
        return None
    return max(unit, layers // 2 // unit * unit)


def largest_slice(layers: int, unit: int, fits: Callable[[int], bool]) -> int:
    """The first of ``layers`` and its ever smaller slices (``smaller_slice``) that ``fits``, or
    the smallest one when none does (the caller then refuses with its need)."""
    while not fits(layers) and (smaller := smaller_slice(layers, unit)) is not None:
        layers = smaller
    return layers


def expert_shape(config: dict) -> tuple[int, int] | None:
    """(E, K) from a config, or None for a dense model."""
    experts = next((config[k] for k in EXPERT_KEYS if config.get(k)), None)
    top_k = next((config[k] for k in TOP_K_KEYS if config.get(k)), None)
    if not experts or not top_k:
        return None
    return int(experts), int(top_k)


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


_QWEN_VOCAB = 151936

ZOO: tuple[ZooEntry, ...] = (
    ZooEntry("qwen2-57b-a14b", "moe", {
        "model_type": "qwen2_moe", "hidden_size": 3584, "num_hidden_layers": 28,
        "intermediate_size": 18944, "moe_intermediate_size": 2560,
        "shared_expert_intermediate_size": 20480, "num_experts": 64, "num_experts_per_tok": 8,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": _QWEN_VOCAB,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }, _hf("Qwen/Qwen2-57B-A14B")),
    ZooEntry("mixtral-8x7b", "moe", {
        "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
        "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }, _hf("mistralai/Mixtral-8x7B-v0.1")),
    ZooEntry("qwen1.5-moe-a2.7b", "moe", {
        "model_type": "qwen2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
        "intermediate_size": 5632, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
        "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": _QWEN_VOCAB,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    }, _hf("Qwen/Qwen1.5-MoE-A2.7B")),
    ZooEntry("deepseek-v2-lite", "moe", {
        "model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "greedy", "n_group": 1,
        "topk_group": 1, "routed_scaling_factor": 1.0, "vocab_size": 102400,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840,
        "rope_scaling": {
            "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        },
    }, _hf("deepseek-ai/DeepSeek-V2-Lite")),
    # At 4-bit its 352 GiB of weights leave a 512 GB Mac little room for KV caches: the model
    # people shard over several Macs (sweep --parallel, run --dry-run --ranks). The checkpoint's
    # multi-token-prediction layer (num_nextn_predict_layers) is dropped by mlx-lm and left out.
    ZooEntry("deepseek-v3", "moe", {
        "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "moe_layer_freq": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 8,
        "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "vocab_size": 129280, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "rope_scaling": {
            "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
    }, _hf("deepseek-ai/DeepSeek-V3")),
    ZooEntry("qwen3-30b-a3b", "moe", {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "vocab_size": _QWEN_VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    }, _hf("Qwen/Qwen3-30B-A3B")),
    ZooEntry("olmoe-1b-7b", "moe", {
        "model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16,
        "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_key_value_heads": 16,
        "vocab_size": 50304, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }, _hf("allenai/OLMoE-1B-7B-0924")),
    ZooEntry("gpt-oss-20b", "moe", {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24,
        "intermediate_size": 2880, "num_local_experts": 32, "num_experts_per_tok": 4,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "vocab_size": 201088, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
        "max_position_embeddings": 131072, "swiglu_limit": 7.0,
        "rope_scaling": {
            "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0,
        },
    }, _hf("openai/gpt-oss-20b")),
    # The hybrid and sliding-window MoEs Mac users run at the end of 2026 (docs/design.md §4.7):
    # GatedDeltaNet linear attention with full attention every 4th layer (Qwen3.6, Qwen3-Next),
    # 128-token sliding windows on every other layer (gpt-oss), Mamba2 blocks (Nemotron-3 Nano).
    ZooEntry("qwen3.6-35b-a3b", "moe", {
        "model_type": "qwen3_5_moe",
        "text_config": {
            "attention_bias": False, "full_attention_interval": 4, "head_dim": 256,
            "hidden_size": 2048, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": 512, "num_attention_heads": 16, "num_experts": 256,
            "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
            "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
            "rope_parameters": {
                "mrope_interleaved": True, "mrope_section": [11, 11, 10],
                "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default",
            },
            "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 248320,
        },
        "tie_word_embeddings": False,
    }, _hf("Qwen/Qwen3.6-35B-A3B")),
    ZooEntry("qwen3-next-80b-a3b", "moe", {
        "model_type": "qwen3_next", "decoder_sparse_step": 1, "full_attention_interval": 4,
        "head_dim": 256, "hidden_size": 2048, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
        "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
        "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
        "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False, "vocab_size": 151936,
    }, _hf("Qwen/Qwen3-Next-80B-A3B-Instruct")),
    ZooEntry("gpt-oss-120b", "moe", {
        "model_type": "gpt_oss", "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "num_local_experts": 128, "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False,
        },
        "rope_theta": 150000, "sliding_window": 128, "tie_word_embeddings": False,
        "vocab_size": 201088,
    }, _hf("openai/gpt-oss-120b")),
    ZooEntry("glm-4.5-air", "moe", {
        "model_type": "glm4_moe", "attention_bias": True, "first_k_dense_replace": 1, "head_dim": 128,
        "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 131072,
        "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
        "num_hidden_layers": 46, "num_key_value_heads": 8, "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
        "use_qk_norm": False, "vocab_size": 151552,
    }, _hf("zai-org/GLM-4.5-Air")),
    ZooEntry("nemotron-3-nano-30b-a3b", "moe", {
        "model_type": "nemotron_h", "attention_bias": False, "conv_kernel": 4, "head_dim": 128,
        "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "intermediate_size": 1856, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
        "mamba_num_heads": 64, "mamba_proj_bias": False, "max_position_embeddings": 262144,
        "mlp_bias": False, "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "n_group": 1, "n_groups": 8, "n_routed_experts": 128, "n_shared_experts": 1,
        "norm_topk_prob": True, "num_attention_heads": 32, "num_experts_per_tok": 6,
        "num_hidden_layers": 52, "num_key_value_heads": 2, "routed_scaling_factor": 2.5,
        "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_max": 0.1,
        "time_step_min": 0.001, "topk_group": 1, "use_bias": False, "use_conv_bias": True,
        "vocab_size": 131072,
    }, _hf("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")),
    ZooEntry("qwen2.5-14b", "dense", {
        "model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 48,
        "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 8,
        "vocab_size": 152064, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    }, _hf("Qwen/Qwen2.5-14B")),
    ZooEntry("qwen2.5-3b", "dense", {
        "model_type": "qwen2", "hidden_size": 2048, "num_hidden_layers": 36,
        "intermediate_size": 11008, "num_attention_heads": 16, "num_key_value_heads": 2,
        "vocab_size": _QWEN_VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
    }, _hf("Qwen/Qwen2.5-3B")),
    ZooEntry("qwen3-4b", "dense", {
        "model_type": "qwen3", "hidden_size": 2560, "num_hidden_layers": 36,
        "intermediate_size": 9728, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": _QWEN_VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    }, _hf("Qwen/Qwen3-4B")),
    ZooEntry("qwen2-0.5b", "drafter", {
        "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
        "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": _QWEN_VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
    }, _hf("Qwen/Qwen2-0.5B")),
    ZooEntry("qwen3-0.6b", "drafter", {
        "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": _QWEN_VOCAB, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": True,
    }, _hf("Qwen/Qwen3-0.6B")),
    # CI-sized models (docs/design.md §6). tiny-dense has tiny-moe's active FFN width:
    # 4 experts x 256 = 1024, so the two differ only in how many experts a token stream loads.
    ZooEntry("tiny-moe", "test", {
        "model_type": "qwen3_moe", "hidden_size": 512, "num_hidden_layers": 4,
        "intermediate_size": 1024, "moe_intermediate_size": 256, "num_experts": 64,
        "num_experts_per_tok": 4, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "vocab_size": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }, "test config, Qwen3-MoE architecture"),
    # A less sparse MoE of the same active width: 8 experts, top-2, 512 wide (rho 1/4, Mixtral's).
    ZooEntry("tiny-moe-8x2", "test", {
        "model_type": "qwen3_moe", "hidden_size": 512, "num_hidden_layers": 4,
        "intermediate_size": 1024, "moe_intermediate_size": 512, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "vocab_size": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }, "test config, Qwen3-MoE architecture"),
    # CI-sized twins of the hybrid and sliding-window MoEs (docs/design.md §4.7): the rollback of
    # SD on each cache kind mlx-lm has, in seconds. Vocabulary 4096: tiny-draft drafts for them.
    ZooEntry("tiny-hybrid-moe", "test", {
        "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "hidden_size": 256, "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 16,
            "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
            "intermediate_size": 512, "norm_topk_prob": True, "vocab_size": 4096, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
    }, "test config, Qwen3.5-MoE architecture (nested, GatedDeltaNet + full attention every 4th layer)"),
    ZooEntry("tiny-swa-moe", "test", {
        "model_type": "gpt_oss", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_local_experts": 16, "num_experts_per_tok": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "vocab_size": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 150000.0, "max_position_embeddings": 4096, "swiglu_limit": 7.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0},
    }, "test config, gpt-oss architecture (16-token sliding window every other layer)"),
    ZooEntry("tiny-mamba-moe", "test", {
        "model_type": "nemotron_h", "hidden_size": 256, "hybrid_override_pattern": "MEM*EM-E",
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 32, "conv_kernel": 4, "n_groups": 2,
        "chunk_size": 128, "use_conv_bias": True, "use_bias": False, "mamba_proj_bias": False, "mlp_bias": False,
        "mlp_hidden_act": "relu2", "attention_bias": False, "layer_norm_epsilon": 1e-5,
        "n_routed_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 256, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "time_step_min": 0.001, "time_step_max": 0.1,
        "vocab_size": 4096, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }, "test config, Nemotron-H architecture (Mamba2, attention and MoE blocks from its pattern)"),
    ZooEntry("tiny-dense", "test", {
        "model_type": "qwen3", "hidden_size": 512, "num_hidden_layers": 4,
        "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "vocab_size": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": False,
    }, "test config, Qwen3 architecture"),
    ZooEntry("tiny-draft", "test", {
        "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": True,
    }, "test config, Qwen3 architecture"),
)


def by_name(name: str) -> ZooEntry:
    """The zoo entry called ``name``; an unknown name lists the close matches."""
    for entry in ZOO:
        if entry.name == name.lower():
            return entry
    names = [e.name for e in ZOO]
    close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(names)}"
    raise MacMoesdError(f"unknown model {name!r}: {hint}")


_MINIATURE = {
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 256, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "v_head_dim": 16,
}


# Linear-attention and Mamba widths at test size (their kernels want head sizes of 32).
_MINIATURE_HYBRID = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 32,
    "n_groups": 2, "moe_shared_expert_intermediate_size": 32, "sliding_window": 16,
}


def miniature(config: dict, layers: int = 2, experts: int = 8, top_k: int = 2) -> dict:
    """The same architecture at test width: what every-architecture tests build. A hybrid keeps
    enough layers for one of each kind (a full-attention layer every ``full_attention_interval``)."""
    small = normalise(config)
    layers = max(layers, small.get("full_attention_interval") or 0)
    pattern = small.get("hybrid_override_pattern")
    if isinstance(pattern, str):  # the shortest prefix with a block of every kind
        layers = max(layers, max(pattern.index(kind) + 1 for kind in set(pattern)))
    for where in (small, small.get("text_config")):
        if isinstance(where, dict):
            _shrink(where, layers, experts, top_k)
    return slice_config(small, layers)


def _shrink(small: dict, layers: int, experts: int, top_k: int) -> None:
    for key, value in _MINIATURE.items():
        if key in small and small[key] is not None:
            small[key] = value
    if small.get("first_k_dense_replace"):
        small["first_k_dense_replace"] = min(small["first_k_dense_replace"], layers - 1)
    for key in EXPERT_KEYS:
        if small.get(key):
            small[key] = experts
    for key in TOP_K_KEYS:
        if small.get(key):
            small[key] = top_k
    if (small.get("n_group") or 1) > 1:  # grouped routing (DeepSeek-V3): two groups, one chosen
        small["n_group"], small["topk_group"] = 2, 1
    for key, value in _MINIATURE_HYBRID.items():
        if key in small:
            small[key] = value


REQUIRED_KEYS = ("num_hidden_layers", "vocab_size", "hidden_size")


def read_config(path: Path) -> tuple[dict, dict]:
    """A config.json as written and as the suite reads it (``normalise``), with a clear error
    when it is missing or not a model config."""
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        raise MacMoesdError(f"config file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MacMoesdError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(stored, dict) or "model_type" not in stored:
        raise MacMoesdError(f"{path} has no 'model_type': not a model config.json")
    config = normalise(stored)
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise MacMoesdError(f"{path} lacks {', '.join(map(repr, missing))}")
    bad = [k for k in REQUIRED_KEYS if not isinstance(config[k], int) or isinstance(config[k], bool) or config[k] < 1]
    if bad:
        raise MacMoesdError(f"{path}: {', '.join(f'{k} {config[k]!r}' for k in bad)} is not a positive integer")
    shape = expert_shape(config)
    if shape is not None and shape[1] > shape[0]:
        raise MacMoesdError(f"{path}: each token is routed to {shape[1]} experts but the model has only {shape[0]}")
    return stored, config
