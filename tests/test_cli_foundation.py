import json

import pytest
from click.testing import CliRunner

from mac_moesd.analysis import theory
from mac_moesd.cli import cli


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("experts, top_k, expected", [(64, 8, 23), (64, 4, 47), (128, 4, 95), (8, 2, 11)])
def test_theory_json_thresholds(experts, top_k, expected):
    result = invoke("theory", "--experts", str(experts), "--top-k", str(top_k), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    for key in ("experts", "top_k", "rho", "tau", "threshold_tokens", "activated", "tokens_per_expert"):
        assert key in doc
    assert doc["threshold_tokens"] == expected
    rho = top_k / experts
    for row in doc["activated"]:
        assert row["uniform"] == pytest.approx(experts * (1 - (1 - rho) ** row["t"]))
        assert row["fraction"] == pytest.approx(row["uniform"] / experts)


def test_theory_correlation():
    doc = json.loads(invoke("theory", "-E", "64", "-K", "8", "-c", "0.67", "--json").stdout)
    assert doc["threshold_corrected"] == 33  # ceil(1 + (22.43 - 1)/0.67)
    assert doc["activated"][0]["correlated"] == 8.0  # exactly K at t = 1
    doc = json.loads(invoke("theory", "-E", "128", "-K", "8", "-c", "0.5613", "--max-tokens", "4",
                            "--json").stdout)
    assert doc["activated"][0]["correlated"] == pytest.approx(8.0, abs=1e-12)
    assert doc["activated"][3]["correlated"] == pytest.approx(20.36, abs=0.01)  # Cohere's window


def test_theory_table():
    result = invoke("theory", "-E", "8", "-K", "2", "--gamma", "2,4", "--alpha", "0.5,0.9")
    assert result.exit_code == 0
    assert "MoESD's batch threshold T_thres = 11 tokens" in result.output
    lines = result.output.splitlines()
    assert any(line.split()[:3] == ["1", "2.00", "0.250"] for line in lines)
    sigma = float(theory.normalised_acceptance(0.9, 4))
    assert any(line.split() == ["0.9", "4", f"{sigma * 5:.3f}", f"{sigma:.3f}"] for line in lines)


def test_info_json():
    result = invoke("info", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["backend"] in {"cpu", "metal", "cuda"}
    assert doc["slug"]
    assert doc["versions"]["mlx"]
    assert "name" in doc["blas"]


def test_help_everywhere():
    for args in (["--help"], ["info", "--help"], ["theory", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0
        assert "Usage:" in result.output
