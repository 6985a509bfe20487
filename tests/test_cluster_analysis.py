"""The communication term, the cluster section of fit and report, compare and the per-rank dry run."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mac_moesd.analysis import cluster, fit
from mac_moesd.cli import cli
from mac_moesd.reporting import compare, report
from mac_moesd.results import load_results

FIXTURE = Path(__file__).parent / "data" / "results_quick_cpu.json"  # today's recorded `run --quick`
LATENCY, BANDWIDTH, HIDDEN, LAYERS = 50e-6, 1e9, 512, 4  # a made-up link, recovered below


def cluster_results() -> dict:
    """The CI fixture as if its tiny-moe sweep had run on 2 ranks, expert parallel: one all-reduce
    of B x t x hidden float32 per layer, timed on a link of LATENCY and BANDWIDTH."""
    data = load_results(FIXTURE)
    data["meta"]["cluster"] = {"ranks": 2, "backend": "ring", "hosts": ["a", "b"], "parallel": "expert"}
    data["fits"] = {}
    entry = next(e for e in data["sweeps"].values() if e["model"] == "tiny-moe")
    points = {}
    for key in entry["points"]:
        b, t = (int(v) for v in key.split("x"))
        nbytes = b * t * HIDDEN * 4
        op = {"op": "all_sum", "shape": [b, t, HIDDEN], "dtype": "float32", "count": LAYERS, "bytes": nbytes,
              "launches": 8, "median_s": LATENCY + nbytes / BANDWIDTH, "iqr_s": 0.0, "cv": 0.0, "repeats": 5}
        points[key] = {"ops": [op], "total_s": LAYERS * op["median_s"]}
    data["communication"] = {"tiny-moe|float32|L64|layers4": {
        "model": "tiny-moe", "context": 64, "parallel": "expert", "ranks": 2, "points": points}}
    return data


def test_comm_term_recovers_latency_and_bandwidth():
    term = cluster.comm_term(cluster_results(), "tiny-moe")
    (kind,) = term.kinds
    assert (kind["op"], kind["count"], kind["bytes_per_token"]) == ("all_sum", LAYERS, HIDDEN * 4)
    assert kind["latency_s"] == pytest.approx(LATENCY, rel=1e-6)
    assert kind["bandwidth_bytes_s"] == pytest.approx(BANDWIDTH, rel=1e-6)
    n = np.array([1, 5, 40])
    assert term.time(n) == pytest.approx(LAYERS * (LATENCY + n * HIDDEN * 4 / BANDWIDTH))
    assert cluster.CommTerm.from_dict(json.loads(json.dumps(term.to_dict()))) == term
    assert cluster.comm_term(load_results(FIXTURE)) is None  # one machine: no term


@pytest.fixture(scope="module")
def cluster_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster")
    (folder / "results.json").write_text(json.dumps(cluster_results()))
    result = CliRunner().invoke(cli, ["fit", str(folder), "--model", "tiny-moe", "--json"])
    assert result.exit_code == 0, result.stderr
    return folder, json.loads(result.stdout)


def test_fit_adds_the_measured_communication(cluster_folder):
    _, doc = cluster_folder
    term = cluster.CommTerm.from_dict(doc["communication"])
    model = fit.FittedModel.from_document(doc)
    # The recovered link's C(n) = LAYERS*(LATENCY + n*HIDDEN*4/BANDWIDTH) = 4*(50e-6 + 2048e-9*n):
    # n = 1: 4*52.048e-6 = 2.08192e-4; n = 4*5 = 20: 4*90.96e-6 = 3.6384e-4;
    # n = 16*9 = 144: 4*344.912e-6 = 1.379648e-3 s
    for (b, t), c in zip(((1, 1), (4, 5), (16, 9)), (2.08192e-4, 3.6384e-4, 1.379648e-3)):
        assert (model.target(b, t, 64) - model.target(b, t, 64, comm=False)) == pytest.approx(c, rel=1e-5)
    section = doc["cluster"]
    assert (section["ranks"], section["parallel"], section["verify_tokens"]) == (2, "expert", "gamma+1")
    # The section's shares divide by the forwards as the loops run them (pipelined); the values
    # themselves are worked by hand in test_cluster_rows_worked_by_hand.
    for row in section["rows"]:
        b, g = row["batch"], row["gamma"]
        verify = model.target(b, g + 1, 64, pipelined=True)  # as the loops run it
        assert row["comm_share_verify"] == pytest.approx(float(term.time(b * (g + 1)) / verify))
        plain = model.target(b, 1, 64, pipelined=True)
        assert row["comm_share_plain"] == pytest.approx(float(term.time(b) / plain))
        # the latency is paid once per forward: less of it per token in a verify window
        assert row["comm_per_token_verify_s"] < row["comm_per_token_plain_s"]
        assert row["speedup"] == pytest.approx(float(model.speedup(b, g, 0.7, 64)))
        assert row["speedup_free_link"] == pytest.approx(float(model.speedup(b, g, 0.7, 64, comm=False)))


@pytest.mark.slow  # several whole fits, or a fit in another process: seconds each
def test_report_has_the_cluster_section(cluster_folder):
    folder, doc = cluster_folder
    data = json.loads((folder / "results.json").read_text())
    md = report.write_report(data, folder)["markdown"].read_text()
    assert "## Cluster: 2 ranks, expert parallel" in md
    assert "over the **ring** backend on a, b" in md
    assert "| 1 | 1 |" in md and f"{LAYERS} x all_sum of {HIDDEN * 4} B" in md
    row = doc["cluster"]["rows"][0]
    assert (f"| {row['batch']} | {row['gamma']} | {row['speedup']:.2f} | {row['speedup_free_link']:.2f} | "
            f"{row['comm_share_plain']:.1%} | {row['comm_share_verify']:.1%} |") in md
    single = report.write_report(load_results(FIXTURE), folder / "single")["markdown"].read_text()
    assert "## Cluster" not in single


def test_compare_one_machine_against_two(cluster_folder, tmp_path):
    folder, doc = cluster_folder
    (tmp_path / "one").mkdir()
    shutil.copy(FIXTURE, tmp_path / "one" / "results.json")
    result = CliRunner().invoke(cli, ["compare", str(tmp_path / "one"), str(folder),
                                      "--out", str(tmp_path / "cmp")])
    assert result.exit_code == 0, result.stderr
    one, two = compare.compare([tmp_path / "one", folder])["machines"]
    assert (one["ranks"], two["ranks"], two["parallel"]) == (1, 2, "expert")
    assert two["chip"] == f"2 x {one['chip']} (expert, ring)"
    share = next(r["comm_share_verify"] for r in doc["cluster"]["rows"] if r["batch"] == 1 and r["gamma"] == 4)
    assert two["comm_share_verify"] == {"tiny-moe": share} and one["comm_share_verify"] == {}
    assert f"2 x {one['chip']} (expert, ring), tiny-moe: {share:.1%}" in result.stdout


@pytest.mark.parametrize("parallel", ["tensor", pytest.param("expert", marks=pytest.mark.slow),
                                      pytest.param("pipeline", marks=pytest.mark.slow)])
def test_dry_run_plans_deepseek_v3_per_rank_on_two_m3_ultras(parallel):
    args = ["run", "--dry-run", "--models", "deepseek-v3", "--chip", "Apple M3 Ultra", "--memory", "512",
            "--ranks", "2", "--parallel", parallel, "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert (doc["ranks"], doc["parallel"], doc["bits"]) == (2, parallel, 4)
    sweep = next(s for s in doc["stages"] if s["stage"].startswith("sweep deepseek-v3"))
    whole = doc["whole_model_bytes"]["deepseek-v3"]
    assert whole > doc["usable_bytes"] * 0.9  # about one 512 GB Mac's working set on its own
    assert [r["rank"] for r in sweep["ranks"]] == [0, 1]
    assert all(r["peak_bytes"] <= doc["usable_bytes"] for r in sweep["ranks"]) and sweep["fits"]
    assert sweep["eta_s"] > 0 and doc["eta_s"] > sweep["eta_s"]
    if not sweep["extrapolated"]:
        assert sum(r["weights_bytes"] for r in sweep["ranks"]) < 1.1 * whole
    ops = {o["op"] for o in sweep["collectives_per_token"]}
    assert ops == {"pipeline": {"all_gather", "sendrecv"}, "tensor": {"all_sum"}, "expert": {"all_sum"}}[parallel]


@pytest.mark.parametrize("draft", ["prompt-lookup", "mtp-head"])
def test_dry_run_plans_a_cluster_pair_whose_drafter_is_no_model(tiny_pair, draft):
    args = ["run", "--dry-run", "--target", tiny_pair[0], "--draft", draft, "--chip", "Apple M2", "--memory", "16",
            "--ranks", "2", "--json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    # the target alone is sharded: no drafter model to plan
    assert [s["stage"] for s in doc["stages"] if s["stage"].startswith("sweep")] == [f"sweep {tiny_pair[0]} (tensor x2)"]


def test_ranks_need_the_dry_run():
    result = CliRunner().invoke(cli, ["run", "--ranks", "2"])
    assert result.exit_code == 2 and "mlx.launch -n N" in result.stderr


def test_cluster_rows_worked_by_hand():
    # One all-sum per layer over 4 layers, 2048 B per token, 50 us latency, 1 ns per byte:
    # C(n) = 4*(50e-6 + 1e-9*2048*n): C(1) = 2.08192e-4, C(4) = 2.32768e-4, C(5) = 2.4096e-4,
    # C(20) = 3.6384e-4 s. T_T(n) = 1 ms + 0.1 ms per token: T(1) 1.1, T(4) 1.4, T(5) 1.5, T(20) 3.0 ms.
    comm = cluster.CommTerm(({"op": "all_sum", "count": 4, "bytes_per_token": 2048.0, "latency_s": 50e-6,
                                      "seconds_per_byte": 1e-9, "points": 3},))
    calls = []

    def speedup(b, g, alpha, with_comm):
        calls.append((b, g, alpha, with_comm))
        return 2.0 if with_comm else 3.0

    rows = cluster.cluster_rows(lambda b, t: 1e-3 + 1e-4 * b * t, comm, speedup, batches=(1, 4), gammas=(4,))
    one, four = rows
    # B = 1, gamma 4 (a 5-token verify): shares 2.08192e-4/1.1e-3 = 0.189265 and 2.4096e-4/1.5e-3
    # = 0.16064; per token 2.08192e-4 plain, 2.4096e-4/5 = 4.8192e-5 in the verify window.
    assert (one["batch"], one["gamma"], one["verify_tokens"]) == (1, 4, 5)
    assert one["comm_share_plain"] == pytest.approx(0.189265, abs=1e-6)
    assert one["comm_share_verify"] == pytest.approx(0.16064)
    assert (one["comm_per_token_plain_s"], one["comm_per_token_verify_s"]) == (pytest.approx(2.08192e-4),
                                                                              pytest.approx(4.8192e-5))
    # B = 4: plain 2.32768e-4/1.4e-3 = 0.166263; verify of 20 tokens 3.6384e-4/3.0e-3 = 0.12128;
    # per token 2.32768e-4/4 = 5.8192e-5 plain, 3.6384e-4/20 = 1.8192e-5 verify.
    assert four["comm_share_plain"] == pytest.approx(0.166263, abs=1e-6)
    assert four["comm_share_verify"] == pytest.approx(0.12128)
    assert (four["comm_per_token_plain_s"], four["comm_per_token_verify_s"]) == (pytest.approx(5.8192e-5),
                                                                                pytest.approx(1.8192e-5))
    # The speedups are the callable's, with the link and without it, at the default alpha 0.7.
    assert (one["speedup"], one["speedup_free_link"], one["alpha"]) == (2.0, 3.0, 0.7)
    assert calls == [(1, 4, 0.7, True), (1, 4, 0.7, False), (4, 4, 0.7, True), (4, 4, 0.7, False)]
