"""Acceptance of a real drafter on a prompt set, and the check that SD changes no output.

Untimed: every prompt is decoded on its own (batch 1, the suite's loop, which accepts as mlx-lm
does), so no prompt is cut to fit a batch. Per gamma and temperature it records the acceptance
as run (per-position rates, mean accepted length, sigma, alpha) and, at temperature > 0, both
rules' expected acceptance from the same target and drafter distributions: mlx-lm's (accept
when the target's sampled token equals the draft) and exact rejection sampling (min(1, p/q)),
with the ratio of their tokens per round, which is their speedup ratio at equal cost per round.
At temperature 0 each prompt is also decoded plainly (greedy), and every sequence whose SD
output differs is counted: on a CPU none may; on a GPU, float16 near-ties can flip an argmax
between a one-token step and a verify forward, so the rate is reported, not asserted.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mac_moesd.analysis import acceptance
from mac_moesd.measure.spec_loop import Decoder

__all__ = ["greedy_check", "measure_acceptance"]


def greedy_check(pairs) -> dict:
    """Compare SD outputs with plain greedy outputs, sequence by sequence, over the tokens both
    produced. ``pairs``: (sd, plain) arrays of shape (batch, tokens)."""
    sequences = mismatched = compared = 0
    first = []
    for sd, plain in pairs:
        n = min(sd.shape[1], plain.shape[1])
        for row_sd, row_plain in zip(sd[:, :n], plain[:, :n]):
            sequences += 1
            compared += n
            differs = np.flatnonzero(row_sd != row_plain)
            if differs.size:
                mismatched += 1
                first.append(int(differs[0]))
    return {"sequences": sequences, "tokens_compared": compared, "mismatched": mismatched,
            "mismatch_rate": mismatched / sequences if sequences else None,
            "first_mismatch_at": first}


def measure_acceptance(target, draft, prompt_ids: list[list[int]], gamma: int, temperature: float,
                       new_tokens: int, seed: int = 0) -> dict:
    """SD of ``new_tokens`` tokens after each prompt; see the module docstring for what it holds."""
    mx.random.seed(seed)
    counts: list[int] = []
    rules = {rule: ([], []) for rule in acceptance.RULES}
    pairs = []
    for ids in prompt_ids:
        decoder = Decoder(target, draft, mx.array([ids]))
        out = decoder.speculative(new_tokens, gamma, "real", temperature=temperature, rules=True)
        counts += out.per_round
        if temperature > 0:
            for rule, (token_probs, position_probs) in out.rule_probs.items():
                rules[rule][0].extend(token_probs)
                rules[rule][1].extend(position_probs)
        else:
            decoder.reset()
            pairs.append((out.outputs[:, :new_tokens], decoder.plain(new_tokens).outputs))
        del decoder
    entry = {
        "gamma": gamma, "temperature": temperature, "prompts_measured": len(prompt_ids),
        "new_tokens": new_tokens,
        "rule_run": "mlx-lm" if temperature > 0 else "greedy",
        "measured": acceptance.summarise_rounds(counts, gamma),
    }
    if temperature > 0:
        expected = {rule: acceptance.expected_rounds(*map(np.array, lists))
                    for rule, lists in rules.items()}
        entry["rules"] = expected
        # At equal cost per round, speedup scales with tokens per round (Omega).
        entry["rejection_over_mlx_lm"] = (acceptance.tokens_per_round(expected["rejection"])
                                          / acceptance.tokens_per_round(expected["mlx-lm"]))
    else:
        entry["greedy_check"] = greedy_check(pairs)
    return entry
