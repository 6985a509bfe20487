"""Each private mlx-lm name removed (monkeypatched away, as a later mlx-lm might): the sweep and the
SD loop still run on a local twin, or stop with a clear error naming the tested range."""

import json
import types

import mlx.core as mx
import mlx_lm.utils
import pytest
from click.testing import CliRunner
from conftest import TINY_BUDGET
from mlx_lm.models import switch_layers
from mlx_lm.models.cache import CacheList, KVCache

from mac_moesd import mlxlm_compat
from mac_moesd.cli import cli
from mac_moesd.inputs import models, zoo
from mac_moesd.measure.caches import cache_copy
from mac_moesd.measure.experts import gather, routing
from mac_moesd.measure.forward import sweep
from mac_moesd.measure.sd import speedup
from mac_moesd.pipeline import selftest
from mac_moesd.results import ResultsStore

META = {"chip_slug": "test", "backend": "cpu", "versions": {"mlx": mx.__version__}, "blas": {"name": "x"}}
QUICK = ["--context", "8", "--seconds-per-point", "0.01", "--quick", "--decode-chain", "8"]
INSTALLED = mlxlm_compat.installed_version()


def remove_private_names(monkeypatch) -> None:
    """As a later mlx-lm that renamed them: our lookups find none of the three, while mlx-lm's own
    switch calls keep their helpers (they read them from a copy of the module's globals)."""
    kept = dict(vars(switch_layers))
    for cls in (switch_layers.SwitchGLU, switch_layers.SwitchMLP):
        call = cls.__call__
        monkeypatch.setattr(cls, "__call__", types.FunctionType(call.__code__, kept, call.__name__,
                                                                call.__defaults__, call.__closure__))
    for module, name in ((mlx_lm.utils, "_get_classes"), (switch_layers, "_gather_sort"),
                         (switch_layers, "_scatter_unsort")):
        monkeypatch.delattr(module, name)


@pytest.mark.parametrize("shape, top_k", [((5, 3), 2), ((2, 7, 4), 4), ((64, 3), 3)])
def test_the_gather_twins_are_mlx_lms_helpers(shape, top_k):
    x = mx.random.normal((*shape[:-1], 1, 1, 8), key=mx.random.key(1))
    indices = mx.random.randint(0, 6, (*shape[:-1], top_k), key=mx.random.key(2))
    theirs = switch_layers._gather_sort(x, indices)
    ours = mlxlm_compat._gather_sort(x, indices)
    for a, b in zip(theirs, ours):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    y = theirs[0] * 2
    assert mx.array_equal(switch_layers._scatter_unsort(y, theirs[2], indices.shape),
                          mlxlm_compat._scatter_unsort(y, ours[2], indices.shape)).item()


def test_the_model_class_twin_is_mlx_lms(monkeypatch):
    for entry in zoo.ZOO:
        assert mlxlm_compat._model_classes(entry.config) == mlx_lm.utils._get_classes(entry.config), entry.name
    remove_private_names(monkeypatch)
    assert mlxlm_compat.model_classes({"model_type": "mistral"})[0].__module__ == "mlx_lm.models.llama"


