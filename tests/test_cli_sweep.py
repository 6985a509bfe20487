import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from mac_moesd.machine import hardware
from mac_moesd.cli import cli
from mac_moesd.measure.forward import sweep

QUICK = ["--context", "16", "--seconds-per-point", "0.01", "--quick", "--decode-chain", "8"]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_zoo_json_lists_real_models():
    result = invoke("zoo", "--json")
    assert result.exit_code == 0, result.output
    rows = {m["name"]: m for m in json.loads(result.stdout)["models"]}
    assert rows["mixtral-8x7b"]["threshold_tokens"] == 11
    assert rows["qwen2-57b-a14b"]["threshold_tokens"] == 23
    assert rows["qwen2-57b-a14b"]["params_total"] == pytest.approx(57.4e9, rel=0.01)
    assert rows["qwen2.5-14b"]["experts"] is None
    assert all(m["source"] for m in rows.values())
    table = invoke("zoo")
    assert "qwen3-30b-a3b" in table.output and "T_thres" in table.output


@pytest.mark.slow  # loads and times models end to end
def test_sweep_json_contract(tmp_path):
    result = invoke("sweep", "tiny-moe", "--batch", "1,2", "--tokens", "1,2", *QUICK,
                    "--out", tmp_path, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    for key in ("model", "points", "context", "layers_measured", "layers_full", "meta"):
        assert key in doc
    assert doc["context"] == 16 and doc["layers_full"] == 4
    for p in doc["points"]:
        assert {"batch", "tokens", "median_s", "iqr_s", "cv", "repeats"} <= set(p)
        # --decode-chain sets the one-token points' chains; verify-sized windows keep theirs
        assert p["pipelined"]["steps"] == (8 if p["tokens"] == 1 else sweep.PIPELINED_STEPS)
    assert doc["meta"]["backend"] == hardware.mlx_backend()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["schema"] == "mac-moesd/3"


def test_sweep_table(tmp_path):
    result = invoke("sweep", "tiny-dense", "--batch", "1", "--tokens", "1,2", *QUICK, "--out", tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "T_T(B,t) / T_T(B,1)" in result.stdout
    assert any(line.split()[:2] == ["1", "1.00"] for line in result.stdout.splitlines())


def read_points(path):
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return next(iter(data.get("sweeps", {}).values()), {}).get("points", {})


# 12 points of different costs: the shuffled schedule visits every point each round, so points
# finish at rounds that differ by shape; a kill after the first finished point leaves some unmeasured
# with room to spare (6 points of one cost could all finish within one poll).
GRID = 12


def sweep_command(tmp_path):
    return [sys.executable, "-m", "mac_moesd", "sweep", "tiny-moe", "--batch", "1,2,4", "--tokens", "1,2,3,4",
            "--context", "16", "--seconds-per-point", "0.2", "--decode-chain", "8", "--out", str(tmp_path)]


@pytest.mark.slow
def test_sigkill_midway_then_resume(tmp_path):
    results = tmp_path / "results.json"
    cmd = sweep_command(tmp_path)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(read_points(results)) < 1 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = read_points(results)
    assert 1 <= len(before) < GRID, "the sweep should have been killed midway"
    json.loads(results.read_text())  # still valid JSON
    done = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    after = read_points(results)
    assert len(after) == GRID
    for key, value in before.items():
        assert after[key] == value


@pytest.mark.slow
def test_ctrl_c_keeps_results_and_says_how_to_resume(tmp_path):
    results = tmp_path / "results.json"
    cmd = sweep_command(tmp_path)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while len(read_points(results)) < 1 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "results written so far are kept" in err.strip().splitlines()[-1]
    assert "Traceback" not in err
    assert 1 <= len(read_points(results)) < GRID


@pytest.mark.slow  # loads and times models end to end
def test_another_model_of_the_same_name_is_refused_and_the_results_are_kept(tmp_path):
    # Two folders called my-moe (top-4 of 64 experts, top-8 of 64): the second sweep would find
    # the first one's points under its own key and report them as its own.
    from mac_moesd.inputs import zoo

    config = zoo.miniature(zoo.by_name("tiny-moe").config)
    first, second = tmp_path / "a" / "my-moe", tmp_path / "b" / "my-moe"
    for folder, top_k in ((first, config["num_experts_per_tok"]), (second, 8)):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": top_k}))
    out = tmp_path / "out"
    assert invoke("sweep", str(first), "--batch", "1", "--tokens", "1", *QUICK, "--out", out).exit_code == 0
    before = (out / "results.json").read_text()
    assert json.loads(before)["models"]["my-moe"]["weights"] == "random"
    result = invoke("sweep", str(second), "--batch", "1", "--tokens", "1", *QUICK, "--out", out)
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ") and "another model named my-moe (another config)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert (out / "results.json").read_text() == before
    # The same folder again, named another way, is the same model: it resumes.
    assert invoke("sweep", str(first) + "/", "--batch", "1", "--tokens", "1", *QUICK, "--out", out).exit_code == 0
