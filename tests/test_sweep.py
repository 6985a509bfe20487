import json

import mlx.core as mx
import pytest
from conftest import TINY_BUDGET
from mlx_lm.utils import save_config, save_model

from mac_moesd.analysis import depth
from mac_moesd.inputs import models, zoo
from mac_moesd.measure.forward import sweep
from mac_moesd.errors import BadInput, MacMoesdError
from mac_moesd.results import ResultsStore, load_results

META = {"chip_slug": "test", "backend": "cpu", "versions": {"mlx": mx.__version__},
        "blas": {"name": "x"}}


def small_sweep(model, **kw):
    args = dict(model=str(model), batches=(1, 2), tokens=(1, 3), context=20, budget=TINY_BUDGET)
    args.update(kw)
    return sweep.SweepConfig(**args)


# The CI twins (one per kind of cache) in the default suite; every other architecture's miniature,
# seconds each, in the slow one.
ARCHITECTURES = [e if e.name.startswith("tiny-") else pytest.param(e, marks=pytest.mark.slow) for e in zoo.ZOO]


@pytest.mark.parametrize("entry", ARCHITECTURES, ids=lambda e: e.name)
def test_every_zoo_architecture_runs_a_timed_forward_with_rollback(entry, config_dir, tmp_path):
    config = zoo.miniature(entry.config)
    if "sliding_window" in config:
        config["sliding_window"] = 8  # smaller than the context: the cache cannot trim, only restore
    folder = config_dir(config, entry.name)
    store = ResultsStore(tmp_path / "results.json", META)
    doc = sweep.run_sweep(small_sweep(folder), store, available_bytes=None)
    assert [(p["batch"], p["tokens"]) for p in doc["points"]] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for p in doc["points"]:
        assert p["median_s"] > 0 and p["repeats"] == 3
    assert doc["layers_measured"] == [config["num_hidden_layers"]] and not doc["extrapolated"]
    assert doc["footprint"]["params_total"] > 0
    (stored,) = store.data["sweeps"].values()
    # Every cache goes back to the second context: KV layers trimmed, and a window filled past its
    # size (gpt-oss) or a recurrent state (the Qwen3-Next and Nemotron-H hybrids) copied as the
    # prefill passed it.
    assert not stored.get("kv_untrimmable")
    assert [p["batch"] for p in doc["kv_points"]["points"]] == [1, 2]


def test_rollback_restores_cache_and_output(config_dir):
    built = models.build(models.resolve(str(config_dir(zoo.miniature(zoo.by_name("tiny-moe").config)))))
    built.materialise()
    cache = sweep.RolledBackCache(built.model, batch=2, context=12, vocab=256)
    inputs = mx.random.randint(0, 256, (2, 3))
    first = built.model(inputs, cache=cache.cache)
    mx.eval(first)
    cache.rollback(3)
    again = built.model(inputs, cache=cache.cache)
    mx.eval(again)
    cache.rollback(3)
    assert mx.allclose(first, again).item()
    assert {c.offset for c in cache.cache} == {12}


def test_resume_skips_measured_points_and_keeps_them(config_dir, tmp_path):
    folder = config_dir(zoo.miniature(zoo.by_name("tiny-dense").config))
    path = tmp_path / "results.json"
    sweep.run_sweep(small_sweep(folder, tokens=(1,)), ResultsStore(path, META), None)
    first = load_results(path)["sweeps"]
    (key,) = first
    kept = first[key]["points"]["1x1"]
    doc = sweep.run_sweep(small_sweep(folder, tokens=(1, 3)), ResultsStore(path, META), None)
    data = load_results(path)["sweeps"][key]["points"]
    assert data["1x1"] == kept
    assert set(data) == {"1x1", "2x1", "1x3", "2x3"}
    assert len(doc["points"]) == 4


