"""`run --target --draft`: the pipeline on a pair of the user's own; the default run's search of
the Hugging Face cache for a known pair."""

import json
import shutil
from dataclasses import replace

import pytest
from click.testing import CliRunner
from pairs_helpers import qwen2_pair

from mac_moesd.pipeline import estimate, pair_stages, plans
from mac_moesd.cli import cli
from mac_moesd.errors import BadInput
from mac_moesd.inputs import models, pairs, zoo
from mac_moesd.measure.sd import speedup


@pytest.fixture(scope="module")
def own_pair(tmp_path_factory):
    """A pair saved in mlx-lm's format by this test module, seen nowhere else."""
    return qwen2_pair(tmp_path_factory.mktemp("own-pair"))


def cache_snapshot(root, repo, folder):
    snap = root / ("models--" + repo.replace("/", "--")) / "snapshots" / "0123abcd"
    shutil.copytree(folder, snap)
    return snap


def spec_peak(plan, target, draft):
    cfg = speedup.SpecConfig(target=target, draft=draft, batches=plan.spec_batches, gammas=plan.spec_gammas,
                          mode="real", context=plan.context, new_tokens=plan.spec_tokens)
    return speedup.estimate(cfg, models.build(models.resolve(target)), models.build(models.resolve(draft)))["peak_bytes"]


def test_the_default_run_takes_the_first_cached_pair_that_fits(tmp_path, monkeypatch, own_pair):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    big_target, big_draft = qwen2_pair(tmp_path / "big", hidden=128, layers=4)
    for repo, folder in (("org/big-moe", big_target), ("org/big-draft", big_draft),
                         ("org/moe", own_pair[0]), ("org/draft", own_pair[1])):
        cache_snapshot(tmp_path / "hub", repo, folder)
    known = (pairs.KnownPair("org/absent-moe", "org/draft", ""), pairs.KnownPair("org/big-moe", "org/big-draft", ""),
             pairs.KnownPair("org/moe", "org/draft", ""))
    monkeypatch.setattr(pairs, "KNOWN_PAIRS", known)
    monkeypatch.setattr(pairs.find_cached_pair, "__defaults__", (known,))
    base = plans.default_plan("metal", quick=True)
    small, big = spec_peak(base, "org/moe", "org/draft"), spec_peak(base, "org/big-moe", "org/big-draft")
    assert small < big
    plan, search = plans.find_default_pair("metal", True, usable_bytes=(small + big) // 2)
    assert (plan.target, plan.draft) == ("org/moe", "org/draft")
    assert plan.found.startswith(f"found in the Hugging Face cache at {tmp_path / 'hub'}")
    assert search.passed_over["org/absent-moe + org/draft"] == "not in the cache: org/absent-moe"
    assert "for SD at full depth" in search.passed_over["org/big-moe + org/big-draft"]
    assert plan.base.bits is None and plan.base.dense is None  # weights as stored, no dense control

    plan, search = plans.find_default_pair("metal", True, usable_bytes=small // 2)
    assert plan is None and search.to_dict()["target"] is None


def test_a_pair_plan_refuses_what_it_cannot_measure(own_pair):
    target, draft = own_pair
    with pytest.raises(BadInput, match="is not an MoE model"):
        plans.pair_plan("cpu", True, str(draft), str(draft))
    with pytest.raises(BadInput, match="--draft tiny-draft has no weights here"):
        plans.pair_plan("cpu", True, str(target), "tiny-draft")
    with pytest.raises(BadInput, match="prompt file not found: nope.txt"):
        plans.pair_plan("cpu", True, str(target), str(draft), ("code", "nope.txt"))
    plan = plans.pair_plan("cpu", True, str(target), str(draft), ("chat",))
    # Routing before the sweep: the sweep replays the routing the prompts caused.
    assert [s.label for s in pair_stages.pair_stages(plan)] == [
        "roofline", "routing my-moe on chat", "sweep my-moe", "fit", "spec my-moe on chat"]


def test_a_prompt_file_is_keyed_alike_by_its_stage_and_by_what_sd_stores(own_pair, tmp_path, monkeypatch):
    from mac_moesd.inputs.prompts import load_prompts
    from mac_moesd.results import keys

    target, draft = own_pair
    (tmp_path / "mine.txt").write_text("Write a haiku about the sea.\n\nName three prime numbers.\n")
    monkeypatch.chdir(tmp_path)
    plan = plans.pair_plan("cpu", True, str(target), str(draft), ("./mine.txt",))
    assert plan.prompt_sets == ("mine.txt",)  # named as it loads
    (prompt_set,) = plan.prompt_sets
    stored = {"target": plan.target, "draft": plan.draft,
              "prompts": {"name": load_prompts(plan.spec_config(prompt_set).prompts).name, "count": 2}}
    assert keys.spec_document_key(stored, plan.spec_config(prompt_set).mode) == keys.pair_spec_key(
        plan.target, plan.draft, plan.drafter_kind, prompt_set)


@pytest.mark.parametrize("args, fragment", [
    (["--target", "x"], "--target and --draft go together"),
    (["--draft", "x"], "--target and --draft go together"),
    (["--target", "a", "--draft", "b", "--models", "tiny-moe"], "--models and --full choose zoo models"),
    (["--target", "a", "--draft", "b", "--prompts", ","], "name at least one prompt set"),
    (["--models", "tiny-moe", "--prompts", "code"], "--prompts goes with a pair"),
])
def test_run_pair_usage_errors(tmp_path, args, fragment):
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_prompts_without_a_pair_on_cpu_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path), "--prompts", "chat"])
    assert result.exit_code == 2
    assert "--prompts needs --target and --draft here" in result.stderr
    assert not list(tmp_path.rglob("results.json"))


