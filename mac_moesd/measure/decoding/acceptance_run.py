"""Acceptance of a real drafter on a prompt set, and the check that SD changes no output.

Untimed: every prompt is decoded on its own (batch 1, the suite's loop, which accepts as mlx-lm
does), so no prompt is cut to fit a batch. Per gamma and temperature it records the acceptance
as run (per-position rates, mean accepted length, sigma, alpha) and, at temperature > 0, both
rules' expected acceptance from the same target and drafter distributions: mlx-lm's (accept
when the target's sampled token equals the draft) and exact rejection sampling (min(1, p/q)),
with the ratio of their tokens per round, which is their speedup ratio at equal cost per round.
At temperature 0 each prompt is also decoded plainly (greedy), and every sequence whose SD
output differs is counted, with the target's margin (top-1 minus top-2 logit, under plain
decoding) where it first differs. A difference at a float near-tie (``NEAR_TIE``) is rounding:
a float16 argmax can flip between a one-token step and a verify forward. Any other difference
means the SD loop decoded from another context than plain decoding did (a rollback that failed,
a skipped token): the check is then invalid, and so is the run.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mac_moesd.analysis import acceptance
from mac_moesd.results import schema
from mac_moesd.measure.decoding.sd_loop import Decoder, RuleProbs

__all__ = ["NEAR_TIE", "greedy_check", "logit_margin", "measure_acceptance"]

# A margin at most this fraction of the top logit's magnitude (at least 1) is a float near-tie:
# a few units in the last place of the dtype the logits come out in (float16 has 11 significant
# bits, 2^-11 = 4.9e-4; bfloat16 8, 2^-8 = 3.9e-3), times the rounding a forward accumulates over
# its layers and that two chunkings of the same tokens do not share.
NEAR_TIE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 4e-2}


def logit_margin(model, prompt: mx.array, decoded: np.ndarray, position: int,
                 vocab: int | None = None) -> tuple[float, bool]:
    """The target's top-1 minus top-2 logit for the token at ``position`` of a plain greedy
    decode ``decoded`` after ``prompt`` (1-D), among the first ``vocab`` ids (the decode's
    choices), and whether that margin is a near-tie."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.concatenate([prompt, mx.array(decoded[:position], dtype=prompt.dtype)])
    logits = model(tokens[None], cache=make_prompt_cache(model))[0, -1, :vocab]
    top = mx.sort(logits.astype(mx.float32))[-2:]
    first, second = float(top[1]), float(top[0])
    margin = first - second
    return margin, margin <= NEAR_TIE.get(logits.dtype, NEAR_TIE[mx.float32]) * max(1.0, abs(first))


def greedy_check(pairs, margin_of=None) -> schema.GreedyCheck:
    """Compare SD outputs with plain greedy outputs, sequence by sequence, over the tokens both
    produced. ``pairs``: (sd, plain) arrays of shape (batch, tokens); ``margin_of(pair, row,
    position)``: ``logit_margin`` of that sequence (None: mismatches are not explained, and
    make the check invalid). Per mismatched sequence, in order: where it first differs, the
    margin there and whether it is a near-tie; ``valid`` when every mismatch is a near-tie."""
    sequences = mismatched = compared = 0
    first, margins, near_ties = [], [], []
    for index, (sd, plain) in enumerate(pairs):
        n = min(sd.shape[1], plain.shape[1])
        for row, (row_sd, row_plain) in enumerate(zip(sd[:, :n], plain[:, :n])):
            sequences += 1
            compared += n
            differs = np.flatnonzero(row_sd != row_plain)
            if differs.size:
                mismatched += 1
                first.append(int(differs[0]))
                margin, tie = margin_of(index, row, int(differs[0])) if margin_of else (None, False)
                margins.append(margin)
                near_ties.append(bool(tie))
    return {"sequences": sequences, "tokens_compared": compared, "mismatched": mismatched,
            "mismatch_rate": mismatched / sequences if sequences else None,
            "first_mismatch_at": first, "margin": margins, "near_tie": near_ties,
            "valid": all(near_ties)}


def measure_acceptance(target, draft, prompt_ids: list[list[int]], gamma: int, temperature: float,
                       new_tokens: int, seed: int = 0, rollback: str = "auto", vocab: int | None = None,
                       lookup: schema.LookupRule | None = None) -> dict:
    """SD of ``new_tokens`` tokens after each prompt, every token among the first ``vocab`` ids
    (``Decoder``); see the module docstring for what it holds. With ``lookup`` (``draft``
    None), drafted by prompt lookup: its drafts have no distribution of their own, so at
    temperature > 0 only the rule as run is recorded (under exact rejection sampling a
    deterministic draft is accepted with the target's p(x), which is what mlx-lm's rule gives)."""
    mx.random.seed(seed)
    counts: list[int] = []
    offered: list[int] | None = [] if lookup is not None else None
    rules: RuleProbs = {rule: ([], []) for rule in acceptance.RULES}
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    prompts: list[mx.array] = []
    for ids in prompt_ids:
        decoder = Decoder(target, draft, mx.array([ids]), rollback=rollback, vocab=vocab, lookup=lookup)
        out = decoder.speculative(new_tokens, gamma, "real", temperature=temperature, rules=lookup is None)
        counts += out.per_round
        if offered is not None:
            assert out.proposed is not None  # a lookup decode records its proposals
            offered += out.proposed
        if temperature > 0:
            for rule, (token_probs, position_probs) in (out.rule_probs or {}).items():
                rules[rule][0].extend(token_probs)
                rules[rule][1].extend(position_probs)
        else:
            assert out.outputs is not None
            sd_out = out.outputs[:, :new_tokens]
            decoder.reset()
            plain_out = decoder.plain(new_tokens).outputs
            assert plain_out is not None
            pairs.append((sd_out, plain_out))
            prompts.append(mx.array(ids))
        del decoder
    entry: dict[str, Any] = {
        "gamma": gamma, "temperature": temperature, "prompts_measured": len(prompt_ids),
        "new_tokens": new_tokens,
        "rule_run": "mlx-lm" if temperature > 0 else "greedy",
        "measured": acceptance.summarise_rounds(counts, gamma, offered),
    }
    if offered is not None:
        entry["proposal_rate"] = sum(1 for n in offered if n) / len(offered)
    if temperature > 0 and lookup is None:
        expected = {rule: acceptance.expected_rounds(*map(np.array, lists))
                    for rule, lists in rules.items()}
        entry["rules"] = expected
        # At equal cost per round, speedup scales with tokens per round (Omega).
        entry["rejection_over_mlx_lm"] = (acceptance.tokens_per_round(expected["rejection"])
                                          / acceptance.tokens_per_round(expected["mlx-lm"]))
    else:
        entry["greedy_check"] = greedy_check(
            pairs, lambda i, row, at: logit_margin(target, prompts[i], pairs[i][1][row], at, vocab))
    return entry