def test_layer_slices_extrapolate_to_full_depth(config_dir, tmp_path):
    config = zoo.miniature(zoo.by_name("tiny-moe").config, layers=4)
    folder = config_dir(config)
    doc = sweep.run_sweep(small_sweep(folder, layers=1), ResultsStore(tmp_path / "r.json", META), None)
    assert doc["layers_measured"] == [1, 2] and doc["extrapolated"] and doc["layers_full"] == 4
    one, two = ({(p["batch"], p["tokens"]): p["median_s"] for p in s["points"]} for s in doc["slices"])
    for p in doc["points"]:
        key = (p["batch"], p["tokens"])
        assert p["extrapolated"]
        assert p["median_s"] == pytest.approx(one[key] + (two[key] - one[key]) * 3)


def test_extrapolation_formula():
    small = {"points": {"1x1": {"median_s": 1.0, "iqr_s": 0.1, "repeats": 5}}}
    large = {"points": {"1x1": {"median_s": 1.5, "iqr_s": 0.1, "repeats": 7}}}
    out = depth.extrapolate(small, large, n=2, full=10)["1x1"]
    assert out["median_s"] == pytest.approx(1.0 + 0.5 * 4)  # 0.25 s per layer, 0.5 s outside
    assert out["repeats"] == 5


def test_memory_guard_slices_then_refuses(config_dir):
    big = models.resolve("qwen2-57b-a14b")
    cfg = sweep.SweepConfig(model="qwen2-57b-a14b", batches=(1,), tokens=(1,), context=64)
    plan = sweep.plan_layers(big, cfg, available=48 * 2**30)
    assert len(plan) == 2 and plan[1] == 2 * plan[0] and plan[1] < 28
    huge = dict(zoo.by_name("tiny-dense").config, hidden_size=16384, vocab_size=2_000_000)
    source = models.resolve(str(config_dir(huge)))
    with pytest.raises(MacMoesdError, match="B is usable here"):
        sweep.plan_layers(source, sweep.SweepConfig(model="x", batches=(1,), tokens=(1,)), 2**30)


def test_bad_sweep_input():
    with pytest.raises(BadInput, match="--batch"):
        sweep.SweepConfig(model="tiny-moe", batches=(0,))
    with pytest.raises(BadInput, match="--tokens"):
        sweep.SweepConfig(model="tiny-moe", tokens=(-1,))
    cfg = sweep.SweepConfig(model="tiny-moe", context=5000)
    with pytest.raises(BadInput, match="maximum of 4096 positions"):
        sweep.check_context(models.resolve("tiny-moe"), cfg)


@pytest.mark.slow  # loads and times models end to end
def test_draft_and_reject_steps(tmp_path):
    cfg = sweep.SweepConfig(model="tiny-dense", batches=(1, 2), tokens=(1,), context=8,
                            draft="tiny-draft", budget=TINY_BUDGET)
    doc = sweep.run_sweep(cfg, ResultsStore(tmp_path / "r.json", META), None)
    assert [p["batch"] for p in doc["draft"]["points"]] == [1, 2]
    assert doc["draft"]["model"] == "tiny-draft"
    assert [(p["batch"], p["tokens"]) for p in doc["reject"]["points"]] == [(1, 5), (2, 5)]
    # the SD loop's empty round at the same shapes, for the fit's bookkeeping term
    assert [(p["batch"], p["tokens"]) for p in doc["reject"]["bookkeeping_points"]] == [(1, 5), (2, 5)]
    assert all(p["median_s"] > 0 for p in doc["reject"]["bookkeeping_points"])
    (stored,) = json.loads((tmp_path / "r.json").read_text())["reject"].values()
    assert sorted(stored["bookkeeping_points"]) == ["1x5", "2x5"]
    # the drafter's chains after a verify of the whole target, at gamma 1, 2 and the sweep's 4
    assert [(p["batch"], p["gamma"]) for p in doc["draft"]["chain_points"]] == [(1, 1), (1, 2), (1, 4), (2, 1),
                                                                                 (2, 2), (2, 4)]
    assert doc["draft"]["chains_after_layers"] == doc["layers_full"]
    (target,) = json.loads((tmp_path / "r.json").read_text())["sweeps"].values()
    assert sorted(target["draft_chains"]["tiny-draft"]["points"]) == ["1x1", "1x2", "1x4", "2x1", "2x2", "2x4"]