def test_run_pair_of_an_unknown_model_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path), "--target",
                                      str(tmp_path / "nowhere"), "--draft", "tiny-draft"])
    assert result.exit_code == 1
    assert "nowhere' is not a directory" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_dry_run_of_a_pair(own_pair, monkeypatch):
    target, draft = own_pair
    resolved, resolve = [], models.resolve
    monkeypatch.setattr(models, "resolve", lambda model: resolved.append(model) or resolve(model))
    result = CliRunner().invoke(cli, ["run", "--quick", "--dry-run", "--target", str(target), "--draft",
                                      str(draft), "--chip", "Apple M1", "--memory", "8", "--json"])
    assert result.exit_code == 0, result.stderr
    assert resolved == [str(target), str(draft)]  # once each, when the plan is made; the stages take them
    monkeypatch.undo()
    doc = json.loads(result.stdout)
    # The pair's own stages, in the run's order and labels: routing on each prompt set before the
    # sweep that replays it, then SD on each prompt set.
    assert [s["stage"] for s in doc["stages"]] == [
        "roofline", "routing my-moe on code", "routing my-moe on chat", "sweep my-moe",
        "spec my-moe on code", "spec my-moe on chat"]
    assert doc["bits"] is None and doc["stages"][3]["models"] == [str(target), str(draft)]
    assert doc["pair"] == {"target": "my-moe", "draft": "my-draft", "found": "given on the command line"}
    assert zoo.expert_shape(models.resolve(str(target)).config) == (8, 2)
    spec_code = doc["stages"][4]
    assert spec_code["acceptance_prompts"] == plans.QUICK_PROMPTS and spec_code["alpha_assumed"] == estimate.PAIR_ALPHA
    assert spec_code["grid"]["temperature"] == list(plans.TEMPERATURES) and spec_code["eta_s"] > 0
    # The untimed acceptance pass is in the ETA, in proportion to the prompts it decodes.
    base = plans.pair_plan("metal", True, str(target), str(draft))
    sizing = estimate.Sizing("metal", 2**33, estimate.chip_rates(estimate.parse_chip("Apple M1")))

    def eta(prompts):
        return estimate.pair_spec_stage(replace(base, max_prompts=prompts), "code", sizing)["eta_s"]

    assert eta(9) - eta(1) == pytest.approx(2 * (eta(5) - eta(1))) and eta(5) > eta(1)
    text = CliRunner().invoke(cli, ["run", "--quick", "--dry-run", "--target", str(target), "--draft", str(draft),
                                    "--chip", "Apple M1", "--memory", "8"]).output
    assert f"acceptance pass over {plans.QUICK_PROMPTS} prompts per gamma and temperature" in text


