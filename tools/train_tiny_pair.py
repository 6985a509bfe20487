"""Train the tiny trained MoE/drafter pair the tests use, reproducibly, on this CPU.

    python tools/train_tiny_pair.py tests/data/tiny-pair

writes ``OUTDIR/target`` (mlx-lm ``mixtral``: 2 layers, hidden 64, 16 experts top-2) and
``OUTDIR/draft`` (mlx-lm ``llama``: 1 layer, hidden 64), each in mlx-lm's format (config.json,
model.safetensors in float16, tokenizer.json, tokenizer_config.json with a small chat template),
so ``mlx_lm.load(OUTDIR/target)`` opens it. Both share one byte-level BPE tokenizer (1024 ids)
trained with the ``tokenizers`` library on the Python standard library's own ``*.py`` sources, the
text every Python install has offline. The MoE is trained on that text with a small load-balancing
loss (Switch Transformer, Fedus et al., arXiv 2101.03961, section 2.2) so that all experts stay in use;
the drafter on the same text, half next-token cross-entropy and half distillation from the trained
target (KL(p_target || q_draft)), so it agrees with the target often but not always: SD acceptance
lands strictly between 0 and 1.

Seeded (``--seed``, default 0): the same Python version (its standard library is the corpus) and
MLX version give the same pair. Defaults: 1000 target steps, 600 drafter steps, batch 16 x 128
tokens, AdamW with linear warm-up and cosine decay.

The committed pair (``tests/data/tiny-pair``, 2.2 MB) came from the command above with the
defaults (seed 0, 1000 target and 600 drafter steps, the first 3,000,000 characters of the
sorted sources: 1,087,934 tokens, 2.76 characters per token), Python 3.11.7 and MLX 0.32.4 with
OpenBLAS: 7.3 minutes of CPU time (16 minutes wall on a 2-core machine shared with other jobs);
a second run gave bit-identical files. Losses reached (cross-entropy in nats per token; the mean
of the last 50 steps, then on the held-out last 5% of the corpus): target 3.165 / 3.752, drafter
3.648 / 4.050 (its cross-entropy part). ``OUTDIR/training.json`` records them; the script prints
them on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import mac_moesd  # noqa: F401  (loads OpenBLAS before mlx on Linux)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map
from mlx_lm.models import llama, mixtral
from mlx_lm.utils import save_config, save_model

VOCAB = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
# A minimal chat template in the usual Jinja form, so prompt sets exercise the chat-template path.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SEQ_LEN = 128
BATCH = 16

TARGET_CONFIG = {
    "model_type": "mixtral", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 16, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
}
DRAFT_CONFIG = {
    "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def corpus(limit_chars: int) -> str:
    """The first ``limit_chars`` of the standard library's top-level ``*.py`` files, sorted by name."""
    stdlib = Path(contextlib.__file__).parent
    parts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        parts.append(path.read_text(errors="replace"))
        size += len(parts[-1])
        if size >= limit_chars:
            break
    return "\n".join(parts)[:limit_chars]


