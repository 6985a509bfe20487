"""Sharded sweeps: two ranks of MLX's ring backend on localhost, started by mlx.launch."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

from mac_moesd.cli import cli
from mac_moesd.inputs import models, zoo
from mac_moesd.measure.cluster import collectives, distributed

BIN = Path(sys.executable).parent
HELPER = Path(__file__).with_name("sharded_logits.py")
FAST = ["--context", "8", "--seconds-per-point", "0.01", "--quick", "--decode-chain", "4"]


def free_ports() -> int:
    """A port p with p and p+1 free (the ring backend listens on one port per rank)."""
    for _ in range(200):
        port = random.randrange(20000, 60000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def launch(*command, tag: str = "", env: dict | None = None) -> subprocess.Popen:
    args = [str(BIN / "mlx.launch"), "-n", "2", "--backend", "ring", "-p", str(free_ports()),
            "--env", f"MAC_MOESD_TEST_TAG={tag}", "--", *map(str, command)]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}, text=True)


def sweep_command(model, out, *extra):
    return [sys.executable, "-m", "mac_moesd", "sweep", model, *FAST, "--out", out, *extra]


def miniature(config_dir, name: str, **changes) -> Path:
    config = zoo.miniature(zoo.by_name(name).config)
    config.update(changes)
    return config_dir(config, name) / "config.json"


# ---- pure parts ----


def test_trace_summary_and_combination():
    rank0 = collectives.summarise_trace(
        [{"op": "recv_like", "shape": [1, 4, 64], "dtype": "float32"},
         {"op": "all_gather", "shape": [2, 4, 64], "dtype": "float32"}], ranks=2)
    rank1 = collectives.summarise_trace(
        [{"op": "send", "shape": [1, 4, 64], "dtype": "float32"},
         {"op": "all_gather", "shape": [2, 4, 64], "dtype": "float32"}], ranks=2)
    ops = collectives.combine([rank0, rank1])
    assert ops == [
        {"op": "all_gather", "shape": [1, 4, 64], "dtype": "float32", "count": 1, "bytes": 1024},
        {"op": "sendrecv", "shape": [1, 4, 64], "dtype": "float32", "count": 1, "bytes": 1024},
    ]


def test_trace_counts_what_a_forward_calls():
    with collectives.traced() as calls:
        mx.distributed.all_sum(mx.ones((2, 3)))  # a group of one: runs, and is recorded
    assert calls == [{"op": "all_sum", "shape": [2, 3], "dtype": "float32"}]
    assert mx.distributed.all_sum.__name__ != "call"  # restored


def test_launched_backend_from_environment():
    assert distributed.launched_backend({}) is None
    assert distributed.launched_backend({"MLX_HOSTFILE": "/tmp/h", "MLX_RANK": "0"}) == "ring"
    assert distributed.launched_backend({"MLX_IBV_DEVICES": "/tmp/d", "MLX_RANK": "1"}) == "jaccl"


def test_rank_config_divides_tensor_widths_and_pipeline_layers():
    config = zoo.by_name("tiny-moe").config
    tensor = distributed.rank_config(config, "tensor", 2, 4)
    assert tensor["num_attention_heads"] == 4 and tensor["moe_intermediate_size"] == 128
    assert distributed.rank_config(config, "pipeline", 2, 2)["num_hidden_layers"] == 2
    assert distributed.rank_config(config, "expert", 2, 4) == config


def test_parallel_outside_mlx_launch_is_a_usage_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_HOSTFILE", "MLX_RANK"))}
    result = CliRunner(env=env).invoke(cli, ["sweep", "tiny-moe", "--parallel", "expert", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "mlx.launch -n 2" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = CliRunner().invoke(cli, ["sweep", "tiny-moe", "--rank-timeout", "5"])
    assert result.exit_code == 2 and "--rank-timeout goes with --parallel" in result.stderr


@pytest.mark.timing
def test_watchdog_ends_a_silent_process_with_one_line():
    code = ("import time\nfrom mac_moesd.measure.clock.watchdog import Watchdog\n"
            "dog = Watchdog(1.0, 'rank 0: nobody answered')\n"
            "for _ in range(4):\n    time.sleep(0.5)\n    dog.beat()\n"
            "print('beats kept it alive', flush=True)\ntime.sleep(30)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "beats kept it alive" in done.stdout
    assert done.returncode == -signal.SIGTERM
    assert done.stderr.strip() == "Error: rank 0: nobody answered"
    assert time.monotonic() - start < 10


# ---- two ranks ----


@pytest.fixture(scope="module")
def sharded_logits(tmp_path_factory):
    """One launch: every (architecture, mode) pair's rank-0 logits, beside the whole model's."""
    root = tmp_path_factory.mktemp("sharded")
    out = root / "out"
    out.mkdir()
    cases, reference = [], {}
    configs = {
        "qwen3_moe": zoo.miniature(zoo.by_name("tiny-moe").config),  # mlx-lm's shard and pipeline
        "mixtral": zoo.miniature(zoo.by_name("mixtral-8x7b").config),  # MLX's layers (no shard method)
        "qwen2_moe": zoo.miniature(zoo.by_name("qwen1.5-moe-a2.7b").config),  # shared expert
        "deepseek_v2": zoo.miniature(zoo.by_name("deepseek-v2-lite").config),  # dense first layer + shared
        "olmoe": zoo.miniature(zoo.by_name("olmoe-1b-7b").config),  # q/k norms across heads
    }
    for name, config in configs.items():
        folder = root / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        for mode in ("pipeline", "tensor", "expert"):
            cases.append([str(folder / "config.json"), mode])
        built = models.build(models.resolve(str(folder / "config.json")), "float32", seed=0)
        built.materialise()
        tokens = mx.array(np.random.default_rng(1).integers(0, config["vocab_size"], (2, 5)))
        reference[name] = np.array(built.model(tokens))
    proc = launch(sys.executable, HELPER, out, json.dumps(cases))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return out, reference


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["pipeline", "tensor", "expert"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2", "olmoe"])
def test_sharded_logits_match_the_whole_model(sharded_logits, arch, mode):
    out, reference = sharded_logits
    refusal = out / f"{arch}-{mode}.txt"
    if mode == "pipeline" and arch in ("mixtral", "qwen2_moe", "olmoe"):  # no pipeline in mlx-lm
        assert refusal.read_text() == f"mlx-lm has no pipeline method for {arch}: use --parallel tensor or expert"
        return
    if mode == "tensor" and arch == "olmoe":  # its q/k norms span all heads: refused, not changed
        assert refusal.read_text() == "Attention.q_norm normalises across heads: splitting heads would change it"
        return
    assert not refusal.exists(), refusal.read_text() if refusal.exists() else ""
    logits = np.load(out / f"{arch}-{mode}.npy")
    np.testing.assert_allclose(logits, reference[arch], rtol=1e-4, atol=1e-4)
    how = (out / f"{arch}-{mode}.how").read_text()
    own = mode == "pipeline" or (mode == "tensor" and arch in ("qwen3_moe", "deepseek_v2"))
    assert how == ("mlx-lm" if own else "mlx.nn")


@pytest.mark.distributed
def test_sharded_sweep_rank0_writes_cluster_results(tmp_path, config_dir):
    model = miniature(config_dir, "tiny-moe")
    # forced uniform routing: each rank's slice of the experts still sees global expert indices
    proc = launch(*sweep_command(model, tmp_path / "res", "--parallel", "expert", "--batch", "1,2",
                                 "--tokens", "1,2", "--routing", "uniform", "--json"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    doc = json.loads(out)  # one document: rank 1 prints nothing
    assert (doc["ranks"], doc["backend"], doc["parallel"], len(doc["hosts"])) == (2, "ring", "expert", 2)
    assert doc["sharded_by"] == "mlx.nn"
    assert [(p["batch"], p["tokens"]) for p in doc["points"]] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert doc["routing"] == "uniform"
    for p in doc["points"]:
        assert p["median_s"] > 0 and p["comm_s"] > 0 and p["comm_share"] == p["comm_s"] / p["median_s"]
        assert p["pairs"] == p["batch"] * p["tokens"] * 2  # K = 2 of the miniature's 8 experts
        assert 1 <= p["unique_experts"] <= min(8, p["pairs"])
    ops = doc["communication"]["points"]["2x2"]["ops"]
    # expert parallel: one all-reduce of the MoE output per layer, B x t x hidden float32
    assert [(o["op"], o["shape"], o["count"], o["bytes"]) for o in ops] == [("all_sum", [2, 2, 64], 2, 1024)]
    data = json.loads((tmp_path / "res" / "results.json").read_text())
    assert data["meta"]["cluster"] == {"ranks": 2, "backend": "ring", "hosts": doc["hosts"], "parallel": "expert"}
    assert data["cluster"]["parallel"] == "expert"


def _rank_pid(tag: str, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"MAC_MOESD_TEST_TAG={tag}".encode() in environ and f"MLX_RANK={rank}".encode() in environ
                and b"mac_moesd" in cmdline and b"watchdog" not in cmdline):
            return int(proc.name)
    return None


def _points(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: p for e in data.get("sweeps", {}).values() for k, p in e["points"].items()}


def _kill_mid_sweep(tmp_path, config_dir, sig, extra=()):
    model = miniature(config_dir, "tiny-moe")
    results = tmp_path / "res" / "results.json"
    command = sweep_command(model, tmp_path / "res", "--parallel", "tensor", "--batch", "1,2",
                            "--tokens", "1,2,3", "--seconds-per-point", "0.2", *extra)
    tag = f"{sig}-{os.getpid()}-{time.monotonic_ns()}"
    proc = launch(*command, tag=tag)
    deadline = time.monotonic() + 90
    while not _points(results) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert _points(results), "no point was measured before the deadline"
    victim = _rank_pid(tag, 1)
    assert victim is not None
    os.kill(victim, sig)
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    return proc, err, time.monotonic() - start, command, results


@pytest.mark.distributed
@pytest.mark.timing  # a wall-clock bound on ending
def test_killed_rank_ends_the_run_and_a_rerun_resumes(tmp_path, config_dir):
    proc, err, elapsed, command, results = _kill_mid_sweep(tmp_path, config_dir, signal.SIGKILL)
    assert elapsed < 60
    # mlx.launch names the rank that died, then terminates the other (SIGTERM), which either saw
    # the loss first or was terminated before it could say so.
    assert "rank 1 exited with code -9" in err, err
    assert "Error: rank 0: lost the other ranks" in err or "rank 0 exited with code -15" in err, err
    kept = _points(results)
    assert 0 < len(kept) < 6
    rerun = launch(*command)
    _, err = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, err
    final = _points(results)
    assert len(final) == 6
    for key, point in kept.items():  # measured once, kept as they were
        assert final[key]["samples_s"] == point["samples_s"]


@pytest.mark.distributed
@pytest.mark.timing  # a wall-clock bound on ending
def test_hung_rank_ends_the_run_in_bounded_time(tmp_path, config_dir):
    proc, err, elapsed, *_ = _kill_mid_sweep(tmp_path, config_dir, signal.SIGSTOP, ("--rank-timeout", "4"))
    assert elapsed < 40
    assert "Error: rank 0: no answer from the other ranks for 4 s" in err, err  # its watchdog ended it


@pytest.mark.distributed
@pytest.mark.timing  # a wall-clock bound on ending
def test_rank_that_never_starts(tmp_path):
    port = free_ports()
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    start = time.monotonic()
    done = subprocess.run(sweep_command("tiny-moe", tmp_path / "res", "--parallel", "expert",
                                        "--rank-timeout", "3"),
                          env={**os.environ, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": "0"},
                          capture_output=True, text=True, timeout=60)
    assert time.monotonic() - start < 30
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "Error: rank 0: the other ranks did not connect within 3 s (one never started, "
        "or the hosts cannot reach each other)")
    assert not (tmp_path / "res" / "results.json").exists()
