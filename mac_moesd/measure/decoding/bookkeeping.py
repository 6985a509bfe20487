"""The SD loop's own work a round besides its forwards: an "empty round", timed.

A round of speculative decoding is its forwards (drafts, verify), rejection sampling where the
loop runs it, the rollback, and the loop's own work: the target's token at every position from
the verify's logits, the round's one synchronisation, the acceptance decision and the next
pending and emitted tokens. That last part is timed here on stand-in arrays of a round's shapes,
through the functions the suite's loop calls (``sd_loop.accept``, ``advance``), beside each SD
pair (``round_parts``) and at every batch of a sweep with a drafter (``sweep.measure_reject``), so
that the fit prices it as a term of its own (``analysis.round_terms``). mlx-lm's batch-1
``speculative_generate_step`` is a closed generator whose round cannot be run empty: a replica of
its per-round Python stands in for it (``mlx_lm_bookkeeping``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from mac_moesd.measure.clock import timing
from mac_moesd.measure.decoding.sd_loop import accept, advance

__all__ = ["bookkeeping_point", "mlx_lm_bookkeeping"]


def _stand_ins(batch: int, gamma: int, vocab: int) -> tuple[mx.array, mx.array, mx.array]:
    """Evaluated arrays of a round's shapes: the verify's logits, the drafts, the pending token."""
    arrays = (mx.random.normal((batch, gamma + 1, vocab)), mx.random.randint(0, vocab, (batch, gamma)),
              mx.random.randint(0, vocab, (batch, 1)))
    mx.eval(*arrays)
    return arrays


def bookkeeping_point(batch: int, gamma: int, vocab: int, mode: str,
                      emit: Callable[[mx.array], mx.array]) -> timing.Point:
    """The suite's loop's empty round (see the module docstring): ``emit`` the decoder's choice of
    tokens from logits, then ``accept`` and ``advance`` as the loop calls them."""
    logits, drafts, pending = _stand_ins(batch, gamma, vocab)
    draws = np.random.default_rng(0)

    def run():
        chosen = emit(logits)
        accepted = accept(chosen, drafts, mode, 0.5, draws)
        _, kept, following, emitted = advance(pending, chosen, drafts, accepted)
        return [kept, following, *emitted]

    return timing.Point(run=run)


def mlx_lm_bookkeeping(gamma: int, vocab: int) -> timing.Point:
    """A replica of the per-round Python of mlx-lm 0.32's ``speculative_generate_step`` at batch 1
    (mlx_lm/generate.py), with the greedy sampler: the verify's log-probabilities and tokens, the
    one synchronisation, both token lists to Python, the comparison yielding token by token, and
    the next pending token (with the last draft when all were accepted). Faithful: the same array
    operations in the same order, on the shapes of a round; the trims are the rollback part."""
    logits, drafts, _ = _stand_ins(1, gamma, vocab)
    logits, drafts = logits[0], drafts[0].astype(mx.uint32)

    def rounds():
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1)
        mx.eval(tokens, drafts)
        draft_tokens, tokens = drafts.tolist(), tokens.tolist()
        n = 0
        while n < gamma:
            if tokens[n] != draft_tokens[n]:
                break
            n += 1
            yield tokens[n - 1], logprobs[n - 1], True
        yield tokens[n], logprobs[n], False
        following = mx.array([tokens[n]], mx.uint32)
        if n == gamma:
            following = mx.concatenate([mx.array(draft_tokens[-1:], mx.uint32), following])
        yield following

    return timing.Point(run=lambda: list(rounds())[-1])