def test_saved_model_with_weights_loads_through_mlx_lm(tmp_path):
    config = zoo.miniature(zoo.by_name("tiny-moe").config)
    built = models.build(models.ModelSource("m", config), seed=3)
    built.materialise()
    folder = tmp_path / "saved"
    save_model(folder, built.model)
    save_config(config, folder / "config.json")
    source = models.resolve(str(folder))
    assert source.has_weights
    loaded = models.build(source)
    loaded.materialise()
    x = mx.array([[1, 2, 3]])
    assert mx.allclose(built.model(x), loaded.model(x)).item()
    assert models.build(source, layers=1).layers == 1


def test_resolve_errors(tmp_path):
    with pytest.raises(MacMoesdError, match="did you mean tiny-moe"):
        models.resolve("tiny-mo")
    with pytest.raises(MacMoesdError, match="config file not found"):
        models.resolve(str(tmp_path / "nothing.json"))
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 3}))
    with pytest.raises(MacMoesdError, match="no 'model_type'"):
        models.resolve(str(tmp_path / "bad.json"))
    with pytest.raises(MacMoesdError, match="not in the local Hugging Face cache"):
        models.resolve("nobody/not-a-cached-model")


def test_footprint_of_real_dimensions():
    fp = models.build(models.resolve("qwen3-30b-a3b"), dtype="float16").footprint
    assert fp["params_total"] == pytest.approx(30.5e9, rel=0.01)
    assert fp["params_active"] == pytest.approx(3.0e9, rel=0.05)
    assert fp["experts"] == 128 and fp["top_k"] == 8 and fp["moe_layers"] == 48
    assert fp["bytes_per_expert"] == pytest.approx(fp["bytes_expert"] / 128)
    dense = models.build(models.resolve("qwen3-4b"), dtype="float16").footprint
    assert dense["params_expert"] == 0 and dense["experts"] is None


def test_pipelined_point_runs_every_forward_of_its_chain_at_the_points_context(config_dir):
    built = models.build(models.resolve(str(config_dir(zoo.miniature(zoo.by_name("tiny-moe").config)))))
    built.materialise()
    cache = sweep.RolledBackCache(built.model, 2, 12, built.config["vocab_size"])
    seen = []

    def model(x, cache):
        seen.append((x.shape, cache[0].offset))
        return built.model(x, cache=cache)

    point = sweep.pipelined_point(model, cache, batch=2, tokens=3, vocab=built.config["vocab_size"], steps=4)
    last, _ = point.run()
    mx.eval(last)
    assert last.shape == (2, 3)
    assert seen == [((2, 3), 12)] * 4
    assert {c.offset for c in cache.cache} == {12}
    point.reset()
    assert {c.offset for c in cache.cache} == {12}


def test_a_forward_built_after_a_rollback_sees_only_the_prefix(config_dir):
    """The chain rolls the cache back before the forward it just built has run; MLX's cache
    updates are new arrays, so the next forward attends to the prefix and its own tokens only."""
    built = models.build(models.resolve(str(config_dir(zoo.miniature(zoo.by_name("tiny-moe").config)))))
    built.materialise()
    vocab = built.config["vocab_size"]
    prompt = mx.random.randint(0, vocab, (1, 10))
    first, second = mx.random.randint(0, vocab, (1, 3)), mx.random.randint(0, vocab, (1, 3))
    chained = sweep.RolledBackCache(built.model, 1, 10, vocab, prompt)
    built.model(first, cache=chained.cache)
    chained.rollback(3)
    lazy = built.model(second, cache=chained.cache)
    fresh = sweep.RolledBackCache(built.model, 1, 10, vocab, prompt)
    assert mx.allclose(lazy, built.model(second, cache=fresh.cache), atol=1e-5).item()


