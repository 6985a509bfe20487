import json
import math

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mac_moesd.analysis import fit
from mac_moesd.measure.decoding import sampling
from mac_moesd.measure.sd import speedup
from mac_moesd.cli import cli
from mac_moesd.errors import BadInput

KEYS = {"batch", "gamma", "alpha", "mode", "measured_speedup", "predicted_speedup",
        "tokens_per_s_plain", "tokens_per_s_sd"}


def small(mode, **kw):
    args = dict(target="tiny-moe", draft="tiny-draft", batches=(1, 2), gammas=(2,), mode=mode,
                context=8, new_tokens=4, repeats=1)
    args.update(kw)
    return speedup.SpecConfig(**args)


@pytest.mark.slow  # loads and times models end to end
def test_self_draft_accepts_everything():
    doc = speedup.run_spec(small("self-draft"))
    assert doc["draft"] == "tiny-moe"
    for run in doc["runs"]:
        assert KEYS <= set(run)
        assert run["mode"] == "self-draft"
        assert run["mean_accepted"] == 2 and run["alpha"] == 1.0 and run["sigma"] == 1.0
        assert run["acceptance_by_position"] == [1.0, 1.0]
        # No fit: the prediction is the one from this stage's own timed forwards.
        assert run["predicted_by"]["model"] is None and run["predicted_from"] == "measured"
        assert run["predicted_speedup"] == run["predicted_by"]["measured"] > 0


@pytest.mark.slow  # loads and times models end to end
def test_emulated_acceptance_imposes_alpha_and_predicts_at_the_realised_one():
    calls = []

    def predictor(b, g, a, self_draft, context, **loop):
        calls.append((b, g, a, self_draft, context))
        return 1.5

    doc = speedup.run_spec(small("emulated-acceptance", alphas=(0.5,), new_tokens=16), predictor)
    # The predictor says 1.5 at every gamma, so gamma 1 (the first best) is timed beside gamma 2.
    assert [(r["batch"], r["gamma"], r["asked"], r["recommended"]) for r in doc["runs"]] == [
        (1, 2, True, False), (2, 2, True, False), (1, 1, False, True), (2, 1, False, True)]
    # Each run's prediction: the run's own context, not the fit's (the cache's mean length over
    # the decode, from the 8-token prompt to 8 + 16), at the acceptance the draws realised.
    for run in doc["runs"]:
        assert (run["batch"], run["gamma"], run["measured_alpha"], False, 16) in calls
        assert 0.0 <= run["measured_alpha"] <= 1.0 and run["predicted_by"]["model"] == 1.5
        assert run["rounds"] > 0 and len(run["acceptance_by_position"]) == run["gamma"]


@pytest.mark.slow  # loads and times models end to end
def test_real_mode_predicts_with_the_alpha_solved_from_accepted_length():
    calls = []

    def predictor(b, g, a, self_draft, context, **loop):
        calls.append(a)
        return 1.0

    doc = speedup.run_spec(small("real", batches=(1, 2), new_tokens=8), predictor)
    doc["runs"] = [r for r in doc["runs"] if r["asked"]]
    mlx_run, loop_run = doc["runs"]
    assert mlx_run["engine"] == "mlx-lm" and mlx_run["mode"] == "real"
    assert mlx_run["tokens_per_s_sd"] > 0
    for run in doc["runs"]:
        # gamma 2: L = a + a**2, so a = (sqrt(1 + 4L) - 1)/2 (the root in [0, 1])
        assert run["alpha"] == pytest.approx((math.sqrt(1 + 4 * run["mean_accepted"]) - 1) / 2)
        assert run["sigma"] == pytest.approx((run["mean_accepted"] + 1) / 3)
    for run in doc["runs"]:
        assert run["alpha"] in calls


def test_rejection_sample_accepts_identical_distributions():
    logits = mx.random.normal((3, 5, 32))
    tokens = mx.random.randint(0, 32, (3, 4))
    accepted, nxt = sampling.rejection_sample(logits, logits[:, :4], tokens)
    assert accepted.tolist() == [4, 4, 4]  # p == q: every draft token is accepted
    assert nxt.shape == (3,)


@pytest.mark.parametrize("kw", [dict(mode="nope"), dict(alphas=(1.0,)), dict(batches=(0,))])
def test_bad_spec_config(kw):
    with pytest.raises(BadInput):
        small("self-draft" if "mode" not in kw else kw.pop("mode"), **kw)


