import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from mac_moesd.reporting import compare, report
from mac_moesd.analysis import fit
from mac_moesd.measure.clock import timing
from mac_moesd.measure.experts import routing
from mac_moesd.pipeline import plans, stages
from mac_moesd.progress import Progress
from mac_moesd.cli import cli
from mac_moesd.results import ResultsStore, load_results

from test_fit import hand_fit_doc

FIXTURE = Path(__file__).parent / "data" / "results_quick_cpu.json"  # today's recorded `run --quick`
EARLY = Path(__file__).parent / "data" / "results_quick_cpu_early.json"  # before pipelining and second contexts
SECTIONS = ["## Verdict: is speculative decoding worth it here?", "## Answers", "## Roofline",
            "## Two-factor shape: what a t-token forward costs", "## Activated experts",
            "## The fitted MoESD model", "## Measured speculative decoding", "## Method"]


def by_hand(data: dict) -> dict:
    """``data`` with tiny-moe's fit replaced by test_fit's hand-worked one (T_T(n) = 0.95 +
    0.05n ms for n = B*t tokens, T_D = 0.1 ms; no KV term, rejection, one-row timing or
    pipelining), so that every SD prediction the report shows can be worked out by hand
    (``hand_speedup``) rather than taken from the fit code under test."""
    hand = hand_fit_doc()
    doc = data["fits"]["tiny-moe"]
    variant = dict(doc["variants"][0], **hand["variants"][0])
    doc.update(chosen="pairs", experts=hand["experts"], top_k=hand["top_k"], variants=[variant],
               params=variant["params"], k_kv=0.0, k_seq=0.0)
    for key in ("one_row", "pipelining", "kv"):
        doc.pop(key, None)
    return data


def hand_speedup(batch: int, gamma: int, alpha: float) -> float:
    """S = Omega * T(B) / (gamma T_D + T(B (gamma + 1)) + catch-up) under ``by_hand``'s fit for a
    run of the suite's loop (the fixture's are all), the catch-up being one more drafter step
    whenever every sequence accepted every draft, alpha^(gamma B) of rounds."""
    def step(n):
        return 0.95e-3 + 0.05e-3 * n

    omega = sum(alpha**i for i in range(gamma + 1))
    return omega * step(batch) / (gamma * 0.1e-3 + step(batch * (gamma + 1)) + alpha ** (gamma * batch) * 0.1e-3)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    data = by_hand(load_results(FIXTURE))
    folder = tmp_path_factory.mktemp("report")
    paths = report.write_report(data, folder)
    return data, folder, paths


def test_every_section_and_figure_present(written):
    data, folder, paths = written
    md = paths["markdown"].read_text()
    for section in SECTIONS:
        assert section in md
    for name in ("roofline", "ratio", "efficiency", "routing", "fit", "speedup"):
        assert (folder / "figures" / f"{name}.png").stat().st_size > 10_000
        assert f"figures/{name}.png" in md
    assert "not an Apple-silicon GPU" in md  # the CPU backend is labelled as such
    csv = paths["csv"].read_text().splitlines()
    assert csv[0].startswith("model,dtype,bits,context")
    assert len(csv) - 1 == sum(len(e["points"]) for e in data["sweeps"].values())


def test_numbers_in_the_text_are_those_of_the_results(written):
    data, _, paths = written
    md = paths["markdown"].read_text()
    roof = data["roofline"]
    assert f"Ridge point: **{roof['ridge_flop_per_byte']:.1f} FLOP/byte**" in md
    for f_ in data["fits"].values():
        assert f"Held-out MAPE **{f_['heldout_mape']:.1%}**" in md
        assert f"Knee of G at **{f_['knee_tokens']:.1f} tokens**" in md
        for v in f_["variants"]:
            chosen = "chosen" if v["name"] == f_["chosen"] else ""
            assert f"| {v['name']} | {v['heldout_mape']:.1%} | {v['knee_tokens']:.1f} | {chosen} |" in md
        assert f_["regime"] in md
        best = max((p for p in f_["predictions"] if p["batch"] == 1 and p["alpha"] == 0.7),
                   key=lambda p: p["speedup"])
        assert f"best gamma = {best['gamma']} with a predicted speedup of {best['speedup']:.2f}" in md
    for r in data["routing"].values():
        row = f"| {r['model']} | {r['text']} | {r['correlation']:.3f} | {r['batch_correlation']:.3f} | " \
              f"{r['threshold_uniform']} | {r['threshold_corrected']} |"
        assert row in md
    for s in data["spec"].values():
        for run in s["runs"]:
            # The table shows the imposed alpha; the prediction is at the acceptance the run
            # realised (emulated draws scatter around the imposed one).
            pred = hand_speedup(run["batch"], run["gamma"], run.get("measured_alpha", run["alpha"]))
            assert f"| {run['batch']} | {run['gamma']} | {run['gamma'] + 1} | {run['alpha']:.2f} | " in md
            low, high = run["speedup_range"]
            # Recorded before the SD stage timed its rounds: no prediction from them, no plain vs sweep.
            # The fit's prediction as stored with the run comes first; the hand fit, which is not the
            # one that priced the run, predicts otherwise, so its figure stands beside it.
            stored = run["predicted_by"]["model"]  # upgrade moved the early files' predicted_speedup
            assert (f"| {run['measured_speedup']:.2f} ({low:.2f}-{high:.2f}) | - | - | {stored:.2f} (current fit: "
                    f"{pred:.2f}) | {stored / run['measured_speedup'] - 1:+.0%} | - |") in md
    assert "not measured to a precision" in md


