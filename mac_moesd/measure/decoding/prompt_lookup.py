"""Prompt lookup (n-gram drafting): draft tokens copied from the context, with no model.

The rule (docs/design.md §4.8): for n from ``max_ngram`` down to ``min_ngram``, find the most
recent earlier occurrence of the context's last n tokens (prompt and emitted tokens) that is
followed by at least one token, and propose up to gamma of the tokens that followed it. No
occurrence at any n: the round proposes nothing and is a plain step of the target.

Its cost is host time only (the search over a sequence's tokens), timed inside the round that
pays it; at a batch, each sequence searches its own context.
"""

from __future__ import annotations

import numpy as np

from mac_moesd.results import schema

__all__ = ["PromptLookup", "lookup_rule", "propose"]


def lookup_rule(max_ngram: int = 3, min_ngram: int = 1) -> schema.LookupRule:
    """The n-gram lengths tried, longest first."""
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError("--lookup-min-ngram must be >= 1 and <= --lookup-max-ngram")
    return {"max_ngram": max_ngram, "min_ngram": min_ngram}


def propose(context: np.ndarray, gamma: int, rule: schema.LookupRule | None = None) -> np.ndarray:
    """Up to ``gamma`` tokens that followed the most recent earlier occurrence of the longest
    n-gram ending ``context`` (1-D) that occurred before; empty when none did."""
    rule = rule or lookup_rule()
    length = context.shape[0]
    for n in range(min(rule["max_ngram"], length - 1), rule["min_ngram"] - 1, -1):
        # Windows starting at 0 .. length-n-1: each is followed by at least one token.
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == context[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start : start + gamma]
    return context[:0]


class PromptLookup:
    """Each sequence's context (prompt, then what the loop emits) and its proposals per round."""

    def __init__(self, prompts: np.ndarray, rule: schema.LookupRule | None = None):
        self.rule = rule or lookup_rule()
        self.initial = [np.asarray(row, dtype=np.int64) for row in prompts]
        self.contexts = list(self.initial)

    def reset(self) -> None:
        self.contexts = list(self.initial)

    def propose(self, gamma: int) -> list[np.ndarray]:
        return [propose(context, gamma, self.rule) for context in self.contexts]

    def extend(self, tokens: np.ndarray) -> None:
        """Append what the round emitted for every sequence (batch, n)."""
        self.contexts = [np.concatenate([c, row.astype(np.int64)]) for c, row in zip(self.contexts, tokens)]
