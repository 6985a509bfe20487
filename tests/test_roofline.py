import json
import random
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import TINY_BUDGET

from mac_moesd.measure.peaks import kernels, roofline
from mac_moesd.cli import cli

TINY = roofline.RooflineConfig(
    sizes=(64 * 1024, 256 * 1024), gemv_bytes=2**20, matmul_n=64, qmm_shape=(128, 128),
    qmm_tokens=(1, 2, 4, 8), plateau_from=256 * 1024, budget=TINY_BUDGET, fma_iterations=8,
    distinct_bytes=2**20,  # past the plateau, in a few copies: the tests' stand-in for 256 MiB
)
needs_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="needs a Metal device")


def test_check_catches_a_corrupted_array():
    a = np.arange(1000, dtype=np.float32)
    kernels.check("copy", a.copy(), a)
    bad = a.copy()
    bad[417] += 1.0
    with pytest.raises(kernels.KernelCheckFailed, match="1 of 1000 values wrong .first at 417"):
        kernels.check("copy", bad, a)
    with pytest.raises(kernels.KernelCheckFailed, match="shape"):
        kernels.check("copy", a[:10], a)


def test_twins_compute_what_the_kernels_promise():
    a = mx.arange(64, dtype=mx.float32)
    b = mx.ones((64,))
    big = mx.arange(4 * kernels.READ_ROW, dtype=mx.float32)
    assert kernels.read_twin(big).shape == (4,)
    assert mx.sum(kernels.read_twin(big)).item() == pytest.approx(float(np.arange(4096).sum()))
    assert mx.array_equal(kernels.copy_twin(a), a).item()
    assert mx.allclose(kernels.triad_twin(b, a, 3.0), 1 + 3 * a).item()
    ref = kernels.fma_reference(np.array([0.0, 1.0], dtype=np.float32), 1.0, 1.0, 2)
    # chains start at seed+j+{0,.25,.5,.75}; two rounds of x+1 add 2 to each of 16 values
    np.testing.assert_allclose(ref, [16 * 2 + 4 * (0 + 1 + 2 + 3) + 4 * 1.5, 16 * 3 + 24 + 6])


def test_every_kernel_source_is_present_and_names_its_arguments():
    for name, (inputs, outputs) in kernels.SIGNATURES.items():
        source = kernels.load_source(name)
        for arg in (*inputs, *outputs):
            assert arg in source, f"{name}.metal does not use {arg}"
        assert "thread_position_in_grid" in source


def test_without_metal_the_fallback_runs_and_says_so():
    k = kernels.Kernels.build()
    if mx.metal.is_available():
        assert k.path == "metal"
    else:
        assert k.path == "mlx" and "fallback" in k.reason
        assert k.fma(mx.zeros((4,)), 1.0, 1.0, 1) is None


@needs_metal
def test_metal_kernels_agree_with_their_twins():
    k = kernels.Kernels.build()
    assert k.path == "metal", k.reason
    a = mx.random.uniform(shape=(1 << 20,))
    b = mx.random.uniform(shape=(1 << 20,))
    assert mx.allclose(mx.sum(k.read(a)), mx.sum(kernels.read_twin(a)), rtol=1e-4).item()
    assert mx.array_equal(k.copy(a), a).item()
    assert mx.allclose(k.triad(a, b, 3.0), kernels.triad_twin(a, b, 3.0)).item()
    seed = mx.arange(kernels.GRID_THREADS, dtype=mx.float32) * 1e-6
    out = k.fma(seed, 0.999, 1e-4, 16)
    np.testing.assert_allclose(np.array(out[:64]),
                               kernels.fma_reference(np.array(seed[:64]), 0.999, 1e-4, 16), rtol=1e-4)


def test_knee_from_a_synthetic_curve():
    # flat 1 ms until compute takes over at 0.1 ms per token: knee at 10 tokens
    tokens = [1, 2, 4, 8, 16, 32, 64]
    seconds = [max(1e-3, 1e-4 * t) for t in tokens]
    assert roofline.knee_tokens(tokens, seconds) == pytest.approx(10.0)
    assert roofline.knee_tokens([1, 2], [1.0, 1.0]) is None


