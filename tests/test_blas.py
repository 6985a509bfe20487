"""Which BLAS MLX's CPU backend calls on Linux: OpenBLAS loaded before MLX, the system's when
present, else the pip-installed wheel through the package's forwarding library; the reference
BLAS (with a warning naming the fix) when opted out."""

import ctypes
import json
import os
import platform
import subprocess
import sys

import pytest

from mac_moesd.machine import blas

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="MLX's BLAS is chosen this way on Linux only")

DESCRIBE = ("import json, mac_moesd, mlx.core as mx, numpy as np; from mac_moesd.machine import blas; "
            "a = np.random.default_rng(0).standard_normal((96, 80), dtype=np.float32); "
            "err = float(np.abs(np.array(mx.array(a) @ mx.array(a.T)) - a @ a.T).max()); "
            "print(json.dumps({**blas.describe('cpu'), 'err': err}))")


def described(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", DESCRIBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return json.loads(out.stdout)


def test_mlx_multiplies_with_openblas_and_info_says_from_where():
    doc = described(MAC_MOESD_NO_OPENBLAS="")
    assert doc["name"] == "openblas" and doc["warning"] is None, doc
    assert "loaded from" in doc["note"] and os.path.exists(doc["path"])
    assert doc["err"] < 1e-3


def test_opting_out_leaves_the_reference_blas_and_says_so():
    doc = described(MAC_MOESD_NO_OPENBLAS="1")
    assert doc["name"] == "reference" and doc["path"] is None
    assert "MAC_MOESD_NO_OPENBLAS is set" in doc["warning"]
    assert doc["err"] < 1e-3


NO_THREAD_ENV = {name: "" for name in blas.THREAD_ENVS}


def fresh_state() -> dict:
    """``blas._state`` as before ``preload`` ran."""
    return {"libraries": [], "source": None, "skipped": None, "threads_from": None}


def test_openblas_leaves_one_core_to_python_building_the_next_graph():
    doc = described(MAC_MOESD_NO_OPENBLAS="", **NO_THREAD_ENV)
    assert doc["threads"] == max(1, len(os.sched_getaffinity(0)) - 1), doc
    assert "leaving one to Python" in doc["note"]


@pytest.mark.parametrize("variable", ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"])
def test_a_thread_count_the_environment_sets_is_kept(variable):
    doc = described(MAC_MOESD_NO_OPENBLAS="", **{**NO_THREAD_ENV, variable: "2"})
    assert doc["threads"] == min(2, len(os.sched_getaffinity(0))) and f"{variable} from the environment" in doc["note"], doc


@pytest.mark.parametrize("cores, threads", [(1, "1"), (2, "1"), (8, "7")])
def test_the_thread_count_is_one_fewer_than_the_cores(monkeypatch, cores, threads):
    for name in blas.THREAD_ENVS:
        monkeypatch.setenv(name, "")  # unset as far as OpenBLAS goes, and restored after the test
    monkeypatch.setattr(blas, "_state", fresh_state())
    monkeypatch.setattr(blas.os, "sched_getaffinity", lambda pid: set(range(cores)))
    blas._choose_threads()
    assert os.environ["OPENBLAS_NUM_THREADS"] == threads and f"the {cores} cores" in blas._state["threads_from"]


@pytest.fixture
def fresh_preload(monkeypatch):
    """``preload`` as on a fresh import: nothing loaded yet, MLX not imported, loads recorded."""
    loads = []
    monkeypatch.setattr(blas, "_state", fresh_state())
    for name in blas.THREAD_ENVS:
        monkeypatch.setenv(name, "1")  # the count is not what these tests are about
    monkeypatch.delitem(sys.modules, "mlx.core")
    monkeypatch.delenv(blas.OPT_OUT_ENV, raising=False)
    monkeypatch.setattr(blas.ctypes, "CDLL", lambda path, mode=0: loads.append((path, mode)))
    return loads


def test_the_system_openblas_is_preferred(fresh_preload, monkeypatch):
    system = blas.OPENBLAS_CANDIDATES[2]
    monkeypatch.setattr(blas.os.path, "exists", lambda path: path == system)
    assert blas.preload() == system
    assert fresh_preload == [(system, ctypes.RTLD_GLOBAL)]
    assert blas._state["source"] == "the system" and blas.preloaded_libraries() == [system]


def test_without_it_the_wheel_then_its_forwarding_library_load_globally(fresh_preload, monkeypatch):
    monkeypatch.setattr(blas, "_wheel_openblas", lambda: ("/w/libscipy_openblas.so", "/p/_cblas_forward.so"))
    monkeypatch.setattr(blas.os.path, "exists", lambda path: False)
    assert blas.preload() == "/w/libscipy_openblas.so"
    assert fresh_preload == [("/w/libscipy_openblas.so", ctypes.RTLD_GLOBAL), ("/p/_cblas_forward.so", ctypes.RTLD_GLOBAL)]
    assert "scipy-openblas32" in blas._state["source"]
    assert blas.preloaded_libraries() == ["/w/libscipy_openblas.so", "/p/_cblas_forward.so"]  # a server's LD_PRELOAD


def test_without_any_the_reason_names_both_fixes(fresh_preload, monkeypatch):
    monkeypatch.setattr(blas, "_wheel_openblas", lambda: None)
    monkeypatch.setattr(blas.os.path, "exists", lambda path: False)
    assert blas.preload() is None and fresh_preload == []
    assert "C compiler" in blas._state["skipped"] and "apt-get install" in blas._state["skipped"]


def test_a_launched_server_calls_the_same_openblas():
    from mac_moesd.measure.server import server_process

    env = {**server_process._child_env(), "MAC_MOESD_NO_OPENBLAS": "1"}  # only LD_PRELOAD loads it there
    out = subprocess.run([sys.executable, "-c", DESCRIBE], capture_output=True, text=True, check=True, env=env)
    doc = json.loads(out.stdout)
    assert doc["path"] == blas.preloaded_libraries()[-1] and doc["err"] < 1e-3
