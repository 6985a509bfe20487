"""`run`: a failing stage is skipped with its reason, the others still run, the report is written,
and the exit status says how complete the run was."""

import dataclasses
import json
from pathlib import Path

import pytest

from click.testing import CliRunner
from test_report import Machine, tiny_plan

from mac_moesd.measure.experts import routing
from mac_moesd.measure.forward import sweep
from mac_moesd.measure.peaks import roofline
from mac_moesd.measure.sd import speedup
from mac_moesd.pipeline import plans, stages
from mac_moesd.pipeline.runner import Context, Outcome
from mac_moesd.cli import cli
from mac_moesd.errors import MacMoesdError
from mac_moesd.results import ResultsStore

RECORDED = Path(__file__).parent / "data" / "results_quick_cpu.json"  # a recorded `run --quick`
META = {"chip_slug": "x", "backend": "cpu", "versions": {}, "blas": {}}


def metal_failure(*args, **kwargs):
    # What MLX raises when a Metal command buffer fails (e.g. out of memory mid-forward).
    raise RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory\nmore detail")


@pytest.mark.slow
def test_a_stage_raising_runtime_error_is_skipped_and_the_rest_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(routing, "run_routing", metal_failure)
    store = ResultsStore(tmp_path / "results.json", META)
    outcome = stages.run_all(tiny_plan(), store, Machine())
    assert outcome.skipped == {"routing tiny-moe": "RuntimeError: [METAL] Command buffer execution "
                                                   "failed: Insufficient Memory"}
    assert outcome.exit_status == 3
    assert outcome.ran == ["roofline", "sweep tiny-moe", "sweep tiny-dense", "fit", "spec tiny-moe"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["skipped"] == outcome.skipped and {"fits", "spec"} <= set(saved)

    monkeypatch.undo()  # a rerun retries the skipped stage and clears its reason
    store = ResultsStore(tmp_path / "results.json", META)
    outcome = stages.run_all(tiny_plan(), store, Machine())
    assert outcome.skipped == {} and outcome.exit_status == 0
    assert json.loads((tmp_path / "results.json").read_text())["skipped"] == {}


@pytest.mark.slow
def test_a_failed_sweep_skips_its_fit_and_spec_with_reasons(tmp_path, monkeypatch):
    real = sweep.run_sweep

    def moe_fails(cfg, *args, **kwargs):
        if cfg.model == "tiny-moe":
            raise MacMoesdError("tiny-moe with 2 layers needs about 9.0 GiB but 5.3 GiB is usable")
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(sweep, "run_sweep", moe_fails)
    monkeypatch.setattr(routing, "run_routing", metal_failure)
    store = ResultsStore(tmp_path / "results.json", META)
    outcome = stages.run_all(tiny_plan(), store, Machine())
    assert set(outcome.skipped) == {"sweep tiny-moe", "routing tiny-moe", "fit", "spec tiny-moe"}
    assert outcome.skipped["fit"] == "no MoE sweep finished, so there is nothing to fit"
    assert outcome.exit_status == 3  # the roofline and the dense sweep were measured


def test_nothing_measured_exits_1(tmp_path, monkeypatch):
    for module, name in ((sweep, "run_sweep"), (routing, "run_routing"), (speedup, "run_spec")):
        monkeypatch.setattr(module, name, metal_failure)
    monkeypatch.setattr(roofline, "run_roofline", metal_failure)
    store = ResultsStore(tmp_path / "results.json", META)
    assert stages.run_all(tiny_plan(), store, Machine()).exit_status == 1


@pytest.mark.slow
def test_cli_run_with_a_skipped_stage_writes_the_report_and_exits_3(tmp_path, monkeypatch):
    monkeypatch.setattr(plans, "default_plan", lambda backend, quick, full=False: tiny_plan())
    monkeypatch.setattr(routing, "run_routing", metal_failure)
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert "warning: skipped routing tiny-moe: RuntimeError: [METAL] Command buffer" in result.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    md = (folder / "report.md").read_text()
    assert "Skipped routing tiny-moe: RuntimeError: [METAL] Command buffer" in md
    assert "## Verdict" in md


def test_cli_run_into_an_unwritable_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(blocker / "reports")])
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: cannot write results to ")
    assert len(result.stderr.strip().splitlines()) == 1
    assert blocker.read_text() == "not a folder"