def test_run_roofline_document():
    steps: list[str] = []
    doc = roofline.run_roofline(TINY, spec=None, backend="cpu", progress=steps.append)
    assert len(steps) == roofline.progress_steps(TINY)  # what a progress bar expects
    for key in ("bandwidth_gbs", "flops_tflops", "ridge_flop_per_byte", "backend", "spec"):
        assert key in doc
    assert set(doc["bandwidth_gbs"]) >= {"read", "copy", "triad"}
    assert doc["ridge_flop_per_byte"] == pytest.approx(
        doc["flops_tflops"]["float32"] * 1e12 / (doc["bandwidth_ceiling_gbs"] * 1e9))
    assert doc["bandwidth_ceiling_gbs"] == max(doc["bandwidth_gbs"].values())
    assert doc["ridge_tokens"]["fp16"] == pytest.approx(doc["ridge_flop_per_byte"])
    assert len(doc["qmm_curve"]) == 8
    for row in doc["size_sweep"]:
        assert row["gbs"] == pytest.approx(row["moved_bytes"] / row["median_s"] / 1e9)
        # STREAM's counts (read 1x, copy 2x, triad 3x), the read's partial sums (one float per
        # 1024 of the MLX twin here) counted too
        factor = {"read": 1 + 1 / 1024, "copy": 2, "triad": 3}[row["op"]]
        assert row["moved_bytes"] == pytest.approx(factor * row["bytes"])


def test_a_metal_read_counts_the_partials_it_writes():
    # 256 Ki threads write one float each: 1 MiB, as much as a 1 MiB array's read, 1/4 of 4 MiB
    assert roofline.read_output_bytes("metal", 1 << 20) == 1 << 20
    assert roofline.read_output_bytes("metal", 4 << 20) == (4 << 20) // 4
    assert roofline.read_output_bytes("mlx", 4 << 20) == (4 << 20) // 1024


def test_against_spec():
    spec = {"bandwidth_bytes_s": 400e9, "fp32_flops": 10e12}
    assert roofline._against_spec(spec, 300.0, 5.0) == {"bandwidth": 0.75, "fp32_flops": 0.5}
    assert roofline._against_spec(None, 300.0, 5.0) is None


