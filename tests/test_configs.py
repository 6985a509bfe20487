"""Configs as published: nested (``text_config``) ones, layer patterns without a layer count,
slices of hybrids that keep a layer of every kind, and random routers that route."""

import mlx.core as mx
import pytest
from conftest import TINY_BUDGET

from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs import models, zoo
from mac_moesd.results import ResultsStore
from mac_moesd.measure.forward import sweep


def nested_only(config: dict) -> dict:
    """A multimodal checkpoint's config as shipped: the text model's fields only under
    ``text_config``, beside a vision tower's."""
    return {"model_type": config["model_type"], "text_config": config["text_config"],
            "vision_config": {"depth": 2, "hidden_size": 64}, "tie_word_embeddings": False}


@pytest.mark.slow  # loads and times models end to end
def test_a_nested_config_is_read_and_swept(config_dir, tmp_path):
    folder = config_dir(nested_only(zoo.by_name("tiny-hybrid-moe").config))
    source = models.resolve(str(folder))
    assert source.config["num_hidden_layers"] == 4 and zoo.expert_shape(source.config) == (16, 2)
    store = ResultsStore(tmp_path / "r.json", {"chip_slug": "t", "backend": "cpu"})
    doc = sweep.run_sweep(sweep.SweepConfig(model=str(folder), batches=(1,), tokens=(1, 2), context=8,
                                            budget=TINY_BUDGET), store, None)
    assert doc["footprint"]["layer_kinds"] == {"attention": 1, "sliding": 0, "linear": 3, "per_position": 3,
                                               "moe": 4, "mlp": 0}


def test_a_layer_pattern_gives_the_layer_count(config_dir):
    config = {k: v for k, v in zoo.by_name("tiny-mamba-moe").config.items() if k != "num_hidden_layers"}
    source = models.resolve(str(config_dir(config)))
    assert source.config["num_hidden_layers"] == len(config["hybrid_override_pattern"]) == 8
    kinds = models.build(source).footprint["layer_kinds"]
    assert kinds == {"attention": 1, "sliding": 0, "linear": 3, "per_position": 3, "moe": 3, "mlp": 1}


def test_a_slice_cuts_the_pattern_and_the_layer_types():
    mamba = zoo.slice_config(zoo.by_name("tiny-mamba-moe").config, 4)
    assert (mamba["hybrid_override_pattern"], mamba["num_hidden_layers"]) == ("MEM*", 4)
    swa = zoo.slice_config(zoo.by_name("tiny-swa-moe").config, 2)
    assert swa["layer_types"] == ["sliding_attention", "full_attention"]
    hybrid = zoo.slice_config(zoo.by_name("tiny-hybrid-moe").config, 4)
    assert len(hybrid["text_config"]["layer_types"]) == 4 == hybrid["text_config"]["num_hidden_layers"]


@pytest.mark.parametrize("name, layers, fragment", [
    ("qwen3-next-80b-a3b", 2, "keeps no full-attention layer"),
    ("tiny-mamba-moe", 2, "lacks an attention (*) or a Mamba (M) block"),
])
def test_a_slice_without_every_kind_of_layer_is_refused(name, layers, fragment):
    with pytest.raises(MacMoesdError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        zoo.slice_config(zoo.by_name(name).config, layers)


def test_every_new_architecture_has_a_zoo_entry_with_its_published_dimensions():
    published = {"qwen3.6-35b-a3b": ("qwen3_5_moe", 256, 8, 40), "qwen3-next-80b-a3b": ("qwen3_next", 512, 10, 48),
                 "gpt-oss-120b": ("gpt_oss", 128, 4, 36), "glm-4.5-air": ("glm4_moe", 128, 8, 46),
                 "nemotron-3-nano-30b-a3b": ("nemotron_h", 128, 6, 52)}
    for name, (model_type, experts, top_k, layers) in published.items():
        entry = zoo.by_name(name)
        assert entry.source.startswith("https://huggingface.co/")
        assert (entry.model_type, *zoo.expert_shape(entry.config), entry.config["num_hidden_layers"]) == (
            model_type, experts, top_k, layers)


@pytest.mark.parametrize("name", ["tiny-mamba-moe", "deepseek-v2-lite", "glm-4.5-air"])
def test_random_routers_spread_tokens_over_the_experts(name, config_dir):
    """mlx-lm builds these routers as zeros (a checkpoint overwrites them): with random weights
    left at zero, every token would go to the same top-k experts."""
    built = models.build(models.resolve(str(config_dir(zoo.miniature(zoo.by_name(name).config)))), seed=0)
    built.materialise()
    gates = [m for _, m in built.model.named_modules() if type(m).__name__.endswith("Gate")]
    assert gates
    for gate in gates:
        assert mx.abs(gate.weight).max().item() > 0


@pytest.mark.parametrize("name, unit", [
    ("qwen3.6-35b-a3b", 4),  # full attention one layer in four (layer_types)
    ("qwen3-next-80b-a3b", 4),  # full_attention_interval 4
    ("gpt-oss-120b", 2),  # sliding and full attention alternate
    ("glm-4.5-air", 1),  # every layer alike
    ("tiny-mamba-moe", 7),  # "MEM*EM-E" has no period: its shortest start holding M, E, * and -
])
def test_a_slice_is_cut_in_whole_hybrid_periods(name, unit):
    assert zoo.slice_unit(zoo.normalise(zoo.by_name(name).config)) == unit


def test_slices_halve_in_whole_units():
    # 40 layers in periods of 4: 20, 8 (10 is not whole), 4, then no smaller slice
    assert [zoo.smaller_slice(n, 4) for n in (40, 20, 8, 4)] == [20, 8, 4, None]
    assert [zoo.smaller_slice(n, 1) for n in (24, 12, 3, 1)] == [12, 6, 1, None]


def test_a_hybrid_sweep_that_does_not_fit_is_sliced_to_whole_periods():
    from mac_moesd.measure.forward import sweep

    source = models.resolve("qwen3.6-35b-a3b")
    cfg = sweep.SweepConfig(model="qwen3.6-35b-a3b", batches=(1,), tokens=(1,), context=16, bits=4)
    eight = sweep.estimate_bytes(models.build(source, bits=4, layers=8), cfg)
    # where 8 layers fit and 20 do not: 4 and 8 (halving 40 layer by layer gave 2, which has no
    # full-attention layer and was refused)
    assert sweep.plan_layers(source, cfg, eight) == [4, 8]


def test_the_largest_slice_that_fits_halves_in_whole_units():
    tried = []

    def fits(n):
        tried.append(n)
        return n <= 10

    # 48 -> 24 -> 12 -> 4: half of 12 is 6, which is not whole units of 4, so 4.
    assert zoo.largest_slice(48, 4, fits) == 4 and tried == [48, 24, 12, 4]
    assert zoo.largest_slice(48, 4, lambda n: n <= 30) == 24
    assert zoo.largest_slice(48, 4, lambda n: True) == 48
    assert zoo.largest_slice(48, 4, lambda n: False) == 4  # the smallest slice: the caller refuses
