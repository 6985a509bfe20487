"""Kernels.build with Metal faked: each kernel is probed and verified on its own."""

import mlx.core as mx
import numpy as np
import pytest

from mac_moesd.measure.peaks import kernels
from mac_moesd.errors import MacMoesdError


def _reference(name, inputs, shape):
    if name == "read":  # all of sum(a) in the first partial: same total as the kernel's
        return mx.concatenate([mx.sum(inputs[0]).reshape(1), mx.zeros((shape[0] - 1,))])
    if name == "copy":
        return inputs[0] + 0
    if name == "triad":
        b, c, s = inputs
        return b + s * c
    seed, m, k, iterations = inputs
    return mx.array(kernels.fma_reference(np.array(seed), m.item(), k.item(), iterations.item()))


def fake_metal(monkeypatch, broken: dict[str, str]):
    """Metal 'available'; metal_kernel returns fakes computing what each .metal body promises,
    except ``broken[name]``: "raise" (a compile or dispatch failure) or "wrong" (bad values)."""
    calls = []

    def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                     atomic_outputs=False):
        short = name.removeprefix("mac_moesd_")
        assert (tuple(input_names), tuple(output_names)) == kernels.SIGNATURES[short]
        assert all(arg in source for arg in (*input_names, *output_names))

        def run(*, inputs, grid, threadgroup, output_shapes, output_dtypes, **extra):
            calls.append((short, grid, threadgroup))
            assert len(inputs) == len(input_names) and output_dtypes == [mx.float32]
            assert threadgroup == (kernels.THREADGROUP, 1, 1) and grid[1:] == (1, 1)
            assert all(x.dtype == mx.float32 for x in inputs[:1])
            if broken.get(short) == "raise":
                raise RuntimeError(f"[metal::Device] Unable to build {short}")
            out = _reference(short, inputs, tuple(output_shapes[0]))
            return [out + 1 if broken.get(short) == "wrong" else out]

        return run

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.fast, "metal_kernel", metal_kernel)
    return calls


def test_every_kernel_is_probed_and_kept(monkeypatch):
    calls = fake_metal(monkeypatch, {})
    k = kernels.Kernels.build()
    assert k.paths == {name: "metal" for name in kernels.NAMES}
    assert {name for name, _, _ in calls} == set(kernels.NAMES)  # probed at build, each of them
    assert k.path == "metal" and "Metal kernel" in k.reason
    assert k.describe()["per_kernel"]["fma"]["path"] == "metal"


@pytest.mark.parametrize("name", kernels.NAMES)
@pytest.mark.parametrize("how", ["raise", "wrong"])
def test_only_the_failing_kernel_falls_back(monkeypatch, name, how):
    fake_metal(monkeypatch, {name: how})
    k = kernels.Kernels.build()
    assert k.paths[name] == "mlx"
    assert "failed" in k.reasons[name]
    assert ("Unable to build" if how == "raise" else "values wrong") in k.reasons[name]
    assert all(k.paths[other] == "metal" for other in kernels.NAMES if other != name)
    assert k.path == "mixed" and f"{name}: Metal kernel failed" in k.reason
    a = mx.arange(4 * kernels.READ_ROW, dtype=mx.float32)
    if name == "copy":  # the twin now serves the fallen-back kernel
        assert mx.array_equal(k.copy(a), a).item()
    if name == "fma":
        assert k.fma(a, 1.0, 1.0, 1) is None


def test_kernels_refuse_anything_but_float32(monkeypatch):
    fake_metal(monkeypatch, {})
    k = kernels.Kernels.build()
    half = mx.zeros((1024,), dtype=mx.float16)
    for call in (lambda: k.read(half), lambda: k.copy(half), lambda: k.triad(half, half, 2.0)):
        with pytest.raises(MacMoesdError, match="must be float32"):
            call()
    with pytest.raises(MacMoesdError, match="multiple of 4"):
        k.copy(mx.zeros((6,)))


def test_twin_path_refuses_float16_too():
    k = kernels.Kernels({n: "mlx" for n in kernels.NAMES}, {n: "test" for n in kernels.NAMES})
    with pytest.raises(MacMoesdError, match="float32"):
        k.read(mx.zeros((4096,), dtype=mx.float16))


def test_check_compares_on_device_in_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "CHECK_CHUNK", 100)
    want = mx.arange(1000, dtype=mx.float32)
    got = mx.concatenate([want[:617], mx.array([0.0]), want[618:]])
    with pytest.raises(kernels.KernelCheckFailed, match="1 of 1000 values wrong .first at 617: 0.0, expected 617.0"):
        kernels.check("copy", got, want)
    chunks = []
    kernels.check("triad", want * 2, lambda lo, hi: chunks.append((lo, hi)) or want[lo:hi] * 2)
    assert chunks[:10] == [(lo, lo + 100) for lo in range(0, 1000, 100)]