@pytest.mark.slow
def test_sweep_gather_sorted_runs_without_mlx_lms_private_helpers(tmp_path, monkeypatch):
    remove_private_names(monkeypatch)
    result = CliRunner().invoke(cli, ["sweep", "tiny-moe", "--gather", "sorted", "--batch", "1,2",
                                      "--tokens", "1,2", *QUICK, "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["gather"] == "sorted" and len(doc["points"]) == 4
    # 4 pairs per token (tiny-moe routes each token to 4 experts), all run through the twins
    assert all(p["median_s"] > 0 and p["pairs"] == p["batch"] * p["tokens"] * 4 for p in doc["points"])


def test_a_sweep_of_a_saved_model_runs_without_mlx_lms_private_helpers(tmp_path, monkeypatch):
    built = models.build(models.ModelSource("m", zoo.miniature(zoo.by_name("tiny-moe").config)), seed=1)
    built.materialise()
    folder = tmp_path / "m"
    mlx_lm.utils.save_model(folder, built.model)
    mlx_lm.utils.save_config(dict(built.config), folder / "config.json")
    remove_private_names(monkeypatch)
    cfg = sweep.SweepConfig(model=str(folder), batches=(1, 2), tokens=(1, 2), context=8, budget=TINY_BUDGET)
    doc = sweep.run_sweep(cfg, ResultsStore(tmp_path / "r.json", META), None)
    assert len(doc["points"]) == 4


@pytest.mark.slow  # loads and times models end to end
def test_the_sd_loop_runs_without_mlx_lms_private_helpers(monkeypatch):
    remove_private_names(monkeypatch)
    cfg = speedup.SpecConfig(target="tiny-moe", draft="tiny-draft", batches=(1, 2), gammas=(2,), mode="self-draft",
                          context=8, new_tokens=4, repeats=1)
    doc = speedup.run_spec(cfg)
    assert [r["batch"] for r in doc["runs"]] == [1, 2]
    assert all(r["mean_accepted"] == 2 for r in doc["runs"])  # self-draft: every draft accepted


def test_a_switch_without_sorted_indices_stops_only_the_sorted_gather(tmp_path, monkeypatch):
    def call(self, x, indices):  # a later SwitchLinear without the keyword the copied call passes
        return x

    monkeypatch.setattr(switch_layers.SwitchLinear, "__call__", call)
    built = models.build(models.resolve("tiny-moe"))
    switch = routing.switch_modules(built.model)[0]
    with pytest.raises(mlxlm_compat.MlxLmIncompatible,
                       match=rf"--gather sorted needs mlx-lm >=0.32,<0.33 \(SwitchLinear\(..., sorted_indices=\) is "
                             rf"not as it was there\); you have mlx-lm {INSTALLED}"):
        gather.check_sortable(switch)
    result = CliRunner().invoke(cli, ["sweep", "tiny-moe", "--gather", "sorted", "--batch", "1", "--tokens", "1",
                                      *QUICK, "--out", str(tmp_path)])
    assert result.exit_code == 1 and "--gather sorted needs mlx-lm >=0.32,<0.33" in result.output
    assert "Traceback" not in result.output


def test_a_switch_call_that_changed_is_refused_before_any_swap(monkeypatch):
    def call(self, x, experts):
        return x

    monkeypatch.setattr(switch_layers.SwitchGLU, "__call__", call)
    built = models.build(models.resolve("tiny-moe"))
    with pytest.raises(mlxlm_compat.MlxLmIncompatible, match=r"SwitchGLU.__call__\(x, indices\)"):
        with routing.controlled_switches(built.model):
            pass
    assert all(type(m) is switch_layers.SwitchGLU for m in routing.switch_modules(built.model))


def test_a_cache_list_without_its_caches_is_a_clear_error():
    cache = CacheList(KVCache(), KVCache())
    del cache.caches
    with pytest.raises(mlxlm_compat.MlxLmIncompatible,
                       match=rf"rolling back a CacheList .* needs mlx-lm >=0.32,<0.33 \(CacheList.caches .*you have mlx-lm {INSTALLED}"):
        cache_copy.copy_cache(cache)


@pytest.mark.parametrize("version, tested", [("0.32.0", True), ("0.32.2", True), ("0.32.10rc1", True),
                                             ("0.31.9", False), ("0.33.0", False), ("1.0.0", False), ("dev", False)])
def test_the_tested_range(version, tested):
    assert mlxlm_compat.in_tested_range(version) is tested


def test_pyproject_bounds_mlx_lm_to_the_tested_range():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert f'"mlx-lm{mlxlm_compat.TESTED_RANGE}"' in text
    assert mlxlm_compat.in_tested_range(INSTALLED)  # the tests run on a tested version


def test_selftest_names_what_an_untested_mlx_lm_would_affect(monkeypatch):
    assert selftest.check_mlx_lm().endswith("every private name the suite uses is as tested")
    monkeypatch.setattr(mlxlm_compat, "installed_version", lambda: "0.33.1")
    remove_private_names(monkeypatch)
    detail = selftest.check_mlx_lm()
    assert detail.startswith("mlx-lm 0.33.1 is outside the tested range >=0.32,<0.33")
    assert "mlx_lm.models.switch_layers._gather_sort is gone: a local twin stands in" in detail

    def call(self, x, indices):  # a later SwitchLinear without sorted_indices: no twin for that
        return x

    monkeypatch.setattr(switch_layers.SwitchLinear, "__call__", call)
    with pytest.raises(selftest.SelftestFailed, match="sweep --gather sorted will be skipped"):
        selftest.check_mlx_lm()