@pytest.mark.slow  # loads and times models end to end
def test_cli_roofline_quick_json(tmp_path, monkeypatch):
    monkeypatch.setattr(roofline, "QUICK", TINY)  # the command's wiring and contract, at the tests' sizes
    result = CliRunner().invoke(cli, ["roofline", "--quick", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    for key in ("bandwidth_gbs", "flops_tflops", "ridge_flop_per_byte", "backend", "spec"):
        assert key in doc
    assert set(doc["bandwidth_gbs"]) >= {"read", "copy", "triad"}
    assert set(doc["flops_tflops"]) >= {"float32", "float16", "bfloat16"}
    assert doc["ridge_flop_per_byte"] == pytest.approx(
        doc["flops_tflops"][doc["ridge_dtype"]] * 1e3 / doc["bandwidth_ceiling_gbs"])
    if not mx.metal.is_available():
        assert "fallback" in doc["kernels"]["note"] and "fallback" in result.stderr
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["roofline"]["ridge_flop_per_byte"] == doc["ridge_flop_per_byte"]


@pytest.mark.parametrize("args, fragment", [
    (["--sizes", "big"], "not a comma-separated list of floats"),
    (["--sizes", "0"], "is not > 0"),
    (["--sizes", "0.001"], "at least 1/64 MiB"),
    (["--max-size", "100000000"], "GiB is usable here"),
])
def test_cli_roofline_bad_input(tmp_path, args, fragment):
    result = CliRunner().invoke(cli, ["roofline", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_every_roofline_row_records_its_launch_count():
    doc = roofline.run_roofline(TINY, spec=None, backend="cpu")
    rows = [*doc["size_sweep"], *doc["gemv"].values(), *doc["matmul"].values(), *doc["qmm_curve"]]
    for row in rows:
        assert row["launches"] >= 1
        assert row["eval_median_s"] == pytest.approx(row["median_s"] * row["launches"])
    assert doc["kernels"]["per_kernel"]["copy"]["path"] in {"metal", "mlx"}
    # TINY's largest step is STREAM's: arrays a and b of 256 KiB (524_288 B) beside the larger of
    # the 1 GiB launch allowance and one 256 KiB output plus 128 MiB of check temporaries (8 chunks
    # of 4 Mi float32): 524_288 + 1_073_741_824 = 1_074_266_112. The others are smaller: matmul
    # 2*64*64*4 + 1 GiB = 1_073_774_592; GEMV's 512 x 512 weight, 8-bit, in 4 copies of 294_912 B
    # beside the 1 MiB float32 source and a temporary: 3_276_800; quantized matmul 1_208_832.
    assert doc["memory"]["estimate_bytes"] == 1_074_266_112
    assert doc["memory"]["peak_bytes"] > 0 and "wired_limit_bytes" in doc["memory"]


def test_quantized_kernels_get_the_compute_dtype(monkeypatch):
    seen = []
    real = mx.quantized_matmul

    def spy(x, w, scales, biases, **kw):
        seen.append((x.dtype, scales.dtype))
        return real(x, w, scales, biases, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    rows = roofline.qmm_curve(TINY, mx.float16, random.Random(0), lambda label: None)
    gemv = roofline.gemv_bandwidth(TINY, mx.float16, random.Random(0), lambda label: None)
    assert seen and set(seen) == {(mx.float16, mx.float16)}  # no float32 weights promote the input
    assert {r["dtype"] for r in rows} == {"float16"}
    assert gemv["q4"]["dtype"] == gemv["q8"]["dtype"] == "float16"


def test_verify_stream_holds_one_output_and_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "CHECK_CHUNK", 2**14)
    k = kernels.Kernels.build()
    n = 2**20  # 4 MiB arrays, 64 chunks
    a = mx.random.uniform(shape=(n,))
    b = mx.random.uniform(shape=(n,))
    mx.eval(a, b)
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    roofline.verify_stream(k, a, b, 3.0)
    extra = mx.get_peak_memory() - base
    # one output array plus a few chunk temporaries: not the 11-12x of a float64 host copy
    assert extra <= 4 * n + 8 * kernels.CHECK_CHUNK * 4, extra / (4 * n)
    bad = kernels.Kernels({nm: "mlx" for nm in kernels.NAMES}, {nm: "" for nm in kernels.NAMES})
    monkeypatch.setattr(kernels, "copy_twin", lambda x: x * 1.5)
    with pytest.raises(kernels.KernelCheckFailed, match="copy"):
        roofline.verify_stream(bad, a, b, 3.0)


def test_validate_budgets_what_the_roofline_allocates():
    cfg = roofline.QUICK
    big = max(cfg.sizes)
    assert roofline.peak_bytes(cfg) == 2 * big + roofline.launch_bytes(cfg)
    assert roofline.launch_bytes(cfg) == 2**30
    full = roofline.RooflineConfig()
    assert roofline.peak_bytes(full) == 4 * max(full.sizes)  # a, b and two arrays of outputs
    roofline.validate(cfg, roofline.peak_bytes(cfg))
    with pytest.raises(roofline.BadInput, match="usable here"):
        roofline.validate(cfg, roofline.peak_bytes(cfg) - 1)


def test_weight_copies_are_distinct_and_hold_the_floor():
    one = 64 * 64 * 4  # a 64 x 64 float32 weight: 16 KiB
    copies = roofline.weight_copies(lambda: (mx.random.uniform(shape=(64, 64)),), 4 * one + 1)
    assert len(copies) == 5  # four copies hold 1 byte short of the floor
    for i, (a,) in enumerate(copies):
        for (b,) in copies[i + 1:]:
            assert a is not b and not mx.array_equal(a, b).item()
    assert len(roofline.weight_copies(lambda: (mx.zeros((64, 64)),), 1)) == 1


def test_a_chain_turns_through_the_copies_across_evaluations():
    used = []
    copies = [(mx.array([float(k)]),) for k in range(3)]
    step = roofline._chain(lambda x, w: used.append(int(w.item())) or x, copies, mx.zeros((1, 1)))
    from mac_moesd.measure.clock import timing

    for _ in range(2):
        timing.chained(step, 2).run()
    assert used == [0, 1, 2, 0]  # the second evaluation starts where the first stopped


def test_gemv_and_qmm_rows_stream_distinct_copies_past_the_floor():
    doc = roofline.run_roofline(TINY, spec=None, backend="cpu")
    # TINY's 1 MiB GEMV weight is 512 x 512 (square below 4096 columns); float32 on the CPU backend.
    # q4: 512*512/2 packed + 2 * 512 * (512/64) * 4 scales and biases = 160 KiB: 7 copies hold 1 MiB;
    # q8: 256 KiB + 32 KiB = 288 KiB: 4 copies; float16: 512 KiB: 2; float32: 1 MiB: 1.
    expected = {"float32": (2**20, 1), "float16": (2**19, 2), "q8": (288 * 1024, 4), "q4": (160 * 1024, 7)}
    assert {k: (r["bytes"], r["copies"]) for k, r in doc["gemv"].items()} == expected
    for row in [*doc["gemv"].values(), *doc["qmm_curve"]]:
        assert row["distinct_bytes"] >= TINY.distinct_bytes
    # the 128 x 128 quantized-matmul weight, 4-bit: 8 KiB + 2 KiB, so 103 copies hold 1 MiB
    assert {(r["bits"], r["copies"]) for r in doc["qmm_curve"]} == {(4, 103), (8, 57)}  # 8-bit: 18 KiB
    assert doc["shrunk"] is None and doc["distinct_bytes"] == 2**20


def test_the_ceiling_comes_from_rows_past_the_caches():
    bandwidth = {"read": 100.0, "copy": 90.0, "triad": 95.0, "gemv_q4": 400.0, "gemv_float16": 110.0}
    gemv = {"q4": {"distinct_bytes": 20 * 2**20}, "float16": {"distinct_bytes": 256 * 2**20}}
    # an 18-20 MiB 4-bit weight fits a Max chip's system-level cache: its 400 GB/s is no ceiling
    assert roofline.ceiling_of(bandwidth, gemv, 256 * 2**20) == "gemv_float16"
    assert roofline.ceiling_of(bandwidth, gemv, 16 * 2**20) == "gemv_q4"


def test_the_default_roofline_shrinks_to_a_faked_8gb_mac(monkeypatch, tmp_path):
    from mac_moesd.machine import hardware, memory

    with monkeypatch.context() as m:  # an 8 GB M1: working set 2/3 of RAM, vm_stat of macOS 13
        text = (Path(__file__).parent / "data" / "vm_stat_macos13_m1_8gb_handwritten.txt").read_text()
        m.setattr(mx.metal, "is_available", lambda: True)
        m.setattr(hardware, "mlx_device_info", lambda: {"max_recommended_working_set_size": 8 * 2**30 * 2 // 3})
        m.setattr(hardware, "run_tool", lambda argv: text)
        m.setattr(memory, "mlx_held_bytes", lambda: 0)
        usable = memory.usable().usable_bytes
    # free pages 3_081_601_024 bytes (test_memory) under the 5.3 GiB working set, less 5%
    assert usable == 3_081_601_024 - int(3_081_601_024 * memory.MARGIN)
    full = roofline.RooflineConfig()
    # default peak: a and b of 1 GiB and 2 GiB of launch outputs; without the 1 GiB size the
    # peak is two 256 MiB arrays and the 1 GiB launch floor
    assert roofline.peak_bytes(full) == 4 * 2**30
    cfg, shrunk = roofline.fit_memory(full, usable)
    assert cfg.sizes == tuple(MiB * s for s in (1, 4, 16, 64, 256)) and cfg.gemv_bytes == full.gemv_bytes
    assert shrunk == {"usable_bytes": usable, "plateau_reached": True,
                      "from": {"sizes_bytes": list(full.sizes), "gemv_bytes": 512 * MiB,
                               "min_launch_bytes": 2**30, "peak_bytes": 4 * 2**30},
                      "to": {"sizes_bytes": list(cfg.sizes), "gemv_bytes": 512 * MiB,
                             "min_launch_bytes": 2**30, "peak_bytes": 3 * 2**29}}
    assert roofline.fit_memory(full, 4 * 2**30) == (full, None)

    # `run` measures it shrunk (here at the tests' sizes), not skipped, and the report says so
    from mac_moesd.pipeline import plans, runner, stages
    from mac_moesd.reporting import report
    from mac_moesd.results import ResultsStore

    seen = {}
    real = roofline.run_roofline

    def small(cfg, *args, shrunk=None, **kw):
        seen["cfg"] = cfg
        return real(TINY, *args, shrunk=shrunk, **kw)

    monkeypatch.setattr(roofline, "run_roofline", small)
    store = ResultsStore(tmp_path / "results.json", {"chip_slug": "x", "backend": "cpu"})
    outcome = runner.Outcome()
    plan = replace(plans.default_plan("cpu", quick=False), roofline=full)
    ctx = runner.Context(store, "cpu", None, outcome, usable_bytes=usable)
    runner.isolated(store, outcome, "roofline", lambda: stages.roofline_stage(plan).work(ctx))
    assert outcome.ran == ["roofline"] and outcome.skipped == {}
    assert seen["cfg"] == cfg and store.data["roofline"]["shrunk"] == shrunk
    md = report.to_markdown(report.build_blocks(store.data, {}))
    assert ("> Shrunk to fit memory: the configured roofline peaks at 4.0 GiB and 2.7 GiB was usable, so it ran "
            "with STREAM arrays up to 256 MiB (not 1.0 GiB), peaking at 1.5 GiB.") in md


MiB = roofline.MiB


def test_shrinking_keeps_a_size_past_the_plateau_and_refuses_below_the_smallest():
    full = roofline.RooflineConfig()
    # At 1 GiB: without the 1 GiB size the peak is 1.5 GiB (two 256 MiB arrays, 1 GiB of launch
    # outputs); halving the launch floor to 512 MiB leaves the GEMV step on top: four 80 MiB 4-bit
    # copies of the 512 MiB weight plus its float32 source twice, 1344 MiB; the weight halved to
    # 256 MiB needs seven 40 MiB copies (280 MiB) or four 72 MiB 8-bit ones (288 MiB) plus 512 MiB,
    # and the peak is the STREAM step's 2 x 256 MiB + 512 MiB = 1 GiB.
    cfg, shrunk = roofline.fit_memory(full, 2**30)
    assert max(cfg.sizes) == 256 * MiB and cfg.min_launch_bytes == 256 * MiB and cfg.gemv_bytes == 256 * MiB
    assert roofline.peak_bytes(cfg) == 2**30 and shrunk["plateau_reached"]
    with pytest.raises(roofline.BadInput, match="usable here"):
        roofline.fit_memory(full, 100 * MiB)


def test_run_reads_the_one_size_schedule_and_help_lists_its_default():
    # run: --quick the quick sizes (1, 16, 128 MiB); on the CPU backend those and 512 MiB; else
    # the default's six, 1 MiB to 1 GiB by factors of 4
    assert roofline.run_config("metal", True).sizes == (MiB, 16 * MiB, 128 * MiB)
    assert roofline.run_config("cpu", False).sizes == (MiB, 16 * MiB, 128 * MiB, 512 * MiB)
    assert roofline.run_config("metal", False).sizes == tuple(MiB * 4**i for i in range(6))
    # the CLI does not import MLX to print its help, so it spells the default out: it must match
    help_text = " ".join(CliRunner().invoke(cli, ["roofline", "--help"]).output.split())
    assert "[default: 1,4,16,64,256,1024]" in help_text
    assert roofline.SIZES == tuple(MiB * s for s in (1, 4, 16, 64, 256, 1024))
