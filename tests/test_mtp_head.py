"""The emulated MTP head: its structure, the hidden state it drafts from, its price, and spec on it."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx.utils import tree_flatten

from mac_moesd.analysis import fit
from mac_moesd.cli import cli
from mac_moesd.inputs import models
from mac_moesd.measure.decoding.mtp_head import MTPHead
from mac_moesd.measure.decoding.sd_loop import Decoder
from test_fit import hand_fit_doc


@pytest.fixture(scope="module")
def target():
    built = models.build(models.resolve("tiny-moe"))
    built.materialise()
    return built.model


def test_the_head_is_one_decoder_layer_and_a_projection_sharing_the_targets_embedding(target):
    head = MTPHead(target)
    own = dict(tree_flatten(head.parameters()))
    assert {k.split(".")[0] for k in own} == {"layer", "eh_proj", "enorm", "hnorm", "norm"}
    copied = dict(tree_flatten(target.layers[-1].parameters()))
    assert {k.removeprefix("layer.") for k in own if k.startswith("layer.")} == set(copied)
    dims = target.args.hidden_size
    assert own["eh_proj.weight"].shape == (dims, 2 * dims)
    # the embedding and LM head are the target's (not copied into the head)
    assert not any("embed" in k or "lm_head" in k for k in own)
    assert len(head.make_cache()) == 1


def test_the_first_draft_of_a_round_reads_the_verify_hidden_state(target):
    head = MTPHead(target)
    tokens = mx.array(np.random.default_rng(0).integers(0, 256, (2, 9)))
    logits = head.capture(target)(tokens)
    assert mx.allclose(logits, target(tokens), atol=1e-5)  # the verify is the target's own
    assert mx.allclose(head._hidden, target.model(tokens)[:, -1:], atol=1e-6)
    step = head(tokens[:, -1:], cache=head.make_cache())
    assert step.shape == (2, 1, target.args.vocab_size) and head._hidden.shape == (2, 1, target.args.hidden_size)


def test_spec_loop_with_the_head_rolls_its_cache_back_like_a_drafters(target):
    head = MTPHead(target)
    vocab = target.args.vocab_size
    prompt = mx.array(np.random.default_rng(1).integers(0, vocab, (2, 30)))
    decoder = Decoder(target, head, prompt, random_tokens=vocab)
    out = decoder.speculative(16, 3, "emulated-acceptance", 0.7, rng=np.random.default_rng(0))
    emitted = out.outputs.shape[1]
    # the target holds the prompt and the emitted tokens; the head one token behind at most
    # (a round that accepted every draft feeds it the last one, as a drafter model is fed)
    assert decoder.target_cache[0].offset == decoder.context + emitted
    assert decoder.context + emitted - 1 <= decoder.draft_cache[0].offset <= decoder.context + emitted


def test_the_model_prices_a_drafter_step_timed_elsewhere_by_hand():
    # test_fit's hand-worked fit: T_T(n) = 0.95 + 0.05 n ms, nothing pipelined, no rejection.
    # A head step of 0.3 ms, gamma 2, alpha 0.5, batch 1, context 0: plain 1.0 ms, verify
    # T_T(3) = 1.1 ms, round 2 x 0.3 + 1.1 = 1.7 ms; Omega = (1 - 0.5^3) / 0.5 = 1.75 tokens.
    predictor = fit.speedup_predictor({**hand_fit_doc(), "drafted": False}, drafter=False)
    assert predictor(1, 2, 0.5, False, 0, draft_step=0.3e-3) == pytest.approx(1.75 * 1.0 / 1.7)
    assert fit.speedup_predictor({**hand_fit_doc(), "drafted": False}) is None


@pytest.mark.slow  # loads and times models end to end
def test_spec_with_the_head_records_it_and_refuses_what_it_cannot_measure(tmp_path):
    result = CliRunner().invoke(cli, ["spec", "tiny-moe", "--draft", "mtp-head", "--batch", "1", "--gamma", "2",
                                      "--tokens", "8", "--repeats", "2", "--budget", "0.2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "results.json").read_text())["spec"]["tiny-moe|mtp-head|emulated-acceptance"]
    assert doc["drafter_kind"] == "mtp-head" and doc["layers"]["draft"] == 1 and doc["valid"]
    (run,) = doc["runs"]
    assert run["drafter_kind"] == "mtp-head" and run["round"]["median_s"]["draft"] > 0
    assert set(run["rollback"]["rounds"]) == {"target", "draft"}
    refused = CliRunner().invoke(cli, ["spec", "tiny-moe", "--draft", "mtp-head", "--mode", "real",
                                       "--out", str(tmp_path)])
    assert refused.exit_code == 2 and "runs with --mode emulated-acceptance (--alpha) only" in refused.output
    nested = CliRunner().invoke(cli, ["spec", "tiny-mamba-moe", "--draft", "mtp-head", "--out", str(tmp_path)])
    assert nested.exit_code == 1 and "keeps caches for some layers only" in nested.output
    assert "Traceback" not in nested.output
