"""The KV term told apart from costs per sequence: one-token points timed at a second context."""

import copy
import mlx.core as mx
import numpy as np
import pytest

from mac_moesd.analysis import fit, theory
from mac_moesd.errors import BadInput
from mac_moesd.inputs import models
from mac_moesd.machine import memory
from mac_moesd.measure.forward import sweep
from mac_moesd.results import ResultsStore
from conftest import TINY_BUDGET
from test_fit import K_KV, L, synthetic_fit_document, synthetic_results, true_time

K_SEQ = 1.5e-3  # seconds per sequence per forward, whatever the context
SECOND = L // 4


def with_costs_per_sequence(data: dict, second_context: int | None = SECOND, noise=0.005, seed=1) -> dict:
    """``synthetic_results`` plus K_SEQ per sequence at every point, and, with ``second_context``,
    the one-token points timed there as a sweep records them."""
    rng = np.random.default_rng(seed)
    data = copy.deepcopy(data)
    entry = data["sweeps"]["m"]
    for key, point in entry["points"].items():
        point["median_s"] += K_SEQ * int(key.split("x")[0])
    if second_context is not None:
        batches = sorted({int(k.split("x")[0]) for k in entry["points"]})
        entry["kv_context"] = second_context
        entry["kv_points"] = {str(second_context): {
            f"{b}x1": {"median_s": (true_time(b, 1) + theory.kv_time(b, second_context - L, K_KV) + K_SEQ * b)
                       * (1 + noise * rng.standard_normal())}
            for b in batches}}
        # timed beside twins that read as the grid did: no drift between the two sessions
        entry["kv_twins"] = {str(second_context): {f"{b}x1": dict(entry["points"][f"{b}x1"]) for b in batches}}
    return data


def truth(b, t, context):
    return true_time(b, t) + float(theory.kv_time(b, context - L, K_KV)) + K_SEQ * b


def test_a_second_context_separates_the_kv_term_from_costs_per_sequence():
    inputs = fit.inputs_from_results(with_costs_per_sequence(synthetic_results(noise=0.005)))
    assert {c for _, _, c, _ in inputs.kv_points} == {SECOND}
    assert fit.NO_SECOND_CONTEXT not in inputs.missing
    result = fit.fit(inputs)
    assert result.k_kv == pytest.approx(K_KV, rel=0.25)
    assert result.best.k_seq == pytest.approx(K_SEQ, rel=0.25)
    model = result.model(timed_one_row=False)
    for b in (1, 4, 16):
        assert float(model.target(b, 1, 4 * L)) == pytest.approx(truth(b, 1, 4 * L), rel=0.03)
    doc = fit.fit_document(result)
    assert doc["kv"]["separated"] and doc["kv"]["second_context"] == SECOND
    assert {r["context"] for r in doc["kv"]["points"]} == {SECOND} and doc["kv"]["mape"] < 0.02
    stored = fit.FittedModel.from_document(doc)
    assert stored.k_seq == pytest.approx(result.best.k_seq)


@pytest.mark.slow  # several whole fits, seconds
def test_at_one_context_the_kv_term_carries_every_cost_per_sequence_and_the_fit_says_so():
    inputs = fit.inputs_from_results(with_costs_per_sequence(synthetic_results(noise=0.005), second_context=None))
    assert fit.NO_SECOND_CONTEXT in inputs.missing
    result = fit.fit(inputs)
    assert result.best.k_seq == 0.0
    # The whole per-sequence cost lands in k_kv (K_SEQ / L per cached token), so carried to a
    # longer context the prediction grows by far more than the cache does.
    assert result.k_kv > K_KV + 0.5 * K_SEQ / L
    model = result.model(timed_one_row=False)
    assert float(model.target(16, 1, 4 * L)) > 1.2 * truth(16, 1, 4 * L)
    assert not fit.fit_document(result)["kv"]["separated"]


def test_the_one_row_forward_is_carried_by_the_kv_term_alone():
    result = fit.fit(fit.inputs_from_results(with_costs_per_sequence(synthetic_results(noise=0.005))))
    model = result.model()
    timed = model.one_row["sync_s"]
    assert float(model.target(1, 1, 3 * L)) == pytest.approx(timed + 2 * L * result.k_kv)


def test_config_rejects_a_second_context_not_below_the_first():
    with pytest.raises(BadInput, match="--kv-context"):
        sweep.SweepConfig(model="tiny-moe", context=32, kv_context=32)
    assert sweep.SweepConfig(model="tiny-moe", context=32).second_context == 8
    assert sweep.SweepConfig(model="tiny-moe", context=32, kv_context=0).second_context is None
    assert sweep.SweepConfig(model="tiny-moe", context=1).second_context is None


def test_a_shortened_cache_holds_the_prompts_first_tokens():
    built = models.build(models.resolve("tiny-moe"))
    vocab = built.config["vocab_size"]
    prompt = mx.random.randint(0, vocab, (2, 12))
    short = sweep.RolledBackCache(built.model, 2, 12, vocab, prompt).shortened(1, 5)
    fresh = sweep.RolledBackCache(built.model, 1, 5, vocab, prompt[:1, :5])
    step = mx.array([[7]])
    got, want = built.model(step, cache=short.cache), built.model(step, cache=fresh.cache)
    assert mx.allclose(got, want, atol=1e-4).item()
    short.rollback(1)
    assert {c.offset for c in short.cache} == {5}