def test_routing_on_a_prompt_set_uses_the_tokenizer_one_sequence_per_prompt(tmp_path, own_pair):
    from mac_moesd.inputs.prompts import load_prompts
    from mac_moesd.measure.experts import routing, routing_trace

    target, _ = own_pair
    cfg = routing.RoutingConfig(model=str(target), prompts="chat", batches=(1, 2, 4, 64), tokens=(1, 2, 4),
                                length=16, save_trace=tmp_path / "chat.npz")
    doc = routing.run_routing(cfg, None)
    assert doc["text"] == "prompt set chat" and doc["token_ids"] == "tokenizer"
    # The byte-level tokenizer gives one id per byte: every chat prompt is longer than 16.
    assert doc["sequences"] == len(load_prompts("chat").prompts) == 30
    assert sorted({w["batch"] for w in doc["windows"]}) == [1, 2, 4]  # 64 sequences do not exist
    assert 0 < doc["correlation"] <= 1 and 0 < doc["batch_correlation"] <= 1
    trace = routing_trace.load_trace(tmp_path / "chat.npz")  # what `sweep --routing trace:FILE` replays
    assert (trace.sequences, trace.length, trace.model) == (30, 16, "my-moe")
    assert trace.text == "prompt set chat"

    short = tmp_path / "short.txt"
    short.write_text("hi\n\nyo\n\nok then")
    with pytest.raises(BadInput, match="routing needs two"):
        routing.run_routing(routing.RoutingConfig(model=str(target), prompts=str(short), batches=(1,),
                                                  tokens=(1,), length=16), None)


# ---- the routing the pair's sweep replays ----


def pair_store(tmp_path, traces: dict[str, tuple[int, int]], tokens=(1, 2, 3, 4)):
    """A pair plan on the tiny grid (batches to 4) and a results store whose routing stages saved,
    for each prompt set named, a trace of (sequences, length) of 16 experts top-1: token p of
    sequence s chose expert (s + p) % 16 in code and (s + 2p) % 16 in chat."""
    import numpy as np
    from test_report import tiny_plan

    from mac_moesd.measure.experts import routing_trace
    from mac_moesd.results import ResultsStore

    plan = plans.PairPlan(replace(tiny_plan(), tokens=tokens), "t", "d", ("code", "chat"))
    store = ResultsStore(tmp_path / "results.json", {"chip_slug": "x", "backend": "cpu", "versions": {}, "blas": {}})
    store.data["pairs"] = {"t|d": {}}
    (tmp_path / "traces").mkdir()
    for step, (prompt_set, (sequences, length)) in enumerate(traces.items(), start=1):
        s, p = np.meshgrid(np.arange(sequences), np.arange(length), indexing="ij")
        path = pair_stages.trace_path(tmp_path, "t", prompt_set)
        routing_trace.save_trace(path, ((s + step * p) % 16)[None, ..., None], 16, 1, "t",
                                 f"prompt set {prompt_set}", "tokenizer")
        store.put("routing", f"t|prompt set {prompt_set}", {"trace": str(path), "token_ids": "tokenizer"})
    return plan, store


def test_the_pair_sweep_replays_the_prompt_sets_traces_interleaved(tmp_path):
    from mac_moesd.measure.experts import routing_trace

    plan, store = pair_store(tmp_path, {"code": (3, 4), "chat": (2, 4)})
    record = pair_stages.sweep_routing(store, plan)
    combined = tmp_path / "traces" / "t-code+chat.npz"
    trace = routing_trace.load_trace(combined)
    assert record == {"routing": f"trace:{combined.resolve()}", "key": f"trace:t-code+chat.npz@{trace.digest}",
                      "trace": "traces/t-code+chat.npz", "prompt_sets": ["code", "chat"], "sequences": 5,
                      "length": 4, "spans_per_sequence": 1}
    assert store.data["pairs"]["t|d"]["sweep_routing"] == record
    # code 0, chat 0, code 1, chat 1, code 2; code's token p of sequence s is s + p, chat's s + 2p.
    assert trace.indices[0, :, :, 0].tolist() == [[0, 1, 2, 3], [0, 2, 4, 6], [1, 2, 3, 4], [1, 3, 5, 7],
                                                  [2, 3, 4, 5]]
    # A rerun finds the same file, so the same results key: its sweep resumes, nothing is redone.
    written = combined.stat().st_mtime_ns
    assert pair_stages.sweep_routing(store, plan) == record and combined.stat().st_mtime_ns == written


