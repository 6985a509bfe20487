"""Speculative-decoding rejection sampling (Leviathan et al., arXiv 2211.17192), batched in MLX,
and the random ids that stand in for a random-weight model's own tokens."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["random_ids", "rejection_sample"]


def random_ids(token: mx.array, vocab: int) -> mx.array:
    """``token`` shifted by a uniform random offset modulo ``vocab``: uniformly random ids that
    still depend on the logits they came from (so a decoding chain keeps its data dependency).

    Random-weight models decode into loops of one or two repeated tokens, and a window of one
    repeated token routes every position to the same experts; where the tokens decide nothing
    (the sweep's pipelined chains, emulated acceptance) the forwards are fed random ids instead,
    as every synchronous sweep point is."""
    offset = mx.random.randint(0, vocab, token.shape, dtype=token.dtype)
    return (token + offset) % vocab


def rejection_sample(
    target_logits: mx.array, draft_logits: mx.array, draft_tokens: mx.array
) -> tuple[mx.array, mx.array]:
    """Accept a prefix of each row's draft and sample the token that follows it.

    Shapes: target_logits (B, gamma+1, V), draft_logits (B, gamma, V), draft_tokens (B, gamma).
    Draft token i is accepted with probability min(1, p_i/q_i); at the first rejection the next
    token comes from max(0, p - q) renormalised, and after a fully accepted draft from p_gamma.
    Returns (accepted counts (B,), next tokens (B,)).
    """
    batch, gamma = draft_tokens.shape
    p = mx.softmax(target_logits.astype(mx.float32), axis=-1)
    q = mx.softmax(draft_logits.astype(mx.float32), axis=-1)
    index = draft_tokens[..., None]
    p_draft = mx.take_along_axis(p[:, :gamma], index, axis=-1)[..., 0]
    q_draft = mx.take_along_axis(q, index, axis=-1)[..., 0]
    accept = mx.random.uniform(shape=(batch, gamma)) * q_draft < p_draft
    accepted = mx.cumprod(accept.astype(mx.int32), axis=1).sum(axis=1)
    residual = mx.maximum(p[:, :gamma] - q, 0.0)
    # Where p <= q everywhere the residual is zero; p itself is then the right distribution.
    residual = mx.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p[:, :gamma])
    choices = mx.concatenate([residual, p[:, gamma:]], axis=1)
    rows = mx.take_along_axis(choices, accepted[:, None, None], axis=1)[:, 0]
    next_tokens = mx.random.categorical(mx.log(rows + 1e-30), axis=-1)
    return accepted, next_tokens
