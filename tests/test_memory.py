import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from conftest import TINY_BUDGET
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from mac_moesd.machine import hardware, memory
from mac_moesd.inputs import models
from mac_moesd.measure.clock import timing
from mac_moesd.measure.forward import sweep
from mac_moesd.measure.sd import speedup
from mac_moesd.cli import cli
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.pipeline import estimate

DATA = Path(__file__).parent / "data"
GiB = 2**30


def test_vm_stat_parser_on_a_recorded_sample():
    text = (DATA / "vm_stat_m1_8gb.txt").read_text()
    stats = memory.parse_vm_stat(text)
    assert stats["page_size"] == 16384
    assert stats["free"] == 12345 and stats["inactive"] == 137591
    assert stats["purgeable"] == 4306 and stats["speculative"] == 2117
    assert stats["wired_down"] == 79213 and "Translation faults" not in stats
    assert memory.vm_stat_free_bytes(text) == (12345 + 137591 + 2117) * 16384  # free, inactive, speculative
    assert memory.vm_stat_free_bytes("no header here") is None


# Hand-written in the format of vm_stat's snapshot (XNU system_cmds vm_stat.c: "%-35s %16llu.",
# unchanged from macOS 13 to 15), with page counts chosen by hand for an 8 GB M1 (13), a 16 GB
# M2 Pro with a large purgeable browser cache (14) and a 64 GB M3 Max (15). Expected bytes are
# (free + inactive + speculative) x 16384, worked by hand; purgeable pages are already resident
# in the active and inactive queues, so they add nothing.
VM_STAT_HANDWRITTEN = {
    # 9876 + 175000 + 3210 = 188086 pages
    "vm_stat_macos13_m1_8gb_handwritten.txt": 3_081_601_024,
    # 20480 + 350000 + 10240 = 380720 pages (purgeable 180000 pages = 2.75 GiB not added)
    "vm_stat_macos14_m2pro_16gb_handwritten.txt": 6_237_716_480,
    # 1000000 + 900000 + 50000 = 1950000 pages
    "vm_stat_macos15_m3max_64gb_handwritten.txt": 31_948_800_000,
}


@pytest.mark.parametrize("name", sorted(VM_STAT_HANDWRITTEN))
def test_vm_stat_usable_memory_counts_no_page_twice(name):
    assert memory.vm_stat_free_bytes((DATA / name).read_text()) == VM_STAT_HANDWRITTEN[name]