def test_the_pair_sweep_routing_without_enough_trace(tmp_path):
    plan, store = pair_store(tmp_path / "one", {"chat": (3, 4)}, tokens=(1, 2))
    record = pair_stages.sweep_routing(store, plan)  # one set: its own trace, as saved
    assert record["trace"] == "traces/t-chat.npz" and record["prompt_sets"] == ["chat"]
    # Batch 4 from 3 sequences of 4 tokens: 6 windows of 2 tokens, one sequence giving two.
    assert record["spans_per_sequence"] == 2

    plan, store = pair_store(tmp_path / "short", {"code": (2, 4)}, tokens=(1, 2, 3))
    # 2 sequences of 4 tokens hold 2 windows of 3 tokens; the grid's batch 4 needs 4.
    assert pair_stages.sweep_routing(store, plan) == {
        "routing": "model", "key": "model",
        "why": "the prompts' trace holds 2 sequences of 4 tokens, too few for 4 sequences of 3"}

    plan, store = pair_store(tmp_path / "none", {})
    assert pair_stages.sweep_routing(store, plan)["why"] == ("no routing trace of the prompts is saved: their "
                                                      "routing stages were skipped")


def test_the_pair_fit_sees_only_the_sweep_under_its_routing():
    data = {"pairs": {"t|d": {"sweep_routing": {"key": "trace:t-code.npz@abc"}}},
            "sweeps": {"t|None|L16|layers2": {"model": "t"},
                       "t|None|L16|layers2|routing=trace:t-code.npz@abc": {"model": "t"},
                       "t|None|L16|layers2|routing=trace:t-code.npz@old": {"model": "t"},
                       "t|None|L16|layers2|routing=trace:t-code.npz@abc|gather=sorted": {"model": "t"},
                       "u|None|L16|layers2": {"model": "u"}}}
    plan = plans.PairPlan(None, "t", "d")
    assert list(pair_stages.as_swept(data, plan)["sweeps"]) == ["t|None|L16|layers2|routing=trace:t-code.npz@abc",
                                                         "u|None|L16|layers2"]
    data["pairs"]["t|d"]["sweep_routing"]["key"] = "model"
    assert list(pair_stages.as_swept(data, plan)["sweeps"]) == ["t|None|L16|layers2", "u|None|L16|layers2"]
    del data["pairs"]["t|d"]["sweep_routing"]
    assert pair_stages.as_swept(data, plan) is data


# ---- the whole pipeline through the CLI, on a tiny grid ----

@pytest.fixture
def tiny_grid(monkeypatch):
    from test_report import tiny_plan

    monkeypatch.setattr(plans, "default_plan", lambda backend, quick, full=False: tiny_plan())


def run_pair_cli(out, target, draft, *extra):
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(out), "--target", str(target),
                                      "--draft", str(draft), *extra])
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return result, folder


PAIR_SECTIONS = ["### Verdict for this pair", "### What was measured",
                 "### Acceptance per prompt set and temperature", "### Measured against predicted speedup",
                 "### Routing on your prompts"]