def test_a_decode_steps_chains_get_a_larger_time_budget(config_dir, tmp_path, monkeypatch):
    """The pipelined one-token points (the plain decode step) are timed for
    ``decode_seconds_factor`` times a point's seconds; every other point for its seconds."""
    seen = {}
    measure = sweep.timing.measure

    def recording(points, budget, *args, **kw):
        seen.update({key: point.seconds for key, point in points.items()})
        return measure(points, budget, *args, **kw)

    monkeypatch.setattr(sweep.timing, "measure", recording)
    folder = config_dir(zoo.miniature(zoo.by_name("tiny-moe").config))
    budget = sweep.timing.Budget(warmup=0, min_repeats=3, max_repeats=3, seconds_per_point=0.25, per_visit=1,
                                 decode_seconds_factor=3.0)
    sweep.run_sweep(small_sweep(folder, batches=(1,), budget=budget, kv_context=0),
                    ResultsStore(tmp_path / "r.json", META), None)
    grid = {key: seen.pop(key) for key in list(seen) if isinstance(key, tuple) and "points" in key[0]}
    assert grid == {("points", 1, 1): None, ("points", 1, 3): None,
                    ("pipelined_points", 1, 1): 0.75, ("pipelined_points", 1, 3): 0.25}
    assert seen and set(seen.values()) == {None}  # the drift check, rejection sampling, the bookkeeping
    assert sweep.pipelined_seconds(1, sweep.timing.QUICK) == sweep.timing.QUICK.seconds_per_point


@pytest.mark.slow  # loads and times models end to end
def test_sweep_records_both_timings_at_every_point(tmp_path):
    cfg = sweep.SweepConfig(model="tiny-moe", batches=(2, 1), tokens=(1, 2), context=8, budget=TINY_BUDGET,
                            draft="tiny-draft")
    doc = sweep.run_sweep(cfg, ResultsStore(tmp_path / "r.json", META), None)
    for row in doc["points"] + doc["draft"]["points"]:
        pipe = row["pipelined"]
        assert pipe["steps"] == (TINY_BUDGET.decode_chain if row["tokens"] == 1 else sweep.PIPELINED_STEPS)
        assert pipe["repeats"] >= TINY_BUDGET.min_repeats
        assert pipe["median_s"] > 0 and row["median_s"] > 0  # no ratio of two sub-ms timings
    assert {(r["batch"], r["tokens"]) for r in doc["points"]} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    # Kept on a rerun: nothing is measured again.
    again = sweep.run_sweep(cfg, ResultsStore(tmp_path / "r.json", META), None)
    assert [r["pipelined"]["median_s"] for r in again["points"]] == [r["pipelined"]["median_s"] for r in doc["points"]]


class Recording:
    """A model that notes which of two models ran, and with how many tokens, in one shared log."""

    def __init__(self, model, name: str, log: list):
        self.model, self.name, self.log = model, name, log

    def __call__(self, x, cache=None):
        self.log.append((self.name, x.shape[1]))
        return self.model(x, cache=cache)

    def __getattr__(self, attr):
        return getattr(self.model, attr)