@pytest.mark.slow  # loads and times models end to end
def test_cli_spec_json(tmp_path, config_dir, monkeypatch):
    from mac_moesd.inputs import models

    # A folder drafter given as a path with a trailing slash: stored under its folder's name, the
    # key every other command (serving, the report) looks it up by.
    folder = config_dir(models.resolve("tiny-draft").config, "my-draft")
    resolved, resolve = [], models.resolve
    monkeypatch.setattr(models, "resolve", lambda model: resolved.append(model) or resolve(model))
    result = CliRunner().invoke(cli, ["spec", "tiny-moe", "--draft", f"{folder}/", "--batch", "1",
                                      "--gamma", "2", "--tokens", "4", "--repeats", "1",
                                      "--context", "8", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert KEYS <= set(doc["runs"][0])
    assert doc["runs"][0]["mode"] == "emulated-acceptance"
    assert "no fit of tiny-moe" in result.stderr
    assert doc["draft"] == "my-draft"
    assert list(json.loads((tmp_path / "results.json").read_text())["spec"]) == ["tiny-moe|my-draft|emulated-acceptance"]
    assert resolved == ["tiny-moe", f"{folder}/"]  # once each per command, the sources passed down


def test_a_runs_prediction_takes_the_acceptance_it_realised():
    assert fit.run_alpha({"alpha": 0.7, "measured_alpha": 0.59}) == 0.59
    assert fit.run_alpha({"alpha": 0.7, "measured_alpha": 0.0}) == 0.0  # none accepted is a measurement
    assert fit.run_alpha({"alpha": 0.7, "measured_alpha": None}) == 0.7
    assert fit.run_alpha({"alpha": None, "measured_alpha": None}) is None


def test_a_timed_runs_speedup_carries_the_range_over_its_pairs():
    from mac_moesd.measure.decoding.sd_loop import Decoded
    from mac_moesd.reporting.formatting import measured_speedup

    out = [Decoded(10)] * 3
    row = speedup.summarise_pairs(out, [1.0, 1.0, 1.0], out, [0.5, 1.0, 0.8],  # pair speedups 2, 1, 1.25
                               speedup.Precision(3, 0.03, 30.0))
    assert row["measured_speedup"] == pytest.approx(1.25)
    assert row["speedup_range"] == pytest.approx([1.0, 2.0])
    # Resamples of (2, 1, 1.25) have medians in [1, 2]; the 95% CI over 2000 of them spans both.
    assert row["measured_ci"] == [1.0, 2.0] and row["pairs"] == 3 and row["precision_met"] is False
    assert measured_speedup(row) == "1.25 [1.00-2.00] 3 pairs, budget spent"
    old_run = {k: v for k, v in row.items() if k not in ("measured_ci", "pairs", "precision_met")}
    assert measured_speedup({**old_run, "repeats": 3}) == "1.25 (1.00-2.00)"  # results made before CIs
    assert measured_speedup({"measured_speedup": 1.25, "repeats": 3}) == "1.25"  # results made before ranges


def test_mlx_lm_leaves_a_forward_queued_and_each_timed_run_waits_for_it_first(monkeypatch):
    """mlx-lm's generate_step queues the forward after the last token it yields: a prompt's
    forward plus one per yielded token, so 4 tokens make 5 forwards, the last never waited for.
    ``paired`` synchronises both streams after every preparation, before the clock starts."""
    from mlx_lm.generate import generate_step, generation_stream

    from mac_moesd.inputs import models

    built = models.build(models.resolve("tiny-moe"), None, None, None, seed=0)
    built.materialise()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return built.model(*args, **kwargs)

    from mlx_lm.models.cache import make_prompt_cache

    tokens = [t for t, _ in generate_step(mx.array([1]), counted, max_tokens=4,
                                          prompt_cache=make_prompt_cache(built.model))]
    assert len(tokens) == 4 and len(calls) == 5

    events = []
    monkeypatch.setattr(speedup.mx, "synchronize", lambda stream=None: events.append(
        "wait generation" if stream is generation_stream else "wait default"))
    from mac_moesd.measure.decoding.sd_loop import Decoded

    monkeypatch.setattr(speedup.Precision, "half_width", lambda self, speedups, ci=None: 0.0)  # two pairs, however timed
    speedup.paired(lambda: events.append("plain") or Decoded(1), lambda: events.append("sd") or Decoded(1),
                lambda i: events.append(f"prepare {i}"), speedup.Precision(2, 0.5, 60.0))
    ready = lambda i: [f"prepare {i}", "wait generation", "wait default"]  # noqa: E731
    assert events == [*ready(0), "plain", *ready(0), "sd",  # the warm-up pair
                      *ready(0), "plain", *ready(0), "sd", *ready(1), "plain", *ready(1), "sd",
                      "prepare None"]


def test_the_drafters_catch_up_is_evaluated_inside_the_timed_run():
    """Self-draft accepts every draft, so every round ends with the drafter's catch-up forward;
    after the decode returns, evaluating the drafter's cache must allocate nothing (nothing is
    left to compute)."""
    from mac_moesd.inputs import models
    from mac_moesd.measure.decoding.sd_loop import Decoder

    built = models.build(models.resolve("tiny-moe"), None, None, None, seed=0)
    built.materialise()
    decoder = Decoder(built.model, built.model, mx.random.randint(0, built.config["vocab_size"], (2, 9)))
    decoded = decoder.speculative(6, 2, "self-draft")
    assert set(decoded.per_round) == {2}
    assert decoded.verifies == 2 and decoded.tokens == 12  # 3 tokens a round per sequence, 6 needed
    mx.synchronize()
    mx.reset_peak_memory()
    mx.eval([c.state for c in decoder.draft_cache])
    assert mx.get_peak_memory() == 0


def test_a_round_synchronised_after_each_phase_names_its_phases_and_decodes_the_same():
    """``on_phase``: each round reports its phases in the loop's order, the catch-up step after a
    round that accepted every draft only, and the decode is the one the loop makes without it."""
    import numpy as np

    from mac_moesd.inputs import models
    from mac_moesd.measure.decoding.sd_loop import PHASES, Decoder

    built = models.build(models.resolve("tiny-moe"), None, None, None, seed=0)
    built.materialise()
    vocab = built.config["vocab_size"]
    prompt = mx.random.randint(0, vocab, (2, 9), key=mx.random.key(1))

    def decode(on_phase=None):
        mx.random.seed(3)
        decoder = Decoder(built.model, built.model, prompt, random_tokens=vocab)
        return decoder.speculative(12, 3, "emulated-acceptance", 0.7, rng=np.random.default_rng(0),
                                   on_phase=on_phase)

    names: list[str] = []
    phased, plain = decode(names.append), decode()
    assert phased.per_round == plain.per_round and np.array_equal(phased.outputs, plain.outputs)
    rounds, full = [], list(PHASES[:-1])
    while names:
        rounds.append(names[: len(PHASES) if names[len(full):len(full) + 1] == ["catch_up"] else len(full)])
        del names[: len(rounds[-1])]
    assert len(rounds) == phased.verifies and all(r[: len(full)] == full for r in rounds)
    caught_up = [len(r) == len(PHASES) for r in rounds]
    assert caught_up == [min(phased.per_round[2 * i: 2 * i + 2]) == 3 for i in range(len(rounds))]


def test_every_token_is_chosen_in_the_vocabulary_both_models_read():
    """A drafter padded four times wider than its target proposes ids the target has no
    embedding for; the loop (and mlx-lm's sampler, wrapped) chooses among the shared ids only."""
    from mac_moesd.inputs import models
    from mac_moesd.measure.decoding.sd_loop import Decoder

    target = models.build(models.resolve("tiny-moe"), None, None, None, seed=0)
    vocab = target.config["vocab_size"]
    wide = dict(models.resolve("tiny-draft").config, vocab_size=4 * vocab)
    draft = models.build(models.ModelSource("wide-draft", wide), None, None, None, seed=1)
    target.materialise()
    draft.materialise()
    prompt = mx.random.randint(0, vocab, (2, 9))
    assert int(mx.argmax(draft.model(prompt), axis=-1).max()) >= vocab  # unguarded, it would overrun
    decoder = Decoder(target.model, draft.model, prompt, vocab=vocab)
    decoded = decoder.speculative(8, 3, "real")
    assert decoded.outputs.max() < vocab
    decoder.reset()
    assert decoder.plain(8).outputs.max() < vocab
    # Emulated acceptance pays for rejection sampling over the same shared ids (a target with
    # weights decoding its prompts beside a drafter of another width: the shapes once clashed).
    decoder.reset()
    emulated = decoder.speculative(8, 3, "emulated-acceptance", alpha=0.5, rng=np.random.default_rng(0))
    assert emulated.outputs.max() < vocab
    logprobs = mx.zeros((1, 4 * vocab)).at[0, 3 * vocab].add(5.0)
    assert int(speedup.shared_sampler(0.0, vocab)(logprobs)[0]) < vocab
    assert int(speedup.shared_sampler(1.0, vocab)(logprobs)[0]) < vocab
