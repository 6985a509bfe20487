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

from mac_moesd.errors import MacMoesdError

__all__ = ["ZOO", "ZooEntry", "by_name", "expert_shape", "miniature"]

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token")


@dataclass(frozen=True)
class ZooEntry:
    name: str
    role: str  # "moe", "dense", "drafter" or "test"
    config: dict = field(repr=False)
    source: str = ""  # where the dimensions come from

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


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


def miniature(config: dict, layers: int = 2, experts: int = 8, top_k: int = 2) -> dict:
    """The same architecture at test width: what every-architecture tests build."""
    small = copy.deepcopy(config)
    for key, value in _MINIATURE.items():
        if key in small and small[key] is not None:
            small[key] = value
    small["num_hidden_layers"] = layers
    if "layer_types" in small:
        small["layer_types"] = small["layer_types"][:layers]
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
    return small


REQUIRED_KEYS = ("num_hidden_layers", "vocab_size", "hidden_size")


def read_config(path: Path) -> dict:
    """A config.json as a dict, with a clear error when it is missing or not a model config."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise MacMoesdError(f"config file not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MacMoesdError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise MacMoesdError(f"{path} has no 'model_type': not a model config.json")
    missing = [k for k in REQUIRED_KEYS if k not in config]
    if missing:
        raise MacMoesdError(f"{path} lacks {', '.join(map(repr, missing))}")
    return config
