"""Every results key is built and parsed by mac_moesd.results.keys, and nowhere else."""

import json
import re
from pathlib import Path

import pytest

from mac_moesd.results import keys

from test_results_schema import RECORDED

PACKAGE = Path(__file__).parent.parent / "mac_moesd"


def test_point_key_round_trip():
    assert keys.point_key(4, 3) == "4x3"
    assert keys.parse_point_key("4x3") == (4, 3)
    assert keys.parse_point_key(keys.point_key(128, 1)) == (128, 1)


def test_worked_keys():
    assert keys.sweep_key("tiny-moe", "float32", 64, 4) == "tiny-moe|float32|L64|layers4"
    assert keys.sweep_key("m", "q4", 512, 2, routing="uniform", gather="dense") == "m|q4|L512|layers2|routing=uniform|gather=dense"
    assert keys.reject_key(4096, 4) == "V4096|gamma4"
    assert keys.routing_key("tiny-moe", keys.prompt_set_text("code")) == "tiny-moe|prompt set code"
    assert keys.routing_key_model(keys.routing_key("a-b", "random token ids")) == "a-b"
    assert keys.sweep_key_variant(keys.sweep_key("m", "q4", 512, 2)) == ("model", "mlx-lm")
    assert keys.sweep_key_variant(keys.sweep_key("m", "q4", 512, 2, routing="trace:t.npz@ab", gather="sorted")) == (
        "trace:t.npz@ab", "sorted")
    assert keys.spec_key("t", "d", "real") == "t|d|real"
    assert keys.spec_key_parts(keys.spec_key("t", "d", "real")) == ("t", "d", "real", None)
    assert keys.spec_key_parts(keys.spec_key("t", "d", "real", "a/b.txt")) == ("t", "d", "real", "a/b.txt")
    assert keys.pair_spec_key("t", keys.MTP_HEAD, keys.drafter_kind(keys.MTP_HEAD), "chat") == "t|mtp-head|emulated-acceptance|chat"
    assert keys.pair_spec_key("t", "d", keys.drafter_kind("d"), "chat") == "t|d|real|chat"
    assert keys.serving_key(["a", "b"], None, None) == "url:a,b"
    assert keys.serving_key([], "t", "d") == keys.pair_key("t", "d") == "t|d"


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.parent.name if p.name == "results.json" else p.name)
def test_recorded_keys_are_the_keys_module_s(path):
    """Every key of a recorded file is what keys.py builds from its document's own fields, so a
    file written before keys.py resumes under the same keys."""
    data = json.loads(path.read_text())
    for section in ("sweeps", "draft"):
        for key, entry in data.get(section, {}).items():
            weight_format = f"q{entry['bits']}" if entry.get("bits") else entry["dtype"]
            assert key == keys.sweep_key(entry["model"], weight_format, entry["context"], entry["layers"],
                                         entry.get("routing", "model"), entry.get("gather", "mlx-lm"))
    for key, entry in data.get("reject", {}).items():
        assert key == keys.reject_key(entry["vocab"], entry["gamma"])
    for key, document in data.get("routing", {}).items():
        assert key == keys.routing_key(document["model"], document["text"])
    for key, document in data.get("spec", {}).items():
        modes = {run["mode"] for run in document["runs"]}
        assert len(modes) == 1 and key.startswith(keys.spec_key(document["target"], document["draft"], modes.pop()))


# A key's shape: a formatted field next to the "|" separator, a split on it, or a point's "x".
KEY_BUILDING = re.compile(r'''f"[^"\n]*(\}\||\|\{)|split\("\|"|partition\("\||"\|\w+=|"\|"\.join|\}x\{|f"V\{|startswith\(f"[^"\n]*\|''')


def test_no_key_is_built_or_parsed_outside_results():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "results":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if KEY_BUILDING.search(line):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "results keys built outside mac_moesd/results/keys.py:\n" + "\n".join(offenders)
