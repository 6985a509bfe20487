"""Prompt sets for measuring speculative decoding on a model with real weights.

``code`` (function stubs with docstrings in several languages), ``chat`` (open-ended requests),
``edit`` (a passage of code asked back with one small change, so that the answer repeats most of
its prompt) and ``quote`` (a passage, then a question answered by quoting it) ship with the
package, written for it; the last two are where prompt lookup drafts well. A user's FILE is either text, one prompt per
block of lines separated by blank lines, or JSONL (``.jsonl``) with a string ``prompt`` field on
every line. Prompts are tokenised with the model's tokenizer, through its chat template when it
has one (each prompt as one user message, with the generation prompt appended), as a chat
application would send them; else as plain text. Random token ids are for random-weight models
only: acceptance measured on them means nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from mac_moesd.errors import BadInput

__all__ = ["BUILTIN_SETS", "PromptSet", "load_prompts", "load_tokenizer", "tokenize"]

BUILTIN_SETS = ("code", "chat", "edit", "quote")


@dataclass(frozen=True)
class PromptSet:
    """Prompts and where they came from (a built-in set's name or the file's path)."""

    name: str
    prompts: tuple[str, ...]


def split_blocks(text: str) -> list[str]:
    """Blocks of lines separated by one or more blank (or whitespace-only) lines."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line.rstrip())
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def parse_jsonl(text: str, where: str) -> list[str]:
    """The ``prompt`` field of every non-blank line; a BadInput naming the first bad line."""
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadInput(f"{where} line {number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise BadInput(f"{where} line {number}: needs a JSON object with a string 'prompt' field")
        if record["prompt"].strip():
            prompts.append(record["prompt"])
    return prompts


def load_prompts(spec: str) -> PromptSet:
    """A built-in set (``BUILTIN_SETS``, unless a file of that name exists here) or a FILE."""
    path = Path(spec).expanduser()
    if spec in BUILTIN_SETS and not path.exists():
        text = resources.files("mac_moesd").joinpath(f"data/prompts/{spec}.txt").read_text()
        return PromptSet(spec, tuple(split_blocks(text)))
    if not path.is_file():
        known = ", ".join(BUILTIN_SETS)
        raise BadInput(f"prompt file not found: {spec} (built-in sets: {known})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise BadInput(f"cannot read prompt file {spec}: {err}") from None
    prompts = parse_jsonl(text, spec) if path.suffix == ".jsonl" else split_blocks(text)
    if not prompts:
        raise BadInput(f"{spec} holds no prompts")
    return PromptSet(str(path), tuple(prompts))


def load_tokenizer(folder: Path):
    """mlx-lm's TokenizerWrapper for a model folder, or None when the folder has no tokenizer."""
    folder = Path(folder)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json",
                                                      "tokenizer.model")):
        return None
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    from mac_moesd.inputs.models import mlx_lm_quiet

    with mlx_lm_quiet():
        return mlx_lm_load_tokenizer(folder)


def tokenize(prompt_set: PromptSet, tokenizer) -> list[list[int]]:
    """Token ids of every prompt: through the chat template when the tokenizer has one
    (``TokenizerWrapper.has_chat_template``, mlx_lm/tokenizer_utils.py), else plain encoding."""
    if getattr(tokenizer, "has_chat_template", False):
        encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                 add_generation_prompt=True)
                   for p in prompt_set.prompts]
    else:
        encoded = [tokenizer.encode(p) for p in prompt_set.prompts]
    ids = [list(map(int, e)) for e in encoded]
    if any(len(e) < 2 for e in ids):
        raise BadInput(f"a prompt of {prompt_set.name} tokenises to fewer than 2 tokens")
    return ids
