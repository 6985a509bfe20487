"""Save a built model as a local mlx-lm model folder (weights, config, tokenizer).

Lets mlx-lm's own tools (``mlx_lm.benchmark``, ``mlx_lm.generate``) and our loader run on a
random-weight model with no download. The tokenizer is a word-level one over ``t0 .. t{V-1}``:
enough for tools that need one, and its ids cover the whole vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from mlx_lm.utils import save_config, save_model

from mac_moesd.inputs.models import Built

__all__ = ["save_model_folder"]


def _word_tokenizer(vocab_size: int, folder: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", eos_token="t1", bos_token="t2")
    fast.save_pretrained(folder)


def save_model_folder(built: Built, folder: Path, tokenizer: bool = True) -> Path:
    """Write ``built`` (materialised) to ``folder`` so ``mlx_lm.load(folder)`` reads it back."""
    folder = Path(folder)
    save_model(folder, built.model)
    save_config(dict(built.config), folder / "config.json")
    if tokenizer:
        _word_tokenizer(built.config["vocab_size"], folder)
    return folder