@pytest.mark.slow
def test_an_sd_run_that_fails_its_audit_fails_its_stage_and_is_measured_again(tmp_path, monkeypatch):
    real = speedup.run_spec

    def invalid(*args, **kwargs):
        document = real(*args, **kwargs)
        document["runs"][0]["valid"] = document["valid"] = False
        return document

    monkeypatch.setattr(speedup, "run_spec", invalid)
    store = ResultsStore(tmp_path / "results.json", META)
    outcome = stages.run_all(tiny_plan(), store, Machine())
    assert outcome.exit_status == 3
    assert "failed its SD audit" in outcome.skipped["spec tiny-moe"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert next(iter(saved["spec"].values()))["valid"] is False  # kept, for the report to mark

    monkeypatch.undo()  # a rerun measures the invalid document again
    outcome = stages.run_all(tiny_plan(), ResultsStore(tmp_path / "results.json", META), Machine())
    assert outcome.skipped == {} and outcome.exit_status == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert next(iter(saved["spec"].values()))["valid"] is True


def test_the_sd_stage_finds_its_document_whatever_prompts_the_models_decode():
    # A target with weights decodes the code prompts without --prompts, and its document's key
    # says so; random weights decode random ids. Either is the stage's own, valid or not.
    (spec_stage,) = [s for s in stages.default_stages(tiny_plan()) if s.label.startswith("spec ")]
    valid, invalid = {"valid": True}, {"valid": False}
    assert not spec_stage.done({})
    assert spec_stage.done({"spec": {"tiny-moe|tiny-draft|emulated-acceptance": valid}})
    assert spec_stage.done({"spec": {"tiny-moe|tiny-draft|emulated-acceptance|code": valid}})
    assert not spec_stage.done({"spec": {"tiny-moe|tiny-draft|emulated-acceptance|code": invalid}})
    assert not spec_stage.done({"spec": {"tiny-moe|tiny-draft|real|code": valid,
                                         "tiny-moe-8x2|tiny-draft|emulated-acceptance": valid}})


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("quick", [True, False])
def test_every_run_and_spec_time_sd_runs_of_one_length(backend, quick):
    """Short runs pair closer in time (speedup.RUN_TOKENS): `spec` and every default plan use it."""
    assert plans.default_plan(backend, quick).spec_tokens == speedup.RUN_TOKENS
    spec_tokens = next(p for p in cli.commands["spec"].params if p.name == "new_tokens")
    assert spec_tokens.default == speedup.RUN_TOKENS == speedup.SpecConfig("t", "d").new_tokens


def test_a_model_named_otherwise_than_its_results_is_routed_fitted_and_timed_under_its_own_name(tmp_path, monkeypatch):
    # `--models TINY-MOE` (a zoo name in capitals; a folder's path likewise) resolves to tiny-moe,
    # the name its sweep and routing are stored by: the fit is made and stored under that name,
    # the SD stage finds it, and the routing a run measured counts as done on a rerun.
    recorded = json.loads(RECORDED.read_text())
    recorded.pop("fits"), recorded.pop("spec")
    (tmp_path / "results.json").write_text(json.dumps(recorded))
    store = ResultsStore(tmp_path / "results.json", recorded["meta"])
    plan = dataclasses.replace(plans.with_models(tiny_plan(), ("TINY-MOE", "tiny-dense")), context=64)  # as recorded
    staged = {s.label: s for s in stages.default_stages(plan)}
    assert staged["routing TINY-MOE"].done(store.data)

    timed = {}

    def spec(cfg, predictor, usable, plain_step, sources, store):
        timed.update(predictor=predictor, plain_step=plain_step, target=sources.target.name)
        return {"valid": True}

    monkeypatch.setattr(speedup, "run_spec", spec)
    ctx = Context(store, "cpu", None, Outcome())
    staged["fit"].work(ctx)
    assert list(store.data["fits"]) == ["tiny-moe"]
    staged["spec TINY-MOE"].work(ctx)
    assert timed["target"] == "tiny-moe" and timed["plain_step"](1) > 0


def test_a_run_whose_model_differs_from_the_one_its_name_claims_writes_nothing(tmp_path):
    recorded = json.loads(RECORDED.read_text())
    recorded["models"] = {"tiny-moe": {"config_sha256": "0000000000000000", "weights": "random"}}
    (tmp_path / "results.json").write_text(json.dumps(recorded))
    before = (tmp_path / "results.json").read_text()
    store = ResultsStore(tmp_path / "results.json", recorded["meta"])
    with pytest.raises(MacMoesdError, match="another model named tiny-moe"):
        stages.run_all(tiny_plan(), store, Machine())
    assert (tmp_path / "results.json").read_text() == before


def test_the_runs_fit_takes_its_own_sweep_and_drafter_not_the_first_stored(tmp_path):
    # An earlier run into the same folder swept the target at another context and with another
    # drafter, and its documents come first in the file: the fit of this run must not take them.
    recorded = json.loads(RECORDED.read_text())
    recorded.pop("fits"), recorded.pop("spec")
    (key, entry), = [(k, e) for k, e in recorded["sweeps"].items() if e["model"] == "tiny-moe"]
    other_context = {**entry, "context": 512}
    (draft_key, draft), = recorded["draft"].items()
    other_draft = {**draft, "model": "other-draft"}
    recorded["sweeps"] = {key.replace("L64", "L512"): other_context, **recorded["sweeps"]}
    recorded["draft"] = {draft_key.replace("tiny-draft", "other-draft"): other_draft, **recorded["draft"]}
    (tmp_path / "results.json").write_text(json.dumps(recorded))
    store = ResultsStore(tmp_path / "results.json", recorded["meta"])
    plan = plans.with_models(tiny_plan(), ("tiny-moe",))
    plan = dataclasses.replace(plan, context=64)
    stages.fit_targets(plan, plans.resolve_plan(plan), store, Outcome())
    fitted = store.data["fits"]["tiny-moe"]
    assert fitted["context"] == 64 and fitted["draft_model"] == "tiny-draft"
    with pytest.raises(MacMoesdError, match=r"no MoE sweep of tiny-moe at context 128 in the results \(they hold "
                                            r"tiny-moe at context 512, tiny-moe at context 64\)"):
        stages.fit_targets(dataclasses.replace(plan, context=128), plans.resolve_plan(plan), store, Outcome())
