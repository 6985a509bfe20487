import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mac_moesd.inputs import localmodel, models, texts, zoo
from mac_moesd.measure.experts import routing
from mac_moesd.analysis import theory
from mac_moesd.cli import cli
from mac_moesd.errors import BadInput

MOE = [e for e in zoo.ZOO if zoo.expert_shape(e.config)]


def tiny_moe(seed=0, **overrides):
    config = zoo.miniature(zoo.by_name("tiny-moe").config, experts=16, top_k=2)
    config.update(overrides)
    built = models.build(models.ModelSource("tiny", config), seed=seed)
    built.materialise()
    return built


@pytest.mark.parametrize("entry", MOE, ids=lambda e: e.name)
def test_capture_leaves_logits_bit_identical(entry):
    built = models.build(models.ModelSource(entry.name, zoo.miniature(entry.config)))
    built.materialise()
    tokens = mx.random.randint(0, 256, (2, 6))
    plain = built.model(tokens)
    with routing.capture_routing(built.model) as sinks:
        captured = built.model(tokens)
    assert mx.array_equal(plain, captured).item()
    assert len(sinks) == built.footprint["moe_layers"]
    for sink in sinks:
        (indices,) = sink
        assert indices.size == 2 * 6 * built.footprint["top_k"]
    assert type(routing.switch_modules(built.model)[0]).__name__.startswith("Switch")


def window(batch: int, tokens: int, unique: float, spread: float, windows: int) -> dict:
    return {"batch": batch, "tokens": tokens, "measured_unique": unique, "std_unique": spread, "windows": windows}


def test_count_windows_by_hand():
    # one layer, two sequences of four tokens, top-1
    idx = np.array([[[[0], [0], [1], [2]], [[3], [3], [3], [4]]]])
    assert routing.count_windows(idx, 1, 2)["measured_unique"] == pytest.approx((1 + 2 + 1 + 2) / 4)
    assert routing.count_windows(idx, 2, 1)["measured_unique"] == pytest.approx((2 + 2 + 2 + 2) / 4)
    assert routing.count_windows(idx, 2, 4)["measured_unique"] == 5
    with pytest.raises(BadInput):
        routing.count_windows(idx, 3, 1)


def test_fit_recovers_a_known_correlation():
    E, K, c = 64, 4, 0.6
    windows = [window(1, t, float(theory.correlated_activated_experts(t, E, K, c)), 0.0, 1)
               for t in (1, 2, 4, 8, 16)]
    assert routing.analyse_windows(windows, E, K, 0.95)["correlation"] == pytest.approx(c, abs=1e-4)


def test_fit_on_cohere_window_gives_the_anchored_c():
    # Cohere: 128 experts top-8, 20.36 unique in a 4-token window (29.1 uniform). The anchored
    # form gives c ~ 0.56; the earlier N(c*t) form gave 0.67 on the same window.
    c = routing.analyse_windows([window(1, 4, 20.36, 0.0, 1)], 128, 8, 0.95)["correlation"]
    assert c == pytest.approx(0.561, abs=0.005)
    assert theory.correlated_activated_experts(1, 128, 8, c) == pytest.approx(8.0)


def uniform_unique_sd(experts, top_k, tokens, reps=4000, seed=0):
    """Standard deviation of the unique-expert count for i.i.d. uniform top-k routing."""
    rng = np.random.default_rng(seed)
    counts = [len(np.unique(np.concatenate([rng.choice(experts, top_k, replace=False)
                                            for _ in range(tokens)]))) for _ in range(reps)]
    return float(np.std(counts))


def test_random_weights_route_uniformly_across_sequences():
    built = tiny_moe()
    E, K = built.footprint["experts"], built.footprint["top_k"]
    tokens = mx.random.randint(0, 256, (64, 8))
    indices = routing.routed_indices(built.model, tokens)
    for batch in (2, 4, 8, 16):
        w = routing.count_windows(indices, batch, 1)
        samples = w["windows"] * indices.shape[0]
        tolerance = 4 * uniform_unique_sd(E, K, batch) / np.sqrt(samples)
        assert abs(w["measured_unique"] - theory.activated_experts(batch, E, K)) < tolerance


def test_correlated_routing_by_construction_raises_the_threshold():
    built = tiny_moe()
    # Each token repeated 8 times: the router sees a slowly varying input.
    runs = np.repeat(np.random.default_rng(0).integers(0, 256, (16, 8)), 8, axis=1)
    indices = routing.routed_indices(built.model, mx.array(runs))
    doc = routing.routing_document(indices, 16, 2, (1, 2), (1, 2, 4, 8), 0.95)
    assert doc["correlation"] < 0.5
    assert doc["threshold_corrected"] > 2 * doc["threshold_uniform"]


def test_saved_model_with_tokenizer_routes_text(tmp_path):
    config = zoo.miniature(zoo.by_name("tiny-moe").config, experts=16, top_k=2)
    built = models.build(models.ModelSource("m", config))
    built.materialise()
    folder = localmodel.save_model_folder(built, tmp_path / "saved")
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"t{i % 256}" for i in range(3000)))
    doc = routing.run_routing(routing.RoutingConfig(model=str(folder), text=str(text),
                                                    batches=(1, 2), tokens=(1, 2), length=16), None)
    assert doc["token_ids"] == "tokenizer"
    assert doc["windows"][0]["measured_unique"] == 2.0  # one token: exactly K experts


def test_builtin_texts():
    assert len(texts.builtin_text("code")) > 100_000
    assert "ferry" in texts.builtin_text("prose")
    assert texts.hashed_tokens("a b a", 1000)[0] == texts.hashed_tokens("a", 1000)[0]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_cli_routing_json(tmp_path):
    result = invoke("routing", "tiny-moe", "--batch", "1,4", "--tokens", "1,2,4", "--length", "16",
                    "--out", tmp_path, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    for key in ("model", "experts", "top_k", "windows", "correlation", "threshold_uniform",
                "threshold_corrected"):
        assert key in doc
    for w in doc["windows"]:
        assert {"batch", "tokens", "measured_unique", "uniform_unique"} <= set(w)
    assert doc["threshold_uniform"] == 47
    assert "routing" in json.loads((tmp_path / "results.json").read_text())


def test_cli_routing_empty_text(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    result = invoke("routing", "tiny-moe", "--text", empty, "--out", tmp_path)
    assert result.exit_code == 2
    assert "holds no text" in result.stderr


def test_reanalyse_redoes_the_fits_from_stored_windows():
    E, K, c = 64, 4, 0.45
    windows = [window(b, t, float(theory.activated_experts(
        theory.correlated_tokens(b, 0.95) * theory.correlated_tokens(t, c), E, K)), 0.0, 4)
        for b in (1, 2, 4) for t in (1, 2, 4, 8)]
    doc = routing.analyse_windows(windows, E, K, 0.95)
    assert doc["correlation"] == pytest.approx(c, abs=1e-3)
    stale = {**doc, "correlation": 0.3, "threshold_corrected": 1}
    assert routing.reanalyse(stale) == doc