def check_pair_report(folder, target_name, draft_name, prompt_sets):
    from mac_moesd.analysis import fit

    data = json.loads((folder / "results.json").read_text())
    md = (folder / "report.md").read_text()
    assert md.splitlines()[2].startswith(f"> Your pair: target **{target_name}** with drafter **{draft_name}**")
    assert f"## Your pair: {target_name} with {draft_name}" in md
    for section in PAIR_SECTIONS:
        assert section in md
    fitted = data["fits"][target_name]
    for prompt_set in prompt_sets:
        # Routing on the prompts, through the model's own tokenizer, with c in the report.
        routed = data["routing"][f"{target_name}|prompt set {prompt_set}"]
        assert routed["token_ids"] == "tokenizer" and routed["sequences"] >= 2
        assert (f"| {prompt_set} | {routed['sequences']} x {routed['length']} | tokenizer | "
                f"{routed['correlation']:.3f} | {routed['batch_correlation']:.3f} |") in md
        assert (folder / "traces").is_dir() and routed["trace"].startswith(str(folder / "traces"))
        # The verdict at batch 1 for each temperature leads with the configuration the SD stage
        # timed as recommended, beside the fitted model's prediction at the acceptance pooled over
        # the pass's gammas (weighted by rounds), worked out here from the stored records.
        doc = data["spec"][f"{target_name}|{draft_name}|real|{prompt_set}"]
        predictor = fit.speedup_predictor(fitted)
        for temperature in doc["temperatures"]:
            entries = [a for a in doc["acceptance"] if a["temperature"] == temperature]
            stats = [a["measured"] if temperature == 0 else a["rules"]["mlx-lm"] for a in entries]
            alpha = sum(x["alpha"] * x["rounds"] for x in stats) / sum(x["rounds"] for x in stats)
            (run,) = [r for r in doc["runs"] if r["batch"] == 1 and r["temperature"] == temperature
                      and r["recommended"]]
            predicted = predictor(1, run["gamma"], alpha, False, doc["context"])
            low, high = run["measured_ci"]
            slack = fitted["heldout_mape"]
            agrees = low * (1 - slack) <= predicted <= high * (1 + slack)
            assert (f"On {prompt_set} at temperature {temperature:g}: **measured at batch 1 with gamma = "
                    f"{run['gamma']}: ") in md
            assert (f"the fitted model predicted {predicted:.2f} at alpha {alpha:.2f} "
                    f"({'agrees' if agrees else 'disagrees'})") in md
        for a in doc["acceptance"]:
            rates = (a.get("rules") or {a["rule_run"]: a["measured"]})
            for rule, stats in rates.items():
                assert (f"| {prompt_set} | {a['temperature']:g} | {a['gamma']} | {rule} |") in md
                assert " ".join(f"{v:.2f}" for v in stats["acceptance_by_position"]) in md
    for name in ("acceptance", "measured_vs_predicted", "routing", "fit"):
        assert (folder / "figures" / f"{name}.png").stat().st_size > 5_000
    assert "data:image/png;base64," in (folder / "report.html").read_text()
    return data, md


def check_sweep_replays_the_prompts(folder, data, md, target, draft, prompt_sets, trace_name):
    """The pair's sweep ran under the prompt sets' routing trace (interleaved), and every point
    counts the experts of the trace window it replayed."""
    import numpy as np

    from mac_moesd.measure.experts import routing_trace

    path = folder / "traces" / trace_name
    trace = routing_trace.load_trace(path)
    record = data["pairs"][f"{target}|{draft}"]["sweep_routing"]
    assert record["routing"] == f"trace:{path.resolve()}" and record["prompt_sets"] == list(prompt_sets)
    ((key, entry),) = [(k, e) for k, e in data["sweeps"].items() if e["model"] == target]
    assert key.endswith(f"|routing=trace:{trace_name}@{trace.digest}") and entry["routing"] == record["routing"]
    routed = [data["routing"][f"{target}|prompt set {p}"] for p in prompt_sets]
    first = [routing_trace.load_trace(r["trace"]) for r in routed]
    assert trace.sequences == sum(r["sequences"] for r in routed)
    for i, one in enumerate(first):  # the sets in turn: sequence i is set i's first prompt
        assert np.array_equal(trace.indices[:, i], one.indices[:, 0])
    # Routed at full depth, so the trace holds every MoE layer the sweep replayed it to; every
    # batch of the tiny grid is within the trace's sequences: the last t tokens of the first B.
    assert all(r["layers_measured"] == entry["layers_full"] == entry["layers"] for r in routed)
    for point_key, point in entry["points"].items():
        b, t = (int(v) for v in point_key.split("x"))
        window = trace.indices[:, :b, trace.length - t:, :]
        assert point["unique_experts"] == np.mean([np.unique(layer).size for layer in window]), point_key
    assert (f"with the prompts' routing, replayed from traces/{trace_name} (the experts the target chose on "
            f"{', '.join(prompt_sets)}: {trace.sequences} sequences of {trace.length} tokens; the router still "
            "runs), so the grid and the SD runs share one routing.") in md


