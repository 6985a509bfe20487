import json
import random

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import TINY_BUDGET

from mac_moesd.measure import kernels, roofline
from mac_moesd.cli import cli

TINY = roofline.RooflineConfig(
    sizes=(64 * 1024, 256 * 1024), gemv_bytes=2**20, matmul_n=64, qmm_shape=(128, 128),
    qmm_tokens=(1, 2, 4, 8), plateau_from=256 * 1024, budget=TINY_BUDGET, fma_iterations=8,
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
    doc = roofline.run_roofline(TINY, spec=None, backend="cpu")
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


def test_against_spec():
    spec = {"bandwidth_bytes_s": 400e9, "fp32_flops": 10e12}
    assert roofline._against_spec(spec, 300.0, 5.0) == {"bandwidth": 0.75, "fp32_flops": 0.5}
    assert roofline._against_spec(None, 300.0, 5.0) is None


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
    # tiny arrays on any backend are far under MIN_EVAL_S per launch: calibration raised K
    assert max(r["launches"] for r in doc["size_sweep"]) > 1
    assert doc["kernels"]["per_kernel"]["copy"]["path"] in {"metal", "mlx"}
    assert doc["memory"]["estimate_bytes"] == roofline.peak_bytes(TINY)
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