def test_a_drafters_chain_is_timed_after_a_verify_of_the_target_and_kept_on_a_rerun(tmp_path):
    from mac_moesd.measure.forward import draft_chain
    from mac_moesd.progress import Progress
    import random

    target, draft = (models.build(models.resolve(name), seed=0) for name in ("tiny-moe", "tiny-draft"))
    for built in (target, draft):
        built.materialise()
    log: list = []
    target.model, draft.model = Recording(target.model, "target", log), Recording(draft.model, "draft", log)
    record: dict = {"points": {}}
    saves = []
    todo = draft_chain.missing(record, (1, 2), 3)
    draft_chain.measure_chains(target, draft, todo, 16, record, TINY_BUDGET, lambda: saves.append(1),
                               Progress(), random.Random(0))
    assert sorted(record["points"]) == ["1x1", "1x2", "1x3", "2x1", "2x2", "2x3"] and len(saves) == 6
    assert all(m["median_s"] > 0 and m["repeats"] == 3 for m in record["points"].values())
    # After the prefills, every sample: a verify of gamma + 1 tokens, then gamma one-token drafter steps.
    samples = log[2:]  # the two prefills
    verifies = [i for i, (who, _) in enumerate(samples) if who == "target"]
    assert len(verifies) == 6 * 3
    for i in verifies:
        gamma = samples[i][1] - 1
        assert samples[i + 1 : i + 1 + gamma] == [("draft", 1)] * gamma
    assert [row["gamma"] for row in draft_chain.chain_rows(record)] == [1, 2, 3, 1, 2, 3]
    assert all("samples_s" not in row for row in draft_chain.chain_rows(record))
    # Kept: none missing, and a larger gamma adds only its own chains.
    assert draft_chain.missing(record, (1, 2), 3) == []
    assert draft_chain.missing(record, (1, 2), 4) == [(1, 4), (2, 4)]


def test_a_chain_waits_for_no_draft_until_its_end_as_the_loops_draft(monkeypatch):
    """Both loops queue each draft step as they build it and read none until the verify: the
    chain point builds its gamma steps with no wait between them, and leaves the drafter's cache
    at the prompt after each sample."""
    from mac_moesd.measure.caches.rolled_cache import RolledBackCache
    from mac_moesd.measure.clock import timing
    from mac_moesd.measure.forward import draft_chain

    target, draft = (models.build(models.resolve(name), seed=0) for name in ("tiny-moe", "tiny-draft"))
    for built in (target, draft):
        built.materialise()
    vocab = target.config["vocab_size"]
    target_cache, draft_cache = (RolledBackCache(b.model, 2, 16, vocab) for b in (target, draft))
    point = draft_chain.chain_point(target.model, target_cache, draft.model, draft_cache, 2, 3, vocab)
    point.before()
    calls = []
    monkeypatch.setattr(mx, "eval", lambda *a: calls.append("eval"))
    monkeypatch.setattr(mx, "async_eval", lambda *a: calls.append("async_eval"))
    drafts, _ = point.run()
    monkeypatch.undo()
    assert calls == ["async_eval"] * 3 and [d.shape for d in drafts] == [(2, 1)] * 3
    assert timing.time_once(point) > 0
    assert draft_cache.cache[0].offset == 16
    # After a round that accepted every draft: the catch-up forward first, unread, then the chain.
    forwards = []
    counted = lambda tokens, cache=None: forwards.append(tokens.shape) or draft.model(tokens, cache=cache)  # noqa: E731
    caught_up = draft_chain.chain_point(target.model, target_cache, counted, draft_cache, 2, 3, vocab, catch_up=True)
    calls.clear()
    monkeypatch.setattr(mx, "eval", lambda *a: calls.append("eval"))
    monkeypatch.setattr(mx, "async_eval", lambda *a: calls.append("async_eval"))
    drafts, _ = caught_up.run()
    monkeypatch.undo()
    assert forwards == [(2, 1)] * 4 and calls == ["async_eval"] * 3 and len(drafts) == 3
    draft_cache.reset()
    assert draft_cache.cache[0].offset == 16