@pytest.mark.slow
def test_run_on_the_trained_pair_writes_the_pair_report(tmp_path, tiny_grid, tiny_pair):
    target, draft = tiny_pair
    result, folder = run_pair_cli(tmp_path, target, draft)
    assert result.exit_code == 0, result.stderr
    assert "report: " in result.stdout and "Traceback" not in result.stderr
    data, md = check_pair_report(folder, "target", "draft", ("code", "chat"))
    assert data["pairs"]["target|draft"]["stored"] == {"target": "fp16", "draft": "fp16"}
    assert "| target | target | " in md and "(stored fp16)" in md
    assert "## Verdict: is speculative decoding worth it here?" not in md  # the pair's own verdict only
    check_sweep_replays_the_prompts(folder, data, md, "target", "draft", ("code", "chat"), "target-code+chat.npz")

    # Resumable: a rerun keeps every finished stage and rewrites the report.
    before = (folder / "results.json").read_text()
    result, _ = run_pair_cli(tmp_path, target, draft)
    assert result.exit_code == 0, result.stderr
    after, before = json.loads((folder / "results.json").read_text()), json.loads(before)
    for section in ("roofline", "routing", "fits", "spec"):
        assert after[section] == before[section]
    # The same trace, so the same sweep entry, resumed with nothing to measure.
    assert after["pairs"]["target|draft"]["sweep_routing"] == before["pairs"]["target|draft"]["sweep_routing"]
    assert set(after["sweeps"]) == set(before["sweeps"])
    for key, entry in before["sweeps"].items():
        assert after["sweeps"][key]["points"] == entry["points"]


@pytest.mark.slow
def test_a_drafter_model_prompt_lookup_and_an_mtp_head_are_measured_on_the_same_prompts_and_compared(
        tmp_path, tiny_grid, tiny_pair, monkeypatch):
    target, draft = tiny_pair
    resolved, resolve = [], models.resolve
    monkeypatch.setattr(models, "resolve", lambda model: resolved.append(model) or resolve(model))
    result, folder = run_pair_cli(tmp_path, target, f"{draft},prompt-lookup,mtp-head", "--prompts", "edit",
                                  "--alpha", "0.8")
    assert result.exit_code == 0, result.stderr
    # Each model resolved once, when the plans were made: every stage of all three drafters took them.
    assert resolved == [str(target), str(draft)]
    data = json.loads((folder / "results.json").read_text())
    md = (folder / "report.md").read_text()
    assert set(data["pairs"]) == {"target|draft", "target|prompt-lookup", "target|mtp-head"}
    assert set(data["spec"]) == {"target|draft|real|edit", "target|prompt-lookup|real|edit",
                                 "target|mtp-head|emulated-acceptance|edit"}
    head = data["spec"]["target|mtp-head|emulated-acceptance|edit"]
    assert head["valid"] and {r["alpha"] for r in head["runs"]} == {0.8} and head["temperatures"] == [0.0]
    # one routing, one sweep (with the drafter model's step) and one fit serve both drafters
    assert data["pairs"]["target|prompt-lookup"]["sweep_routing"] == data["pairs"]["target|draft"]["sweep_routing"]
    assert [e["model"] for e in data["sweeps"].values()] == ["target"] and data["fits"]["target"]["drafted"]
    lookup = data["spec"]["target|prompt-lookup|real|edit"]
    assert lookup["valid"] and lookup["drafter_kind"] == "prompt-lookup"
    assert all(r["engine"].startswith("mac-moesd loop") and r["lookup"]["proposal_rate"] > 0 for r in lookup["runs"])
    for section in ("## Which drafter for target", "## Your pair: target with draft",
                    "## Your pair: target with prompt-lookup", "### Verdict for prompt lookup",
                    "### Verdict for an MTP head (acceptance imposed)"):
        assert section in md
    assert "| MTP head (mtp-head), alpha imposed at 0.80 |" in md
    # The lead names the faster kind at batch 1, temperature 0, as measured.
    speeds = {kind: max(r["measured_speedup"] for r in data["spec"][key]["runs"]
                        if r["batch"] == 1 and r["temperature"] == 0)
              for kind, key in (("drafter model", "target|draft|real|edit"),
                                ("prompt lookup", "target|prompt-lookup|real|edit"))}
    fastest = max(speeds, key=speeds.get)
    assert f"On edit at temperature 0, batch 1: **{fastest} is fastest**, {speeds[fastest]:.2f} [" in md

    # Resumable: a rerun measures nothing again.
    result, _ = run_pair_cli(tmp_path, target, f"{draft},prompt-lookup,mtp-head", "--prompts", "edit",
                             "--alpha", "0.8")
    assert result.exit_code == 0, result.stderr
    assert json.loads((folder / "results.json").read_text())["spec"] == data["spec"]


