"""`--json` prints one JSON document on stdout and nothing else, in a real process: CliRunner keeps
stderr apart within one interpreter, but a process's stdout also receives whatever a library
prints (mlx-lm's `[INFO]` lines, warnings, progress) where it should not."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
TINY_CLI = Path(__file__).with_name("tiny_cli.py")
TARGET, DRAFT = str(DATA / "tiny-pair" / "target"), str(DATA / "tiny-pair" / "draft")
SWEEP = ["--context", "8", "--seconds-per-point", "0.01", "--quick", "--decode-chain", "4"]


def json_of(tmp_path: Path, *args: str) -> dict:
    """Run `mac-moesd ARGS --json` (at the tests' sizes) and return its one JSON document."""
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # a warning printed anywhere must not reach stdout
    done = subprocess.run([sys.executable, str(TINY_CLI), *args, "--json"], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=env)
    assert done.returncode in (0, 3), done.stderr[-2000:]
    return json.loads(done.stdout)  # the whole of stdout is one document


# Two commands in the default suite (a process each costs an MLX import); the rest in the slow one.
FAST = {
    "theory": ["theory", "--experts", "8", "--top-k", "2"],
    "run --dry-run": ["run", "--quick", "--dry-run", "--chip", "Apple M1", "--memory", "8"],
}
OTHERS = {
    "fit": ["fit", "{results}"],
    "info": ["info"],
    "zoo": ["zoo"],
    "compare": ["compare", "{folder}"],
    "pair dry run": ["run", "--quick", "--dry-run", "--chip", "Apple M1", "--memory", "8", "--target", TARGET,
                     "--draft", DRAFT],
    "sweep": ["sweep", "tiny-moe", "--batch", "1", "--tokens", "1,2", *SWEEP, "--out", "out"],
    "roofline": ["roofline", "--quick", "--out", "out"],
    "routing": ["routing", "tiny-moe", "--batch", "1", "--tokens", "1,2", "--length", "8", "--out", "out"],
    "spec": ["spec", TARGET, "--draft", DRAFT, "--mode", "real", "--prompts", "code", "--batch", "1",
             "--gamma", "2", "--tokens", "6", "--repeats", "1", "--max-prompts", "2", "--out", "out"],
    "selftest": ["selftest"],
    "run": ["run", "--quick", "--out", "out"],
}


def _args(args: list[str], tmp_path: Path) -> list[str]:
    folder = tmp_path / "fixture"
    if not folder.exists():
        folder.mkdir()
        shutil.copy(DATA / "results_quick_cpu.json", folder / "results.json")
    return [a.format(results=folder / "results.json", folder=folder) for a in args]


@pytest.mark.parametrize("name", FAST)
def test_json_stdout_is_one_document(tmp_path, name):
    assert isinstance(json_of(tmp_path, *_args(FAST[name], tmp_path)), dict)


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
def test_json_stdout_of_every_other_command_is_one_document(tmp_path, name):
    doc = json_of(tmp_path, *_args(OTHERS[name], tmp_path))
    if name == "run":
        assert Path(doc["results"]).exists() and Path(doc["report"]["markdown"]).exists()
        assert doc["exit_status"] == 0 and doc["skipped"] == {}
