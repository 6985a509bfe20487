"""An emulated multi-token-prediction (MTP) head: drafting from the target's own last hidden state.

Checkpoints of DeepSeek-V3, GLM-4.5 and Qwen3.5/3.6 carry MTP layers that mlx-lm drops on load.
What one costs is what decides whether MTP drafting pays, and it is the same with any weights, so
the suite builds one at the target's dimensions and times it with acceptance imposed (``--alpha``),
on any MoE, random-weight or trained. Its structure is DeepSeek-V3's MTP module (arXiv
2412.19437, §2.2), which Qwen3.5's ``mtp`` weights follow too: the embedding of the token just
chosen and the hidden state that chose it, each RMS-normed, concatenated and projected back to the
hidden size; one decoder layer of the target's own architecture (a copy of its last full-attention
layer, so an MoE target's head is an MoE layer with its own KV cache); an RMS norm; and the
target's own LM head and embedding, shared, not copied. A draft step is one pass through it, fed
the hidden state of the step before: the target's verify's last position for the first draft of
a round (``capture``), the head's own after it. Two shortcuts, which change values, not work: a
trained head's first draft reads the verify's hidden state at the position of the token it
drafts from (the batch's shared prefix), and after a round that accepted every draft, feeding the
head that last draft (as a drafter model is fed) leaves the head's own state there instead.

The values it drafts are meaningless (acceptance is imposed, and the loop emits random ids in
that mode); the shapes and the work of every forward are a real head's.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs.cache_kinds import leaf_kind

__all__ = ["MTPHead"]


def _language_model(model: nn.Module) -> nn.Module:
    """The text model inside a multimodal wrapper (Qwen3.5's ``language_model``), else the model."""
    language = getattr(model, "language_model", None)
    return language if isinstance(language, nn.Module) else model


def _inner(model: nn.Module) -> nn.Module:
    """The decoder stack whose output, after its final norm, mlx-lm's ``Model`` feeds its LM head."""
    for name in ("model", "backbone"):
        inner = getattr(model, name, None)
        if isinstance(inner, nn.Module):
            return inner
    raise MacMoesdError(f"an MTP head needs the decoder stack of {type(model).__module__}: it has neither "
                        "`model` nor `backbone`")


def _embedding(inner: nn.Module) -> nn.Embedding:
    for name in ("embed_tokens", "embeddings", "wte"):
        found = getattr(inner, name, None)
        if found is not None:
            return found
    raise MacMoesdError("an MTP head needs the target's token embedding, which this model does not name "
                        "embed_tokens or embeddings")


def _full_attention_layer(model: nn.Module) -> int:
    """The index of the target's last layer whose cache is a plain KV cache (full attention)."""
    caches = make_prompt_cache(model)
    if len(caches) != len(model.layers) or any(hasattr(c, "caches") for c in caches):
        raise MacMoesdError(f"an MTP head copies one decoder layer of the target, and {type(model).__module__} "
                            "keeps caches for some layers only (Nemotron-H's attention and Mamba blocks), "
                            "or several per layer, which this version does not map to its layers")
    full = [i for i, c in enumerate(caches) if leaf_kind(c) == "kv"]
    if not full:
        raise MacMoesdError("an MTP head is one full-attention decoder layer of the target, and this model "
                            "has none")
    return full[-1]


class MTPHead(nn.Module):
    """One MTP module at the dimensions of ``target`` (see the module docstring). Called as a
    drafter model: ``head(tokens, cache=...)`` returns logits and keeps its last hidden state for
    the next step; ``capture(target)`` is the target as the SD loop's verify calls it, handing the
    head the target's last hidden state."""

    def __init__(self, target: nn.Module):
        super().__init__()
        language = _language_model(target)
        inner = _inner(language)
        embedding = _embedding(inner)
        dims = embedding.weight.shape[1]
        if isinstance(embedding, nn.QuantizedEmbedding):  # packed: 32 // bits values per uint32
            dims = dims * 32 // embedding.bits
        index = _full_attention_layer(target)
        self.layer = copy.deepcopy(target.layers[index])
        self._new_cache = lambda: make_prompt_cache(target)[index]  # the copied layer's kind, fresh
        self.enorm, self.hnorm, self.norm = nn.RMSNorm(dims), nn.RMSNorm(dims), nn.RMSNorm(dims)
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.set_dtype(_dtype(_embedding(inner)))
        self.eh_proj = _projection(2 * dims, dims, _embedding(inner))
        self.dims = dims
        # Shared with the target (not parameters of the head: kept out of its module tree).
        self._shared = (_embedding(inner), getattr(language, "lm_head", None) or _embedding(inner).as_linear,
                        inner)
        self._hidden: mx.array | None = None

    @property
    def layers(self) -> list:
        return [self.layer]

    def make_cache(self) -> list:
        return [self._new_cache()]

    def logits(self, hidden: mx.array) -> mx.array:
        return self._shared[1](hidden)

    def __call__(self, tokens: mx.array, cache=None) -> mx.array:
        embed = self._shared[0](tokens)
        batch, length = tokens.shape
        hidden = self._hidden
        if hidden is None or hidden.shape[:2] != (batch, length):
            # A prefill, or the first step at a new batch: no hidden state of that shape to carry
            # (the values do not matter here; the work is the same).
            hidden = mx.zeros((batch, length, self.dims), dtype=embed.dtype)
        h = self.eh_proj(mx.concatenate([self.enorm(embed), self.hnorm(hidden.astype(embed.dtype))], axis=-1))
        layer_cache = cache[0] if cache else None
        mask = create_attention_mask(h, layer_cache, return_array=True)
        h = self.layer(h, mask=mask, cache=layer_cache)
        self._hidden = h[:, -1:]
        return self.logits(self.norm(h))

    def capture(self, target: nn.Module):
        """``target`` as a callable that also hands the head the hidden state of its last position
        (the verify's), for the next round's first draft step."""
        inner = self._shared[2]

        def verify(tokens: mx.array, cache=None) -> mx.array:
            hidden = inner(tokens, cache=cache)
            self._hidden = hidden[:, -1:]
            return self.logits(hidden)

        return verify


def _projection(inputs: int, outputs: int, embedding: nn.Module) -> nn.Module:
    """The head's 2d -> d projection, quantized as the target's embedding is (a 4-bit
    checkpoint's head is 4-bit too), else in the embedding's dtype."""
    linear = nn.Linear(inputs, outputs, bias=False)
    if isinstance(embedding, nn.QuantizedEmbedding):
        return nn.QuantizedLinear.from_linear(linear, embedding.group_size, embedding.bits)
    linear.set_dtype(_dtype(embedding))
    return linear


def _dtype(embedding: nn.Module) -> mx.Dtype:
    """The dtype the target computes in: its embedding's (a quantized one's scales')."""
    return embedding.scales.dtype if isinstance(embedding, nn.QuantizedEmbedding) else embedding.weight.dtype
