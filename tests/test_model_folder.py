"""A model folder is random weights only when it holds no weights at all; incomplete weights are
refused with what is missing; a pre-quantized checkpoint is labelled with its own dtype."""

import json

import mlx.core as mx
import pytest
from mlx_lm.utils import save_config, save_model

from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs import models, zoo
from mac_moesd.inputs.trees import flatten


def tiny_config() -> dict:
    return zoo.miniature(zoo.by_name("tiny-moe").config)


def saved(folder, dtype="float32", bits=None, config=None) -> tuple:
    """A materialised random model saved as mlx-lm saves one: model.safetensors, its index, config."""
    built = models.build(models.ModelSource("m", config or tiny_config()), dtype=dtype, bits=bits, seed=3)
    built.materialise()
    save_model(folder, built.model)
    save_config(dict(built.config), folder / "config.json")
    return folder, built


def test_a_folder_with_only_a_config_is_random_weights_by_design(config_dir):
    folder = config_dir(tiny_config())
    source = models.resolve(str(folder))
    assert not source.has_weights
    assert models.build(source).layers == tiny_config()["num_hidden_layers"]


def test_a_folder_is_named_by_its_own_name_however_it_was_given(config_dir, monkeypatch):
    # Results are keyed by the name: "." (a user inside the folder) or a trailing slash must not
    # make it empty or different.
    folder = config_dir(tiny_config())
    assert models.resolve(str(folder) + "/").name == folder.name
    monkeypatch.chdir(folder)
    assert models.resolve(".").name == folder.name
    assert models.resolve("config.json").name == folder.name
    monkeypatch.chdir(folder.parent)
    assert models.resolve(f"./{folder.name}").name == folder.name


def test_a_shard_the_index_names_but_the_folder_lacks_is_refused(tmp_path):
    folder, _ = saved(tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    names = sorted(index["weight_map"])
    # Half the tensors moved to a second shard that was never downloaded.
    for name in names[: len(names) // 2]:
        index["weight_map"][name] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MacMoesdError, match=r"lacks 1 of the 2 weight files .*: model-00002-of-00002.safetensors"):
        models.resolve(str(folder))


def test_an_index_without_any_of_its_shards_is_refused_not_random(tmp_path):
    folder, _ = saved(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(MacMoesdError, match="lacks 1 of the 1 weight files .*: model.safetensors"):
        models.resolve(str(folder))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "consolidated.00.pth", "weights.safetensors",
                                  "model-q4.gguf"])
def test_weights_in_a_format_mlx_lm_does_not_load_are_refused(config_dir, name):
    folder = config_dir(tiny_config())
    (folder / name).write_bytes(b"\0")
    with pytest.raises(MacMoesdError, match=f"holds weights mlx-lm does not load \\({name}\\)"):
        models.resolve(str(folder))


def test_a_tensor_the_model_expects_but_no_file_holds_is_refused(tmp_path):
    folder, built = saved(tmp_path / "m")
    weights = mx.load(str(folder / "model.safetensors"))
    gone = "model.layers.1.self_attn.q_proj.weight"
    assert gone in weights
    del weights[gone]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    source = models.resolve(str(folder))
    with pytest.raises(MacMoesdError, match=f"lack 1 of the .* tensors the model expects \\({gone}\\)"):
        models.build(source)
    assert models.build(source, layers=1).layers == 1  # the slice needs no tensor of layer 1
    with pytest.raises(MacMoesdError, match=gone.replace(".", r"\.")):
        models.stored_format(source)


def test_a_tensor_of_another_shape_is_refused(tmp_path):
    folder, _ = saved(tmp_path / "m")
    weights = mx.load(str(folder / "model.safetensors"))
    name = "model.norm.weight"
    weights[name] = mx.ones((weights[name].shape[0] + 1,))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(MacMoesdError, match=f"tensor {name} has shape"):
        models.build(models.resolve(str(folder)))


def test_a_complete_checkpoint_loads_its_own_values(tmp_path):
    folder, built = saved(tmp_path / "m")
    loaded = models.build(models.resolve(str(folder)))
    loaded.materialise()
    x = mx.array([[1, 2, 3]])
    assert mx.array_equal(built.model(x), loaded.model(x)).item()


def test_a_pre_quantized_bf16_checkpoint_is_labelled_bfloat16(tmp_path):
    """mlx-lm quantizes a bfloat16 model with bfloat16 scales and biases; that is the dtype the
    checkpoint computes in, whatever the suite's default (float32 on the CPU backend) is."""
    folder, _ = saved(tmp_path / "q", dtype="bfloat16", bits=4)
    assert "quantization" in json.loads((folder / "config.json").read_text())
    built = models.build(models.resolve(str(folder)))
    assert built.bits == 4 and built.dtype == "bfloat16"
    scales = [v for k, v in flatten(built.model.parameters()) if k.endswith(".scales")]
    assert scales and {s.dtype for s in scales} == {mx.bfloat16}
    # as stored, even where another dtype is asked for
    assert models.build(models.resolve(str(folder)), dtype="float16").dtype == "bfloat16"


def test_a_pre_quantized_float16_checkpoint_is_labelled_float16(tmp_path):
    folder, _ = saved(tmp_path / "q", dtype="float16", bits=8)
    built = models.build(models.resolve(str(folder)))
    assert (built.bits, built.dtype) == (8, "float16")


def test_a_models_identity_is_its_config_as_stored_and_whether_it_has_weights(config_dir):
    import hashlib

    from mac_moesd.errors import MacMoesdError
    from mac_moesd.results import ResultsStore

    # A multimodal checkpoint's text fields sit under text_config: the digest is of the file as
    # written, not of the config the suite reads from it, so a change to that reading leaves it.
    stored = {"model_type": "qwen3_5_moe", "text_config": {**tiny_config(), "model_type": "qwen3_5_moe_text"}}
    folder = config_dir(stored, name="my-moe")
    source = models.resolve(str(folder))
    digest = hashlib.sha256(json.dumps(stored, sort_keys=True).encode()).hexdigest()[:16]
    assert source.identity() == {"config_sha256": digest, "weights": "random"}
    assert source.config != stored  # what the suite reads differs from what is stored
    # Target and drafter of one name but different models: refused before the results are touched.
    other = config_dir({**tiny_config(), "num_experts_per_tok": 1}, name="elsewhere")
    twin = models.ModelSource("my-moe", models.resolve(str(other)).config)
    store = ResultsStore(folder.parent / "out" / "results.json", {"chip_slug": "x", "backend": "cpu"})
    with pytest.raises(MacMoesdError, match="target and the drafter are different models both named my-moe"):
        models.Sources(source, twin).claim(store)
    assert "models" not in store.data