@pytest.mark.slow
def test_a_pair_saved_by_the_test_runs_through_the_same_command(tmp_path, tiny_grid, own_pair):
    target, draft = own_pair
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Write a haiku about the number {i} and its digits."})
                                 for i in range(12)))
    out = tmp_path / "reports"
    result, folder = run_pair_cli(out, target, draft, "--prompts", f"chat,{prompts}")
    assert result.exit_code == 0, result.stderr
    data, md = check_pair_report(folder, "my-moe", "my-draft", ("chat", str(prompts)))
    assert data["spec"][f"my-moe|my-draft|real|{prompts}"]["prompts"]["count"] == 12
    assert (folder / "traces" / "my-moe-mine.npz").exists()
    check_sweep_replays_the_prompts(folder, data, md, "my-moe", "my-draft", ("chat", str(prompts)),
                                    "my-moe-chat+mine.npz")


@pytest.mark.slow
def test_a_failing_pair_stage_is_skipped_and_named(tmp_path, tiny_grid, tiny_pair, monkeypatch):
    from mac_moesd.measure.experts import routing

    def metal_failure(*args, **kwargs):
        raise RuntimeError("[METAL] Command buffer execution failed: Insufficient Memory")

    monkeypatch.setattr(routing, "run_routing", metal_failure)
    result, folder = run_pair_cli(tmp_path, *tiny_pair, "--prompts", "chat")
    assert result.exit_code == 3
    assert "warning: skipped routing target on chat: RuntimeError: [METAL]" in result.stderr
    md = (folder / "report.md").read_text()
    assert "Skipped routing target on chat: RuntimeError" in md
    assert "### Verdict for this pair" in md and "### Routing on your prompts" not in md
    # No trace to replay: the sweep timed random ids under the target's own routing, and says so.
    data = json.loads((folder / "results.json").read_text())
    assert data["pairs"]["target|draft"]["sweep_routing"]["key"] == "model"
    assert all(e.get("routing", "model") == "model" for e in data["sweeps"].values())
    assert ("over random token ids under the target's own routing, not the prompts' (no routing trace of "
            "the prompts is saved: their routing stages were skipped).") in md


def test_the_report_says_when_no_cached_pair_was_found():
    from pathlib import Path

    from mac_moesd.reporting import report

    data = json.loads((Path(__file__).parent / "data" / "results_quick_cpu.json").read_text())
    data["pair_search"] = {"latest": {"target": None, "draft": None, "cache": "/Users/me/.cache/huggingface/hub",
                                      "passed_over": {"a/moe + a/draft": "not in the cache: a/moe"}}}
    blocks = report.build_blocks(data, {})
    assert blocks[1][0] == "note" and blocks[1][1].startswith(
        "RANDOM WEIGHTS: no known MoE/drafter pair in the Hugging Face cache at /Users/me/.cache/huggingface/hub "
        "could be measured (a/moe + a/draft: not in the cache: a/moe)")
