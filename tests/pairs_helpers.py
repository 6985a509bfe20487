"""Model pairs saved in mlx-lm's format by the tests themselves (never seen by the package)."""

from pathlib import Path

from mac_moesd.inputs import localmodel, models, zoo

BYTES = 256
SPECIALS = ["<|end|>", "<|user|>", "<|assistant|>"]


def byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer with no merges (one id per byte) and a small chat template, written
    with the `tokenizers` library; its ids fit a vocabulary of BYTES + len(SPECIALS)."""
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(folder)


def save(config: dict, folder: Path, seed: int, tokenizer: bool = True) -> Path:
    built = models.build(models.ModelSource(folder.name, config), seed=seed)
    built.materialise()
    localmodel.save_model_folder(built, folder, tokenizer=False)
    if tokenizer:
        byte_tokenizer(folder)
    return folder


def qwen2_pair(root: Path, hidden: int = 64, layers: int = 2) -> tuple[Path, Path]:
    """A Qwen1.5-MoE-shaped target (shared expert, 8 experts top-2) and a Qwen2 drafter sharing a
    byte-level tokenizer, random weights, in mlx-lm's format."""
    vocab = BYTES + len(SPECIALS)
    target = zoo.miniature(zoo.by_name("qwen1.5-moe-a2.7b").config, layers=layers, experts=8, top_k=2)
    draft = zoo.miniature(zoo.by_name("qwen2-0.5b").config, layers=1)
    for config in (target, draft):
        config.update(vocab_size=vocab, hidden_size=hidden)
    return save(target, root / "my-moe", seed=1), save(draft, root / "my-draft", seed=2)
