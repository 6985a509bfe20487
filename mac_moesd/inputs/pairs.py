"""Known public MoE targets with a drafter of the same tokenizer, and finding one already cached.

`mac-moesd run` on a GPU with no --target measures the first of these pairs that is complete in
the local Hugging Face cache and fits in memory; nothing is downloaded. Each drafter shares its
target's tokenizer and vocabulary (mlx-lm's speculative decoding compares token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mac_moesd.inputs import hfcache

__all__ = ["KNOWN_PAIRS", "KnownPair", "Search", "find_cached_pair"]


@dataclass(frozen=True)
class KnownPair:
    target: str
    draft: str
    source: str  # where the repo ids are published


def _hub(repo: str) -> str:
    return f"https://huggingface.co/{repo}"


# Largest first: the first that is cached and fits is measured. Qwen3 MoE and dense models share
# a vocabulary of 151936 (their config.json); so do Qwen1.5-MoE and Qwen1.5-0.5B.
KNOWN_PAIRS: tuple[KnownPair, ...] = (
    KnownPair("mlx-community/Qwen3-30B-A3B-4bit", "mlx-community/Qwen3-0.6B-4bit",
              _hub("mlx-community/Qwen3-0.6B-4bit")),
    KnownPair("mlx-community/Qwen3-30B-A3B-Instruct-2507-4bit", "mlx-community/Qwen3-0.6B-4bit",
              _hub("mlx-community/Qwen3-30B-A3B-Instruct-2507-4bit")),
    KnownPair("mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit", "mlx-community/Qwen3-0.6B-4bit",
              _hub("mlx-community/Qwen3-Coder-30B-A3B-Instruct-4bit")),
    KnownPair("mlx-community/Qwen1.5-MoE-A2.7B-Chat-4bit", "mlx-community/Qwen1.5-0.5B-Chat-4bit",
              _hub("mlx-community/Qwen1.5-MoE-A2.7B-Chat-4bit")),
)


@dataclass(frozen=True)
class Search:
    """What the search found (``pair`` None: nothing usable), and why each candidate was passed over."""

    pair: KnownPair | None
    cache: str
    passed_over: dict[str, str]

    def to_dict(self) -> dict:
        return {"target": self.pair.target if self.pair else None,
                "draft": self.pair.draft if self.pair else None,
                "cache": self.cache, "passed_over": dict(self.passed_over)}


def find_cached_pair(fits: Callable[[str, str], str | None],
                     candidates: tuple[KnownPair, ...] = KNOWN_PAIRS) -> Search:
    """The first candidate whose target and drafter are complete in the cache and for which
    ``fits(target, draft)`` returns None (it returns the reason when they do not fit)."""
    root = hfcache.cache_root()
    passed: dict[str, str] = {}
    for pair in candidates:
        label = f"{pair.target} + {pair.draft}"
        missing = [r for r in (pair.target, pair.draft) if hfcache.cached_model(r, root) is None]
        if missing:
            passed[label] = "not in the cache: " + ", ".join(missing)
            continue
        reason = fits(pair.target, pair.draft)
        if reason is None:
            return Search(pair, str(root), passed)
        passed[label] = reason
    return Search(None, str(root), passed)
