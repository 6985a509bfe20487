"""tools/train_tiny_pair.py, run for a few steps: it writes folders mlx-lm opens."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mac_moesd.inputs import models, prompts

SCRIPT = Path(__file__).parents[1] / "tools" / "train_tiny_pair.py"


@pytest.mark.slow
def test_a_few_steps_write_a_pair_mlx_lm_loads(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--steps", "3", "--draft-steps", "2",
                           "--corpus-chars", "150000"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""  # progress and losses go to stderr
    record = json.loads((tmp_path / "training.json").read_text())
    assert record["steps"] == 3 and record["draft_steps"] == 2 and record["target_train_ce"] > 0
    encoded = []
    for name, model_type in (("target", "mixtral"), ("draft", "llama")):
        folder = tmp_path / name
        model, tokenizer = mlx_lm.load(str(folder))
        assert model.model_type == model_type and tokenizer.has_chat_template
        encoded.append(tokenizer.encode("def f(x):\n    return x"))
        # The suite builds it like any model folder (float32 on this CPU) and runs a forward.
        built = models.build(models.resolve(str(folder)))
        built.materialise()
        logits = built.model(mx.array([encoded[-1]]))
        assert logits.shape == (1, len(encoded[-1]), built.config["vocab_size"])
    assert encoded[0] == encoded[1]  # one tokenizer
    assert prompts.tokenize(prompts.load_prompts("chat"), prompts.load_tokenizer(tmp_path / "target"))