def test_the_estimate_counts_the_shortened_copies():
    built = models.build(models.resolve("tiny-moe"), dtype="float32")  # 4 bytes on any backend
    one = memory.sweep_estimate(built, (1, 2, 4), (1, 2), 64, 512)
    two = memory.sweep_estimate(built, (1, 2, 4), (1, 2), 64, 512, shortened=True)
    assert two["peak_bytes"] > one["peak_bytes"] and two["phase"] == "rows"
    # tiny-moe caches keys and values of 4 KV heads x 64 dims in float32: 2*4*64*4 = 2048 B per
    # slot per layer, x 4 layers = 8192 B. The prompt of 64 is one prefill forward (chunk 512) and
    # a 2-token forward follows; mlx-lm's KVCache grows by steps of 256 slots, so one 256-slot
    # buffer holds both: 8192*256 = 2 MiB per sequence.
    # The batch-4 cache: 4*2 MiB = 8_388_608. Beside it every batch's trimmed copy (1 + 2 + 4
    # sequences) and the rows copied for batches 1 and 2: 10*2 MiB = 20_971_520.
    assert two["parts"]["kv"] == 8_388_608
    assert two["parts"]["kv_rows"] == 20_971_520


@pytest.mark.slow
def test_the_sweep_times_one_token_points_at_the_second_context_and_keeps_them_when_it_changes(tmp_path):
    cfg = sweep.SweepConfig(model="tiny-moe", batches=(1, 2), tokens=(1, 2), context=16, budget=TINY_BUDGET)
    store = ResultsStore(tmp_path / "results.json", {})
    doc = sweep.run_sweep(cfg, store, None)
    assert doc["kv_points"]["context"] == 4
    assert [(p["batch"], p["tokens"]) for p in doc["kv_points"]["points"]] == [(1, 1), (2, 1)]
    (entry,) = store.data["sweeps"].values()
    first = copy.deepcopy(entry["kv_points"]["4"])

    again = sweep.run_sweep(cfg, ResultsStore(tmp_path / "results.json", {}), None)  # resumed: kept
    assert again["kv_points"]["points"] == doc["kv_points"]["points"]
    store = ResultsStore(tmp_path / "results.json", {})
    changed = sweep.run_sweep(sweep.SweepConfig(**{**cfg.__dict__, "kv_context": 8}), store, None)
    assert changed["kv_points"]["context"] == 8
    (entry,) = store.data["sweeps"].values()
    assert entry["kv_points"]["4"] == first  # kept, no longer used
    assert entry["kv_points"]["8"].keys() == first.keys()
    # 0: nothing timed at a second context, and what was timed beside the grid stays in use
    none = sweep.run_sweep(sweep.SweepConfig(**{**cfg.__dict__, "kv_context": 0}),
                           ResultsStore(tmp_path / "results.json", {}), None)
    assert none["kv_points"]["context"] == 8


@pytest.mark.slow
def test_a_file_made_before_second_contexts_keeps_its_grid_and_scales_them_by_their_twins(tmp_path):
    cfg = sweep.SweepConfig(model="tiny-moe", batches=(1, 2), tokens=(1, 2), context=16, budget=TINY_BUDGET)
    store = ResultsStore(tmp_path / "results.json", {})
    sweep.run_sweep(sweep.SweepConfig(**{**cfg.__dict__, "kv_context": 0}), store, None)
    (entry,) = store.data["sweeps"].values()
    assert "kv_context" not in entry and entry["kv_points"] == {}
    before = copy.deepcopy(entry)

    store = ResultsStore(tmp_path / "results.json", {})
    doc = sweep.run_sweep(cfg, store, None)
    (entry,) = store.data["sweeps"].values()
    for kind in ("points", "pipelined_points"):
        assert entry[kind] == before[kind]  # what was measured is kept
    # Each second-context point was timed beside a twin of its own at the first context, and is
    # carried into the grid's session by the grid point over that twin.
    short, twins = entry["kv_points"]["4"], entry["kv_twins"]["4"]
    assert short.keys() == twins.keys() == {"1x1", "2x1"}
    for row in doc["kv_points"]["points"]:
        key = f"{row['batch']}x1"
        scale = entry["points"][key]["median_s"] / twins[key]["median_s"]
        assert row["median_s"] == pytest.approx(short[key]["median_s"] * scale)


def test_a_model_whose_cache_cannot_trim_is_said_to_be_timed_at_one_context():
    data = with_costs_per_sequence(synthetic_results(noise=0.005), second_context=None)
    data["sweeps"]["m"]["kv_untrimmable"] = True
    missing = fit.inputs_from_results(data).missing
    assert fit.ONE_CONTEXT_ONLY in missing and fit.NO_SECOND_CONTEXT not in missing


def test_fits_stored_before_second_contexts_still_render():
    from mac_moesd.reporting import formatting

    doc = synthetic_fit_document()
    for key in ("kv", "k_seq"):
        del doc[key]
    for variant in doc["variants"]:
        del variant["k_seq"]
    (line,) = formatting.kv_lines(doc)
    assert f"fitted at context {L} alone" in line
    assert "k_seq" in formatting.render_fit(doc)
    assert fit.FittedModel.from_document(doc).k_seq == 0.0