def test_chains_are_skipped_and_said_so_where_target_and_drafter_do_not_fit_together(tmp_path):
    from mac_moesd.measure.forward import draft_chain  # noqa: F401  (the module the sweep calls)
    from mac_moesd.progress import Progress
    import random

    class Steps(Progress):
        def __init__(self):
            self.labels = []

        def advance(self, label):
            self.labels.append(label)

    cfg = small_sweep("tiny-moe", draft="tiny-draft")
    target = models.build(models.resolve("tiny-moe"), seed=0)
    store = ResultsStore(tmp_path / "r.json", META)
    progress = Steps()
    entry = store.entry("sweeps", "tiny-moe|float32|L20|layers4", {"model": "tiny-moe"})
    sweep.measure_chains_with(target, entry, cfg, models.resolve("tiny-draft"), store, 1001, progress, random.Random(0))
    (saved,) = load_results(tmp_path / "r.json")["sweeps"].values()
    record = saved["draft_chains"]["tiny-draft"]
    assert record["points"] == {} and "is usable" in record["skipped"]
    assert len(progress.labels) == 2 and all("skipped" in label for label in progress.labels)
    assert "draft" not in store.data  # the drafter was neither entered in the file nor timed


def test_kept_chains_build_nothing_and_count_each_batch_once(tmp_path, monkeypatch):
    from mac_moesd.progress import Progress
    import random

    class Steps(Progress):
        def __init__(self):
            self.labels = []

        def advance(self, label):
            self.labels.append(label)

    def no_build(*args, **kwargs):
        raise AssertionError("nothing is built when every chain is kept")

    cfg = small_sweep("tiny-moe", draft="tiny-draft", gamma=2)
    m = {"median_s": 0.003}
    entry = {"draft_chains": {"tiny-draft": {"points": {k: m for k in ("1x1", "1x2", "2x1", "2x2")},
                                             "skipped": "an earlier run's reason"}}}
    monkeypatch.setattr(sweep.models, "build", no_build)
    progress = Steps()
    sweep.measure_chains_with(None, entry, cfg, models.resolve("tiny-draft"), ResultsStore(tmp_path / "r.json", META),
                              None, progress, random.Random(0))
    assert progress.labels == ["tiny-draft chain after the target B=1 (kept)", "tiny-draft chain after the target B=2 (kept)"]
    assert "skipped" not in entry["draft_chains"]["tiny-draft"]


@pytest.mark.slow  # loads and times models end to end
def test_a_sliced_targets_chains_follow_the_verify_of_its_larger_slice(tmp_path):
    cfg = sweep.SweepConfig(model="tiny-moe", batches=(1,), tokens=(1, 2), context=8, layers=1, gamma=2,
                            draft="tiny-draft", budget=TINY_BUDGET)
    doc = sweep.run_sweep(cfg, ResultsStore(tmp_path / "r.json", META), None)
    assert doc["layers_measured"] == [1, 2]
    assert [(p["batch"], p["gamma"]) for p in doc["draft"]["chain_points"]] == [(1, 1), (1, 2)]
    assert doc["draft"]["chains_after_layers"] == 2 and "chains_skipped" not in doc["draft"]


def test_the_sweep_document_reads_a_pairs_chains_from_the_deepest_slice_that_holds_them():
    m = {"median_s": 0.003, "samples_s": [0.003]}
    small = {"layers": 1, "draft_chains": {"d": {"points": {"1x1": {"median_s": 0.009}}}}}
    large = {"layers": 2, "draft_chains": {"d": {"points": {"1x2": m, "1x1": m}},
                                           "other": {"points": {}, "skipped": "a sharded sweep does not time them"}}}
    doc = sweep.chains_document([large, small], "d")
    assert [(r["batch"], r["gamma"], r["median_s"]) for r in doc["chain_points"]] == [(1, 1, 0.003), (1, 2, 0.003)]
    assert doc["chains_after_layers"] == 2 and "chains_skipped" not in doc
    assert all("samples_s" not in r for r in doc["chain_points"])
    assert sweep.chains_document([large, small], "other") == {"chain_points": [],
                                                              "chains_skipped": "a sharded sweep does not time them"}
    assert sweep.chains_document([small], "nobody") == {"chain_points": []}