def train_tokenizer(text: str, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([text], trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token=None)
    fast.save_pretrained(folder)
    # The class name every transformers version knows (5.x writes its own new name), and the chat
    # template inside tokenizer_config.json, where versions before chat_template.jinja look.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    config.pop("backend", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def batches(ids: np.ndarray, rng: np.random.Generator):
    """Endless (inputs, targets) batches of random windows of the token stream."""
    while True:
        starts = rng.integers(0, len(ids) - SEQ_LEN - 1, BATCH)
        windows = np.stack([ids[s : s + SEQ_LEN + 1] for s in starts])
        yield mx.array(windows[:, :-1]), mx.array(windows[:, 1:])


class RecordedGate(nn.Linear):
    """A router that keeps its logits for the load-balancing loss (same parameters as nn.Linear)."""

    outputs: list = []  # class-level: a list attribute on a module would count as a child

    def __call__(self, x: mx.array) -> mx.array:
        logits = super().__call__(x)
        RecordedGate.outputs.append(logits)
        return logits


def balance_loss(logits: mx.array, experts: int, top_k: int) -> mx.array:
    """Switch Transformer's auxiliary loss, generalised to top-k: E * sum_i f_i P_i, with f_i the
    fraction of routed slots that go to expert i and P_i its mean router probability."""
    probs = mx.softmax(logits.reshape(-1, experts), axis=-1)
    chosen = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[:, :top_k]
    counts = (chosen[..., None] == mx.arange(experts)).sum(axis=(0, 1))
    fraction = mx.stop_gradient(counts / chosen.size)
    return experts * (fraction * probs.mean(axis=0)).sum()


def schedule(steps: int, peak: float):
    warmup = max(1, steps // 20)
    return optim.join_schedules([optim.linear_schedule(peak / 20, peak, warmup),
                                 optim.cosine_decay(peak, steps - warmup, peak / 20)], [warmup])


def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


def train(model, loss_fn, steps: int, lr: float, data, label: str, log) -> list[float]:
    optimizer = optim.AdamW(learning_rate=schedule(steps, lr), weight_decay=0.01)
    grad_fn = nn.value_and_grad(model, loss_fn)

    def step(inputs, targets):
        (_, ce), grads = grad_fn(inputs, targets)
        optimizer.update(model, grads)
        return ce

    history = []
    start = time.perf_counter()
    for i in range(steps):
        inputs, targets = next(data)
        ce = step(inputs, targets)
        mx.eval(model.state, optimizer.state)
        history.append(ce.item())
        if (i + 1) % max(1, steps // 10) == 0 or i + 1 == steps:
            log(f"{label} step {i + 1}/{steps}: cross-entropy {np.mean(history[-50:]):.3f} "
                f"({time.perf_counter() - start:.0f} s)")
    return history


def heldout_loss(model, ids: np.ndarray) -> float:
    windows = [ids[s : s + SEQ_LEN + 1] for s in range(0, len(ids) - SEQ_LEN - 1, SEQ_LEN)][:64]
    w = mx.array(np.stack(windows))
    return cross_entropy(model(w[:, :-1]), w[:, 1:]).item()


def save(model, config: dict, tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.update(tree_map(lambda a: a.astype(mx.float16), model.parameters()))
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config({**config, "torch_dtype": "float16"}, folder / "config.json")
    save_tokenizer(tokenizer, folder)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--steps", type=int, default=1000, help="target training steps")
    parser.add_argument("--draft-steps", type=int, default=600, help="drafter training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-chars", type=int, default=3_000_000)
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    text = corpus(args.corpus_chars)
    tokenizer = train_tokenizer(text, VOCAB)
    ids = np.array(tokenizer.encode(text).ids, dtype=np.int32)
    split = int(len(ids) * 0.95)  # the tail is held out
    train_ids, heldout_ids = ids[:split], ids[split:]
    log(f"corpus: {len(text)} chars, {len(ids)} tokens ({len(text) / len(ids):.2f} chars/token)")

    target = mixtral.Model(mixtral.ModelArgs.from_dict(TARGET_CONFIG))
    for layer in target.model.layers:
        moe = layer.block_sparse_moe
        gate = RecordedGate(moe.gate.weight.shape[1], moe.gate.weight.shape[0], bias=False)
        gate.weight = moe.gate.weight
        moe.gate = gate
    experts, top_k = TARGET_CONFIG["num_local_experts"], TARGET_CONFIG["num_experts_per_tok"]

    def target_loss(inputs, targets):
        RecordedGate.outputs.clear()
        ce = cross_entropy(target(inputs), targets)
        aux = sum(balance_loss(g, experts, top_k) for g in RecordedGate.outputs) / len(RecordedGate.outputs)
        return ce + 0.01 * aux, ce

    target_history = train(target, target_loss, args.steps, 3e-3, batches(train_ids, rng), "target", log)
    target.eval()

    draft = llama.Model(llama.ModelArgs.from_dict(DRAFT_CONFIG))

    def draft_loss(inputs, targets):
        logits = draft(inputs)
        ce = cross_entropy(logits, targets)
        teacher = mx.stop_gradient(mx.softmax(target(inputs), axis=-1))
        kl = (teacher * (mx.log(teacher + 1e-9) - nn.log_softmax(logits, axis=-1))).sum(-1).mean()
        return 0.5 * ce + 0.5 * kl, ce

    draft_history = train(draft, draft_loss, args.draft_steps, 3e-3, batches(train_ids, rng), "draft", log)
    draft.eval()

    figures = {
        "target_train_ce": float(np.mean(target_history[-50:])),
        "target_heldout_ce": heldout_loss(target, heldout_ids),
        "draft_train_ce": float(np.mean(draft_history[-50:])),
        "draft_heldout_ce": heldout_loss(draft, heldout_ids),
    }
    for line in (f"{k}: {v:.3f}" for k, v in figures.items()):
        log(line)
    save(target, TARGET_CONFIG, tokenizer, args.outdir / "target")
    save(draft, DRAFT_CONFIG, tokenizer, args.outdir / "draft")
    (args.outdir / "training.json").write_text(json.dumps(
        {"seed": args.seed, "steps": args.steps, "draft_steps": args.draft_steps,
         "corpus_chars": len(text), "tokens": int(len(ids)), "python": sys.version.split()[0],
         "mlx": mx.__version__, **figures}, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
