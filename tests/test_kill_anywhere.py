"""A kill at any moment loses at most the point in progress: one `run --quick` (at the tests'
sizes) killed with SIGKILL again and again, each time a little later into the resumed run, its
results file valid after every kill, and the last resume finishing with the whole report."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mac_moesd.machine import hardware
from mac_moesd.results import SCHEMA, load_results

TINY_CLI = Path(__file__).with_name("tiny_cli.py")

pytestmark = pytest.mark.slow


def measured(data: dict) -> int:
    """How much a results file holds: timed points, and the documents of the other stages."""
    points = sum(len(e.get("points", {})) for section in ("sweeps", "draft", "reject")
                 for e in data.get(section, {}).values())
    return points + sum(len(data.get(s, {})) for s in ("routing", "fits", "spec")) + bool(data.get("roofline"))


def test_a_run_killed_at_any_moment_resumes_to_the_whole_report(tmp_path):
    out = tmp_path / "reports"
    path = out / hardware.detect().slug / "results.json"
    command = [sys.executable, str(TINY_CLI), "run", "--quick", "--out", str(out)]
    held, kills, delay = -1, 0, 5.0  # an MLX import and a stage's set-up take a few seconds
    while True:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
        else:
            break  # it finished before this kill
        finally:
            proc.stderr.close()
        if path.exists():
            raw = json.loads(path.read_text())  # never half a file, whenever the kill came
            assert raw["schema"] == SCHEMA
            now = measured(load_results(path))
            assert now >= held  # nothing measured before was lost
            held = now
        delay *= 1.3  # the next kill, later into the resumed run
    assert proc.returncode == 0, f"after {kills} kills"
    assert kills >= 3  # the kills were spread over the run's stages
    data = load_results(path)
    # The last kill may land after the last save (while the report is written): then the resume
    # measures nothing new, and only writes the report.
    assert measured(data) >= held and data.get("skipped", {}) == {}
    assert set(data) >= {"roofline", "sweeps", "routing", "fits", "spec"}
    assert (path.parent / "report.md").exists() and (path.parent / "report.html").exists()