def test_the_verdict_leads_with_the_measurement_and_writes_out_a_disagreement(tmp_path):
    data = by_hand(load_results(FIXTURE))
    for f in data["fits"].values():
        f["fitted_at"] = "2026-12-01T10:00:00.000000+00:00"
    # Judged against the fit's prediction stored with each run (as the SD table shows it), made
    # here by the results' own fit at the acceptance the run realised.
    predicted = {id(r): hand_speedup(1, r["gamma"], r.get("measured_alpha", r["alpha"]))
                 for doc in data["spec"].values() for r in doc["runs"] if r["batch"] == 1}
    runs = [r for doc in data["spec"].values() for r in doc["runs"] if r["batch"] == 1]
    for r in runs:  # measured where predicted, to +-2%, as a run of 12 pairs whose budget ran out
        r.update(measured_speedup=predicted[id(r)], measured_ci=[predicted[id(r)] * 0.98, predicted[id(r)] * 1.02],
                 pairs=12, precision=0.01, precision_met=False, budget_s=30.0,
                 predicted_by={"measured": None, "model": predicted[id(r)], "fit": "2026-12-01T10:00:00.000000+00:00"})
    agreed = report.write_report(data, tmp_path / "agreed")["markdown"].read_text()
    verdict_text = agreed[agreed.index("## Verdict"):agreed.index("## Answers")]
    assert verdict_text.index("**Measured at batch 1**") < verdict_text.index("Prediction: at batch 1")
    assert "(disagrees)" not in agreed and "disagree**" not in agreed
    half = predicted[id(runs[0])] / 2
    runs[0]["measured_speedup"], runs[0]["measured_ci"] = half, [half * 0.98, half * 1.02]
    md = report.write_report(data, tmp_path / "off")["markdown"].read_text()
    assert md.count("**The measurement and the model disagree**") == 1
    assert (f"gamma {runs[0]['gamma']} measured {half:.2f} [{half * 0.98:.2f}-{half * 1.02:.2f}] 12 pairs, "
            f"budget spent, predicted {predicted[id(runs[0])]:.2f} (disagrees)") in md
    # This fixture's runs predate the timing of their rounds, so no term can be named.
    assert f"at gamma {runs[0]['gamma']} the run predates the timing of its round's parts" in md


def test_a_fit_from_before_the_variants_is_named_not_fatal(tmp_path):
    data = load_results(FIXTURE)
    for f in data["fits"].values():
        del f["chosen"]
    paths = report.write_report(data, tmp_path)
    md = paths["markdown"].read_text()
    assert "predates the expert-load variants; rerun `mac-moesd fit`" in md


def test_a_results_file_recorded_before_pipelining_and_second_contexts_still_reports(tmp_path):
    # The early fixture has no pipelined points, no second-context points and no unique-read
    # counts, and its stored fits predate k_seq, the one-row forward and pipelining: the report
    # is written with every section from what it has.
    data = load_results(EARLY)
    md = report.write_report(data, tmp_path)["markdown"].read_text()
    for section in SECTIONS:
        assert section in md


def test_html_is_self_contained(written):
    _, _, paths = written
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == 6
    assert not re.search(r"""(src|href)=['"]https?://""", page)
    assert "<h2>Roofline</h2>" in page


def test_partial_results_are_labelled_incomplete(tmp_path):
    data = load_results(FIXTURE)
    del data["routing"], data["fits"]
    md = report.write_report(data, tmp_path)["markdown"].read_text()
    assert "INCOMPLETE: no routing, fits" in md


