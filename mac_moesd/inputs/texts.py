"""The text a routing run sends through a model, as token ids: a built-in sample (the Python
standard library's sources, or prose written for this project), a file or folder of the
user's, a prompt set (one sequence per prompt), or random ids; through the model's tokenizer,
else each word hashed into the vocabulary."""

from __future__ import annotations

import contextlib
import random
import sys
import zlib
from importlib import resources
from pathlib import Path

from mac_moesd.errors import BadInput
from mac_moesd.inputs.prompts import load_prompts

__all__ = ["BUILTIN_SOURCES", "builtin_text", "hashed_tokens", "load_text", "prompt_rows", "read_text",
           "token_source"]

BUILTIN_SOURCES = ("code", "prose")


def builtin_text(name: str, limit_chars: int = 400_000) -> str:
    """'code': the Python standard library's own sources; 'prose': text written for this project."""
    if name == "prose":
        return resources.files("mac_moesd").joinpath("data/prose.txt").read_text()
    if name == "code":
        stdlib = Path(contextlib.__file__).parent
        parts, size = [], 0
        for path in sorted(stdlib.glob("*.py")):
            text = path.read_text(errors="replace")
            parts.append(text)
            size += len(text)
            if size >= limit_chars:
                break
        return "\n".join(parts)
    raise BadInput(f"unknown built-in text {name!r} (known: {', '.join(BUILTIN_SOURCES)})")


def read_text(path: Path) -> str:
    """A text file, or every file in a directory, concatenated."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        text = "\n".join(p.read_text(errors="replace") for p in files)
    elif path.is_file():
        text = path.read_text(errors="replace")
    else:
        raise BadInput(f"text file not found: {path}")
    if not text.strip():
        raise BadInput(f"{path} holds no text")
    return text


def hashed_tokens(text: str, vocab: int) -> list[int]:
    """Token ids for a model without a tokenizer: each whitespace word hashed into the vocabulary."""
    return [zlib.crc32(word.encode()) % vocab for word in text.split()]


def token_source(text: str | None, tokenizer, vocab: int, needed: int, seed: int) -> tuple[list[int], str]:
    """Enough token ids, and how they were made ('tokenizer', 'hashed' or 'random')."""
    if text is None:
        rng = random.Random(seed)
        return [rng.randrange(vocab) for _ in range(needed)], "random"
    ids = tokenizer.encode(text) if tokenizer is not None else hashed_tokens(text, vocab)
    how = "tokenizer" if tokenizer is not None else "hashed"
    if len(ids) < needed:
        raise BadInput(f"the text gives {len(ids)} tokens; this routing grid needs {needed}")
    return ids, how


def load_text(spec: str | None) -> tuple[str | None, str]:
    """The text to route, and a description of where it came from."""
    if spec is None:
        return None, "random token ids"
    if spec in BUILTIN_SOURCES and not Path(spec).exists():
        where = {"code": f"Python {sys.version.split()[0]} standard library sources",
                 "prose": "built-in prose sample"}[spec]
        return builtin_text(spec), where
    return read_text(Path(spec)), str(spec)


def prompt_rows(spec: str, tokenizer, vocab: int, length: int) -> tuple[list[list[int]], str]:
    """One sequence per prompt of the set: its first ``length`` tokens, and how ids were made.

    The prompt's own text, without the chat template or special tokens: their fixed tokens would
    open every sequence alike and make independent sequences look correlated. Prompts shorter
    than ``length`` tokens are left out (the document says how many were routed)."""
    prompt_set = load_prompts(spec)
    if tokenizer is not None:
        encoded = [list(tokenizer.encode(p, add_special_tokens=False)) for p in prompt_set.prompts]
        how = "tokenizer"
    else:
        encoded = [hashed_tokens(p, vocab) for p in prompt_set.prompts]
        how = "hashed"
    rows = [ids[:length] for ids in encoded if len(ids) >= length]
    if len(rows) < 2:
        raise BadInput(f"{len(rows)} prompt(s) of {prompt_set.name} have {length} tokens or more; "
                       "routing needs two: a shorter --length, or longer prompts")
    return rows, how