def test_usable_on_metal_reads_vm_stat_without_purgeable(monkeypatch):
    """The Metal path end to end, faked: 16 GB M2 Pro (ceiling 2/3 of RAM), vm_stat of macOS 14."""
    text = (DATA / "vm_stat_macos14_m2pro_16gb_handwritten.txt").read_text()
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "mlx_device_info", lambda: {"max_recommended_working_set_size": 16 * GiB * 2 // 3})
    monkeypatch.setattr(hardware, "run_tool", lambda argv: text)
    monkeypatch.setattr(memory, "mlx_held_bytes", lambda: 0)
    u = memory.usable()
    assert u.free_bytes == 6_237_716_480  # not 6_237_716_480 + 180000 * 16384
    assert u.usable_bytes == 6_237_716_480 - int(6_237_716_480 * memory.MARGIN)


def test_usable_is_the_smaller_of_ceiling_and_free_less_margin_then_capped():
    u = memory.usable_from(ceiling=10 * GiB, free=4 * GiB, limit=None, source="t")
    assert u.usable_bytes == 4 * GiB - int(4 * GiB * memory.MARGIN)
    assert memory.usable_from(10 * GiB, 40 * GiB, 2 * GiB, "t").usable_bytes == 2 * GiB
    assert memory.working_set_bytes(8 * GiB) == 8 * GiB * 2 // 3
    assert memory.working_set_bytes(36 * GiB) == 27 * GiB


def test_memory_limit_from_option_or_environment():
    assert memory.limit_bytes(1.5, {}) == int(1.5 * GiB)
    assert memory.limit_bytes(None, {memory.ENV_LIMIT: "2"}) == 2 * GiB
    assert memory.limit_bytes(None, {}) is None
    with pytest.raises(BadInput, match="not a number"):
        memory.limit_bytes(None, {memory.ENV_LIMIT: "lots"})
    with pytest.raises(BadInput, match="> 0"):
        memory.limit_bytes(0, {})


def test_kv_slots_replay_mlx_lm_kvcache_growth():
    assert memory.KV_STEP == KVCache.step == 256
    assert memory.kv_slots([512]) == (512, 512)
    assert memory.kv_slots([512, 1]) == (768, 512 + 768)  # old buffer and the concatenation
    assert memory.kv_slots([256, 8]) == (512, 768)
    for forwards in ([512, 1], [100, 200, 3], [256, 8, 1], [300, 300, 300]):
        cache = KVCache()
        for n in forwards:
            kv = mx.zeros((1, 1, n, 2))
            cache.update_and_fetch(kv, kv)
        assert memory.kv_slots(forwards)[0] == cache.keys.shape[2], forwards


@pytest.mark.slow
def test_sweep_records_peak_within_its_estimate(tmp_path):
    from mac_moesd.results import ResultsStore

    meta = {"chip_slug": "test", "backend": "cpu", "versions": {"mlx": mx.__version__}, "blas": {"name": "x"}}
    cfg = sweep.SweepConfig(model="tiny-moe", batches=(1, 4), tokens=(1, 4), context=300,
                            budget=TINY_BUDGET, draft="tiny-draft")
    doc = sweep.run_sweep(cfg, ResultsStore(tmp_path / "r.json", meta), None)
    for m in [s["memory"] for s in doc["slices"]] + [doc["draft"]["memory"]]:
        assert 0 < m["peak_bytes"] <= m["estimate_bytes"], m
        assert m["estimate_bytes"] <= 1.3 * m["peak_bytes"], m  # an estimate, not a blanket margin


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-hybrid-moe", "tiny-mamba-moe"])
def test_a_hybrid_sweep_records_peak_within_its_estimate(model, tmp_path):
    from mac_moesd.results import ResultsStore

    meta = {"chip_slug": "test", "backend": "cpu", "versions": {"mlx": mx.__version__}, "blas": {"name": "x"}}
    cfg = sweep.SweepConfig(model=model, batches=(1, 4), tokens=(1, 4), context=300, budget=TINY_BUDGET)
    doc = sweep.run_sweep(cfg, ResultsStore(tmp_path / "r.json", meta), None)
    for m in [s["memory"] for s in doc["slices"]]:
        assert 0 < m["peak_bytes"] <= m["estimate_bytes"] <= 1.3 * m["peak_bytes"], m


@pytest.mark.parametrize("model", ["tiny-hybrid-moe", "tiny-mamba-moe"])
def test_recurrent_states_are_sized_from_the_graph_as_a_forward_writes_them(model):
    built = models.build(models.resolve(model))
    lazy = memory.recurrent_state_bytes(built.model)
    built.materialise()
    caches = make_prompt_cache(built.model)
    built.model(mx.array([[1, 2, 3]]), cache=caches)
    mx.eval([c.state for c in caches])
    written = sum(a.nbytes for c in caches if isinstance(c, ArraysCache) for a in c.cache)
    assert lazy == written > 0
    shape = memory.cache_shape(built)
    assert shape.state == lazy and shape.bytes(1000) - shape.bytes(500) == 500 * shape.per_slot


def test_a_window_stops_growing_at_its_size():
    built = models.build(models.resolve("tiny-swa-moe"))
    shape = memory.cache_shape(built)
    assert shape.window == 16 and shape.state == 0 and shape.window_per_slot == shape.per_slot > 0
    assert shape.bytes(5000) - shape.bytes(1000) == 4000 * shape.per_slot  # the full-attention layers only
    assert shape.snapshot_bytes(5000) == shape.window_per_slot * 16
    assert shape.snapshot_bytes(5000, forward=5) == shape.window_per_slot * 20  # a 5-token verify
    assert memory.cache_shape(models.build(models.resolve("tiny-moe"))).plain_kv


def test_memory_limit_slices_then_refuses(tmp_path):
    source = models.resolve("tiny-moe")
    cfg = sweep.SweepConfig(model="tiny-moe", batches=(1,), tokens=(1,), context=16)
    two = sweep.estimate_bytes(models.build(source, layers=2), cfg)
    assert sweep.plan_layers(source, cfg, two) == [1, 2]
    result = CliRunner().invoke(cli, ["sweep", "tiny-moe", "--batch", "1", "--tokens", "1",
                                      "--context", "16", "--memory-limit", "0.001", "--out", str(tmp_path)])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and "B is usable here" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_four_bit_sweep_json_is_one_document(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mac_moesd", "sweep", "tiny-moe", "--bits", "4", "--batch", "1",
         "--tokens", "1", "--context", "16", "--quick", "--seconds-per-point", "0.01",
         "--decode-chain", "8", "--out", str(tmp_path), "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # fails on anything printed beside the document
    assert doc["bits"] == 4 and "[INFO] Quantized" not in done.stderr  # dropped, not moved


def dry_run(*args):
    result = CliRunner().invoke(cli, ["run", "--quick", "--dry-run", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def check_plan(doc):
    assert {s["stage"] for s in doc["stages"]} >= {"roofline", "sweep qwen1.5-moe-a2.7b",
                                                    "routing qwen1.5-moe-a2.7b", "spec qwen1.5-moe-a2.7b"}
    for stage in doc["stages"]:
        assert "skipped" not in stage, stage
        assert 0 < stage["peak_bytes"] <= doc["usable_bytes"], stage
        assert stage["eta_s"] > 0
    assert doc["eta_s"] == pytest.approx(sum(s["eta_s"] for s in doc["stages"]))
    # --quick stays within minutes on any Mac: at most 5 by the dry run's own estimate, which says
    # what it assumes of the SD stage (each configuration's answer decided by its fewest pairs)
    assert doc["eta_s"] <= 300
    (spec_stage,) = [s for s in doc["stages"] if s["stage"].startswith("spec ")]
    assert spec_stage["assumes"] == estimate.SD_STOP_ASSUMED


def test_quick_plan_fits_a_faked_8gb_m1(monkeypatch):
    m1 = hardware.lookup_spec("Apple M1", 8)
    machine = hardware.Machine(chip="Apple M1", gpu_cores=8, memory_bytes=8 * GiB,
                               available_bytes=None, backend="metal", os="macOS 15", spec=m1,
                               slug="apple-m1-8c", power_source=None, device_info={})
    text = (DATA / "vm_stat_m1_8gb.txt").read_text()
    monkeypatch.setattr(hardware, "detect", lambda: machine)
    monkeypatch.setattr(memory, "usable", lambda limit=None: memory.usable_from(
        memory.working_set_bytes(8 * GiB), memory.vm_stat_free_bytes(text) + 2 * GiB, limit, "faked"))
    doc = dry_run()
    assert doc["chip"] == "Apple M1" and doc["memory_bytes"] == 8 * GiB
    assert doc["usable_bytes"] < memory.working_set_bytes(8 * GiB)
    check_plan(doc)
    sweep_stage = next(s for s in doc["stages"] if s["stage"] == "sweep qwen1.5-moe-a2.7b")
    assert sweep_stage["extrapolated"] and sweep_stage["layers"][1] == 2 * sweep_stage["layers"][0]


@pytest.mark.parametrize("chip, gib", [("Apple M2", 16), ("Apple M3 Pro 18c", 36)])
def test_quick_plan_fits_other_macs_by_chip(chip, gib):
    doc = dry_run("--chip", chip, "--memory", str(gib))
    assert doc["memory_bytes"] == gib * GiB
    assert doc["usable_bytes"] == memory.usable_from(memory.working_set_bytes(gib * GiB), None, None, "").usable_bytes
    check_plan(doc)


def test_a_run_resolves_each_model_once(monkeypatch):
    from mac_moesd.inputs import models

    resolved, resolve = [], models.resolve
    monkeypatch.setattr(models, "resolve", lambda model: resolved.append(model) or resolve(model))
    dry_run("--chip", "Apple M2", "--memory", "16")  # the default models: one target, dense control, drafter
    assert resolved == ["qwen1.5-moe-a2.7b", "qwen2.5-3b", "qwen2-0.5b"]
    resolved.clear()
    # --models resolves its names to tell MoE from dense; the stages reuse them, resolving only the
    # default dense control and the drafter.
    dry_run("--chip", "Apple M2", "--memory", "16", "--models", "qwen1.5-moe-a2.7b,olmoe-1b-7b")
    assert resolved == ["qwen1.5-moe-a2.7b", "olmoe-1b-7b", "qwen2.5-3b", "qwen2-0.5b"]


def test_dry_run_usage_errors():
    result = CliRunner().invoke(cli, ["run", "--dry-run", "--chip", "Apple M9", "--memory", "8"])
    assert result.exit_code == 2 and "unknown chip" in result.stderr
    result = CliRunner().invoke(cli, ["run", "--dry-run", "--chip", "Apple M1"])
    assert result.exit_code == 2 and "--memory" in result.stderr


def test_the_sd_estimate_counts_the_audits_fresh_caches_beside_the_decodes():
    """After the pairs, the audit prefills fresh caches of the prompt and feeds them the emitted
    tokens while the decode's caches are still held: with many tokens that phase is the peak.
    Self-draft on plain KV caches: the decode's caches and the reference, both at the decode's
    slots, twice the decode phase's caches."""
    target = models.build(models.resolve("tiny-moe"))
    need = memory.spec_estimate(target, None, batch=2, gamma=2, context=16, new_tokens=256, chunk=512,
                                mlx_lm_batch1=False)
    _, slots = memory.kv_slots(memory.prefill_forwards(16, 512) + [256 + 2])
    assert need["phase"] == "audit"
    assert need["parts"]["kv"] == 2 * 2 * memory.cache_shape(target).per_slot * slots


def test_spec_slices_target_and_drafter_alike_or_refuses():
    from mac_moesd.measure.sd import speedup

    cfg = speedup.SpecConfig(target="tiny-moe", draft="tiny-draft", batches=(1,), gammas=(2,), context=16)
    target, draft, need = speedup.plan_models(cfg, None)
    assert target.layers == 4 and draft.layers == 2
    target, draft, need = speedup.plan_models(cfg, need["peak_bytes"] - 1)
    assert target.layers == 2 and draft.layers == 1
    with pytest.raises(MacMoesdError, match="B is usable here"):
        speedup.plan_models(cfg, 1000)


def test_an_sd_configurations_eta_counts_its_pairs_and_the_parts_after_them():
    # plain 1 s and SD 0.5 s a run, no prefill: a pair with its parts costs 1 + 2 * 0.5 = 2 s.
    # To +-3% at the assumed 5% spread: ceil((1.96 * 1.2533 * 0.05 / 0.03)^2) = 17 pairs, then the
    # parts alone 32 - 17 = 15 times at about one SD run each: 1.5 (warm-up) + 34 + 7.5 = 43 s.
    full = speedup.SpecConfig(target="tiny-moe", draft="tiny-draft")
    assert estimate._configuration_seconds(full, 1.0, 0.5) == pytest.approx(43.0)
    # A quick run: its fewest pairs (8), the parts once a pair; a budget caps either.
    quick = replace(full, stop_when_decided=True)
    assert estimate._configuration_seconds(quick, 1.0, 0.5) == pytest.approx(1.5 + 16.0)
    assert estimate._configuration_seconds(replace(full, budget_s=30.0), 1.0, 0.5) == pytest.approx(31.5)


def test_a_grid_points_eta_counts_the_decode_steps_longer_budget():
    # One forward of 10 ms, the default budget (2 s a point, 5-200 samples, 3 a visit, 2 warm-ups):
    # synchronous, 201 samples (the first visit past 2 s) and 2 warm-ups of 10 ms = 2.03 s.
    # Pipelined one-token chains of 32 (0.32 s a sample) for 4 x 2 s: 27 samples + 2 = 9.28 s;
    # a two-token point's chains of 8 (0.08 s) for 2 s: 27 + 2 = 2.32 s.
    budget = timing.Budget()
    assert estimate.grid_point_seconds(0.01, budget, 1) == pytest.approx(2.03 + 9.28)
    assert estimate.grid_point_seconds(0.01, budget, 2) == pytest.approx(2.03 + 2.32)
    # Without the longer budget, the chains stop at 9 samples: (9 + 2) x 0.32 = 3.52 s.
    assert estimate.grid_point_seconds(0.01, replace(budget, decode_seconds_factor=1.0), 1) == pytest.approx(2.03 + 3.52)