def test_cli_report_from_a_folder(tmp_path):
    shutil.copy(FIXTURE, tmp_path / "results.json")
    result = CliRunner().invoke(cli, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "report.html").exists()


DEFAULT_PLAN = plans.default_plan


def tiny_plan():
    plan = DEFAULT_PLAN("cpu", quick=True)
    budget = timing.Budget(warmup=0, min_repeats=3, max_repeats=3, seconds_per_point=0.01, per_visit=1,
                           decode_chain=8)
    from dataclasses import replace

    from mac_moesd.measure.peaks import roofline

    return replace(plan, moe=("tiny-moe",), batches=(1, 2, 4), tokens=(1, 2, 3, 4), context=16,
                   budget=budget, spec_batches=(1, 2), spec_gammas=(2,), spec_tokens=4, spec_repeats=1,
                   routing_batches=(1, 2, 4),
                   roofline=roofline.RooflineConfig(sizes=(64 * 1024,), gemv_bytes=2**20, matmul_n=64,
                                                    qmm_shape=(128, 128), qmm_tokens=(1, 2, 4),
                                                    plateau_from=64 * 1024, budget=budget,
                                                    distinct_bytes=256 * 1024))


class Machine:
    backend = "cpu"
    available_bytes = None
    spec = None


class StagesDone(Progress):
    """A run's progress as its steps: the stages it expects, and each stage as it is done (a
    stage's own progress inside a run is named, not counted)."""

    def __init__(self):
        self.expected, self.done = None, []

    def expect(self, steps: int) -> None:
        self.expected = steps

    def advance(self, label: str) -> None:
        self.done.append(label)


@pytest.mark.slow
def test_run_interrupted_then_resumed(tmp_path, monkeypatch):
    store = ResultsStore(tmp_path / "results.json", {"chip_slug": "x", "backend": "cpu",
                                                      "versions": {}, "blas": {}})
    plan = tiny_plan()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(routing, "run_routing", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stages.run_all(plan, store, Machine())
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "roofline" in saved and len(saved["sweeps"]) == 2 and "fits" not in saved
    assert not (tmp_path / "report.md").exists()
    monkeypatch.undo()
    progress = StagesDone()
    store = ResultsStore(tmp_path / "results.json", {"chip_slug": "x", "backend": "cpu",
                                                      "versions": {}, "blas": {}})
    stages.run_all(plan, store, Machine(), progress)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["roofline"] == saved["roofline"]  # the finished stage was kept, not re-measured
    assert {"routing", "fits", "spec"} <= set(data)
    assert progress.expected == 6
    assert progress.done == ["roofline", "sweep tiny-moe", "sweep tiny-dense", "routing tiny-moe", "fit",
                             "spec tiny-moe"]
    paths = report.write_report(data, tmp_path)
    assert "## Verdict" in paths["markdown"].read_text()


@pytest.mark.slow
def test_cli_run_writes_the_chip_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(plans, "default_plan", lambda backend, quick, full=False: tiny_plan())
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    for name in ("results.json", "report.md", "report.html", "sweep.csv", "figures"):
        assert (folder / name).exists()
    assert "report: " in result.stdout


def test_compare_two_folders_and_reference_rows(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        shutil.copy(FIXTURE, tmp_path / name / "results.json")
    result = CliRunner().invoke(cli, ["compare", str(tmp_path / "a"), str(tmp_path / "b"),
                                      "--reference", "--out", str(tmp_path / "cmp"), "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [m["measured"] for m in doc["machines"]] == [True, True, False, False]
    h100 = doc["machines"][2]
    assert h100["ridge_flop_per_byte"] == pytest.approx(989e12 / 3350e9)
    assert "tiny-moe" in doc["models"]
    assert (tmp_path / "cmp" / "compare_ridge.png").exists()


def test_compare_rejects_an_older_schema(tmp_path):
    (tmp_path / "results.json").write_text('{"schema": "mac-moesd/0", "meta": {}}')
    result = CliRunner().invoke(cli, ["compare", str(tmp_path)])
    assert result.exit_code == 1
    assert "schema 'mac-moesd/0'" in result.stderr
    assert compare.REFERENCE_GPUS[0]["chip"].startswith("NVIDIA")


@pytest.mark.slow  # runs whole fits (seconds)
def test_a_fit_without_drafter_reports_target_efficiency_not_a_verdict(tmp_path):
    data = load_results(FIXTURE)
    del data["draft"]
    data["fits"] = {"tiny-moe": fit.fit_document(fit.fit(fit.inputs_from_results(data, "tiny-moe")))}
    md = report.write_report(data, tmp_path)["markdown"].read_text()
    assert "No verdict on speedup: speedups need the drafter step T_D(B,1)" in md
    assert "a verify window of gamma+1 tokens costs" in md
    assert not (tmp_path / "figures" / "speedup.png").exists()


def test_an_invalid_sd_run_is_marked_and_left_out_of_the_verdict(tmp_path):
    data = load_results(FIXTURE)
    doc = next(iter(data["spec"].values()))
    bad = next(r for r in doc["runs"] if r["batch"] == 1)
    bad["measured_speedup"] = 9.99  # what a rollback that did nothing might time
    bad["valid"], doc["valid"] = False, False
    bad["rollback"] = {"strategy": "trim", "requested": "auto", "cache_kinds": ["ArraysCache", "KVCache"],
                       "rounds": {"target": {"trim": 3}, "draft": {"trim": 3}},
                       "audit": {"ok": False, "max_abs_diff": 0.41, "tolerance": 1e-3}}
    md = report.write_report(data, tmp_path)["markdown"].read_text()
    assert (f"INVALID B=1 gamma={bad['gamma']}: caches differ from plain decoding by 0.41 (tolerance 0.001); "
            "its speedup is not a measurement of SD") in md
    assert "trim, AUDIT FAILED" in md
    verdict_text = md[md.index("## Verdict"):md.index("## Answers")]
    assert "9.99" not in verdict_text


def test_a_prompt_lookup_run_beside_the_fit_leaves_the_acceptance_range_to_the_runs_with_one(tmp_path):
    """Prompt lookup solves no acceptance (its proposals vary in length): its batch-1 run counts
    among the measured speedups, and the range of acceptances is that of the runs that have one."""
    data = load_results(FIXTURE)
    key, doc = next(iter(data["spec"].items()))
    with_alpha = [r for r in doc["runs"] if r["batch"] == 1]
    lookup_run = dict(with_alpha[0], mode="real", drafter_kind="prompt-lookup", measured_speedup=0.5,
                      lookup={"proposal_rate": 0.6, "mean_proposal": 2.0, "mean_width": 2.0, "rolled_back_share": 0.5})
    lookup_run.update(alpha=None, measured_alpha=None)
    for name in ("predicted_by", "predicted_speedup"):
        lookup_run.pop(name, None)
    data["spec"]["tiny-moe|prompt-lookup|real|edit"] = dict(
        doc, draft="prompt-lookup", drafter_kind="prompt-lookup", mode="real", runs=[lookup_run],
        prompts={"name": "edit", "encoding": "plain", "count": 4, "tokens": [20, 30]})
    md = report.write_report(data, tmp_path)["markdown"].read_text()
    realised = [r.get("measured_alpha", r["alpha"]) for r in with_alpha]
    assert f"realised {min(realised):.2f}-{max(realised):.2f})" in md


def test_the_fits_drafter_start_is_worded_with_its_share_of_a_batch_one_round():
    from test_fit import hand_fit_doc

    from mac_moesd.reporting import report

    # hand_fit_doc at context 0, B = 1, gamma 4: the start 0.2 + 0.1 + 3 x 0.05 = 0.45 ms on top of
    # four 0.1 ms steps and a 1.2 ms verify (mlx-lm's batch 1: no catch-up step): 0.45 / 2.05 = 22%.
    doc = {**hand_fit_doc(), "context": 0,
           "draft_start": {"a_s": 0.2e-3, "b_s": 0.1e-3, "c_s": 0.05e-3, "points": 12, "mape": 0.03}}
    (line,) = report._draft_start_lines(doc)
    assert "T_start(B, gamma) = 0.200 ms + 0.1000 ms x B + 0.050 ms x (gamma - 1)" in line
    assert "12 of them" in line and line.endswith(": 22% of a batch-1 round at gamma 4, alpha 0.7")
    assert report._draft_start_lines({**doc, "draft_start": {"points": 0}}) == []


def test_runs_of_one_drafter_are_not_priced_by_a_fit_made_with_another():
    # `run --target T --draft D1`, then `--draft D2` into the same folder: the fit of T now has
    # D2's step, so D1's runs get no prediction rather than one priced with the wrong drafter.
    from mac_moesd.analysis.digest import Digest

    d = Digest({"fits": {"T": {"model": "T", "chosen": "mlx", "draft_model": "D2"}}})
    assert d.fit_of("T", "D1") is None
    assert d.fit_of("T", "D2") is not None and d.fit_of("T") is not None
    assert d.fit_of("T", "prompt-lookup") is not None  # no drafter model: its step is not the fit's
    assert d.fit_of("T", "T") is not None  # self-draft prices the target as its own drafter
