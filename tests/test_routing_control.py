import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import TINY_BUDGET
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from mac_moesd.analysis import theory
from mac_moesd.analysis.digest import Digest
from mac_moesd.cli import cli
from mac_moesd.errors import BadInput
from mac_moesd.inputs import models, zoo
from mac_moesd.measure.experts import gather, routing, routing_control, routing_trace
from mac_moesd.measure.forward import sweep
from mac_moesd.reporting import report
from mac_moesd.results import ResultsStore, load_results

MOE = [e for e in zoo.ZOO if zoo.expert_shape(e.config)]
META = {"chip_slug": "test", "backend": "cpu", "versions": {"mlx": mx.__version__}, "blas": {"name": "x"}}
QUICK = ["--context", "8", "--seconds-per-point", "0.01", "--quick", "--decode-chain", "8"]


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def built_moe(entry=None, **kw):
    config = zoo.miniature((entry or zoo.by_name("tiny-moe")).config, **kw)
    built = models.build(models.ModelSource("m", config))
    built.materialise()
    return built


# ---- generators ----


def mean_and_sd(draw, reps=1500, seed=0):
    rng = np.random.default_rng(seed)
    counts = [np.unique(draw(rng)).size for _ in range(reps)]
    return float(np.mean(counts)), float(np.std(counts)) / np.sqrt(reps)


@pytest.mark.parametrize("experts, top_k, c", [(64, 4, 0.0), (64, 4, 0.5), (64, 4, 1.0), (8, 2, 0.3)])
def test_correlated_sequences_follow_the_anchored_form(experts, top_k, c):
    for batch, tokens in ((1, 2), (1, 4), (1, 8), (4, 4)):
        mean, se = mean_and_sd(lambda rng: routing_control.correlated_indices(rng, batch, tokens, experts,
                                                                               top_k, c))
        # B independent sequences of t tokens act like B*(1 + c*(t-1)) uniform tokens.
        expected = theory.activated_experts(batch * theory.correlated_tokens(tokens, c), experts, top_k)
        assert abs(mean - expected) <= 4 * se + 1e-9, (batch, tokens, mean, expected)


def test_generated_tokens_hold_k_distinct_experts():
    rng = np.random.default_rng(0)
    for draw in (routing_control.uniform_indices(rng, 4, 8, 16, 4),
                 routing_control.correlated_indices(rng, 4, 8, 16, 4, 0.4)):
        assert draw.shape == (4, 8, 4)
        assert all(len(set(token)) == 4 for token in draw.reshape(-1, 4))
        assert draw.min() >= 0 and draw.max() < 16
    # c = 0: every token of a sequence reuses the first token's experts
    same = routing_control.correlated_indices(rng, 1, 6, 64, 4, 0.0)[0]
    assert all(set(t) == set(same[0]) for t in same)


def test_uniform_indices_match_n_of_t():
    for n in (2, 8, 32):
        mean, se = mean_and_sd(lambda rng: routing_control.uniform_indices(rng, 1, n, 64, 4))
        assert abs(mean - theory.activated_experts(n, 64, 4)) <= 4 * se


def test_parse_routing():
    assert routing_control.parse_routing("model").label == "model"
    assert routing_control.parse_routing("uniform").forced
    assert routing_control.parse_routing("correlated:0.50").label == "correlated:0.5"
    for bad in ("", "uniform:3", "correlated", "correlated:1.5", "correlated:x", "trace:", "random"):
        with pytest.raises(BadInput):
            routing_control.parse_routing(bad)


# ---- forcing and sorting inside the model ----


def test_forced_indices_reach_the_experts_and_the_router_still_runs():
    built = built_moe(experts=16, top_k=2)
    tokens = mx.array([[1, 2, 3]])
    with routing.controlled_switches(built.model) as controls:
        forced = mx.array(np.full((1, 3, 2), [5, 9]), dtype=mx.uint32)
        for control in controls:
            control.forced = forced
        with routing.capture_routing(built.model) as sinks:
            forced_logits = built.model(tokens)
        for sink in sinks:
            assert np.array_equal(np.array(sink[0]), np.array(forced))
        for control in controls:
            control.forced = None
        own = built.model(tokens)
    assert not mx.allclose(forced_logits, own).item()
    assert type(routing.switch_modules(built.model)[0]) is SwitchGLU  # class restored


@pytest.mark.parametrize("entry", MOE, ids=lambda e: e.name)
def test_every_moe_architecture_runs_the_forced_indices(entry):
    built = built_moe(entry)
    experts, top_k = built.footprint["experts"], built.footprint["top_k"]
    tokens = mx.random.randint(0, 256, (2, 3))
    control = routing_control.SweepRouting(built.model, routing_control.parse_routing("uniform"), "mlx-lm",
                                           experts, top_k)

    def forward():
        return built.model(tokens)

    with control.installed():
        stats = control.prepare(2, 3, forward, lambda: None)
        with routing.capture_routing(built.model) as sinks:
            mx.eval(control.run(2, 3, forward))
    expected = control.generate(2, 3, len(sinks))
    assert len(sinks) == built.footprint["moe_layers"]
    for sink, indices in zip(sinks, expected):
        assert np.array_equal(np.array(sink[0]).reshape(2, 3, top_k), indices)
    assert stats == {"unique_experts": routing_control.unique_per_layer(expected), "pairs": 2 * 3 * top_k}


@pytest.mark.parametrize("entry", MOE, ids=lambda e: e.name)
def test_sorted_gather_computes_what_mlx_lm_computes(entry):
    built = built_moe(entry)
    tokens = mx.random.randint(0, 256, (2, 3))  # 6 tokens x K: below mlx-lm's sort threshold
    plain = built.model(tokens)
    with routing.controlled_switches(built.model, always_sort=True):
        sorted_logits = built.model(tokens)
    assert mx.allclose(plain, sorted_logits, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("cls", [SwitchGLU, SwitchMLP])
def test_sorted_switch_call_matches_the_module(cls):
    module = cls(32, 48, 8)
    x = mx.random.normal((2, 3, 32))
    indices = mx.array(np.random.default_rng(0).integers(0, 8, (2, 3, 2)), dtype=mx.uint32)
    assert mx.allclose(module(x, indices), gather.sorted_switch_call(module, x, indices), atol=1e-5).item()
    quantized = cls(64, 64, 8)
    for name in ("gate_proj", "up_proj", "down_proj", "fc1", "fc2"):
        if name in quantized:
            setattr(quantized, name, quantized[name].to_quantized())
    x = mx.random.normal((2, 3, 64))
    assert mx.allclose(quantized(x, indices), gather.sorted_switch_call(quantized, x, indices),
                       atol=1e-4).item()


def test_sorted_gather_refuses_a_switch_with_its_own_call():
    class Custom(SwitchGLU):
        def __call__(self, x, indices):
            return super().__call__(x, indices)

    with pytest.raises(Exception, match="call of its own"):
        gather.check_sortable(Custom(8, 8, 4))


# ---- the sweep under control ----


@pytest.fixture(scope="module")
def deep_moe(tmp_path_factory):
    """64 experts top-4 over 32 MoE layers: a uniform count averaged over 32 layers has a
    standard deviation of at most 1.3% of its expectation (B*t = 4), so 5% is four of them."""
    folder = tmp_path_factory.mktemp("deep") / "deep-moe"
    folder.mkdir()
    config = zoo.miniature(zoo.by_name("tiny-moe").config, layers=32, experts=64, top_k=4)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def sweep_json(*args):
    result = invoke("sweep", *args, "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def swept(model, path, routing="model", batches=(1, 8), tokens=(1, 8)) -> dict:
    """The sweep document, in process with the suite's tiny budget (the CLI path of --routing is
    the same function; its wiring is checked by the CLI tests below)."""
    cfg = sweep.SweepConfig(model=str(model), batches=batches, tokens=tokens, context=8, budget=TINY_BUDGET,
                            routing=routing)
    return sweep.run_sweep(cfg, ResultsStore(path, META), None)


@pytest.mark.slow
def test_sweep_uniform_routing_activates_n_of_bt(deep_moe, tmp_path):
    path = tmp_path / "results.json"
    uniform = swept(deep_moe, path, "uniform")
    assert uniform["routing"] == "uniform" and uniform["gather"] == "mlx-lm"
    for p in uniform["points"]:
        n = p["batch"] * p["tokens"]
        assert p["pairs"] == n * 4
        assert p["unique_experts"] == pytest.approx(theory.activated_experts(n, 64, 4), rel=0.05)
    correlated = swept(deep_moe, path, "correlated:0.5", tokens=(2, 8))
    assert correlated["routing"] == "correlated:0.5"
    by_point = {(p["batch"], p["tokens"]): p["unique_experts"] for p in uniform["points"]}
    for p in correlated["points"]:
        b, t = p["batch"], p["tokens"]
        expected = theory.activated_experts(b * theory.correlated_tokens(t, 0.5), 64, 4)
        assert p["unique_experts"] == pytest.approx(expected, rel=0.15)
        if b == 1 and t >= 4:
            assert p["unique_experts"] < 0.8 * by_point[(b, t)]
    # The model's own routing is counted too, and all three sweeps keep results of their own.
    own = swept(deep_moe, path, batches=(1,), tokens=(1, 2))
    assert own["routing"] == "model" and all(p["unique_experts"] >= 4 for p in own["points"])
    keys = list(load_results(path)["sweeps"])
    assert len(keys) == 3 and sum("routing=" in k for k in keys) == 2


@pytest.mark.slow
def test_resumed_forced_sweep_keeps_its_points(tmp_path):
    args = ["tiny-moe", "--routing", "uniform", "--batch", "1", "--tokens", "1,2", *QUICK, "--out", tmp_path]
    first = sweep_json(*args)
    again = sweep_json(*args)
    assert first["points"] == again["points"]  # nothing re-measured


@pytest.mark.slow
def test_gather_sorted_runs_and_is_recorded(tmp_path):
    doc = sweep_json("tiny-moe", "--gather", "sorted", "--batch", "1,2", "--tokens", "1,2", *QUICK,
                     "--out", tmp_path)
    assert doc["gather"] == "sorted" and doc["routing"] == "model"
    assert all(p["median_s"] > 0 and p["pairs"] == p["batch"] * p["tokens"] * 4 for p in doc["points"])
    (key,) = load_results(tmp_path / "results.json")["sweeps"]
    assert key.endswith("|gather=sorted")


@pytest.mark.slow
def test_saved_trace_replays_its_own_counts(tmp_path):
    trace_file = tmp_path / "trace.npz"
    routed = invoke("routing", "tiny-moe", "--text", "prose", "--batch", "1,2", "--tokens", "1,4",
                    "--length", "16", "--save-trace", trace_file, "--out", tmp_path, "--json")
    assert routed.exit_code == 0, routed.stderr
    assert json.loads(routed.stdout)["trace"] == str(trace_file)
    trace = routing_trace.load_trace(trace_file)
    assert (trace.experts, trace.top_k, trace.layers) == (64, 4, 4)
    doc = sweep_json("tiny-moe", "--routing", f"trace:{trace_file}", "--batch", "1,2", "--tokens", "1,2,4",
                     *QUICK, "--out", tmp_path)
    assert doc["routing"] == f"trace:{trace_file.resolve()}"
    for p in doc["points"]:
        b, t = p["batch"], p["tokens"]
        window = trace.indices[:, :b, trace.length - t:, :]
        assert p["unique_experts"] == np.mean([np.unique(layer).size for layer in window])


def test_mismatched_trace_is_refused_and_results_kept(tmp_path):
    trace_file = tmp_path / "other.npz"
    indices = np.random.default_rng(0).integers(0, 8, (2, 4, 16, 2))
    routing_trace.save_trace(trace_file, indices, 8, 2, "tiny-moe-8x2", "prose", "hashed")
    (tmp_path / "results.json").write_text("keep me")
    for spec, fragment in ((f"trace:{trace_file}", "E=8, K=2"), (f"trace:{tmp_path / 'none.npz'}", "not found")):
        result = invoke("sweep", "tiny-moe", "--routing", spec, "--out", tmp_path)
        assert result.exit_code == 2, result.output
        assert fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert (tmp_path / "results.json").read_text() == "keep me"
    short = tmp_path / "short.npz"
    routing_trace.save_trace(short, np.zeros((4, 1, 2, 4), dtype=int), 64, 4, "tiny-moe", "prose", "hashed")
    # One sequence of 2 tokens gives two disjoint one-token windows, not three.
    sweep.validate(sweep.SweepConfig(model="tiny-moe", batches=(2,), tokens=(1,), routing=f"trace:{short}"))
    with pytest.raises(BadInput, match=r"holds 1 sequences of 2 tokens \(2 disjoint windows of 1\); "
                                       "this grid needs 3 of 1"):
        sweep.validate(sweep.SweepConfig(model="tiny-moe", batches=(3,), tokens=(1,), routing=f"trace:{short}"))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="not a routing trace"):
        routing_control.parse_routing(f"trace:{tmp_path / 'junk.npz'}")


def numbered_trace(sequences, length, layers=1):
    """A trace whose token p of sequence s in layer l chose expert 100*l + 10*s + p (K = 1), so a
    replayed window says where every id came from."""
    l, s, p = np.meshgrid(np.arange(layers), np.arange(sequences), np.arange(length), indexing="ij")
    return routing_trace.Trace(indices=(100 * l + 10 * s + p)[..., None], experts=1000, top_k=1,
                               model="m", text="t", digest="0")


def test_a_batch_larger_than_the_trace_replays_earlier_spans_of_its_sequences():
    trace = numbered_trace(sequences=2, length=4)
    window = routing_control.trace_window(trace, 0, batch=4, tokens=2)[..., 0]
    # Sequences 0 and 1 give their last two tokens (2, 3), then the two before them (0, 1).
    assert window.tolist() == [[2, 3], [12, 13], [0, 1], [10, 11]]
    assert routing_control.trace_window(trace, 0, batch=2, tokens=3)[..., 0].tolist() == [[1, 2, 3], [11, 12, 13]]
    # 2 sequences x floor(4/2) = 4 windows of 2 tokens, 2 x floor(4/3) = 2 of 3: no more.
    assert routing_control.trace_capacity(trace, 2) == 4 and routing_control.trace_capacity(trace, 3) == 2
    for batch, tokens in ((5, 2), (3, 3), (1, 5)):
        with pytest.raises(BadInput, match=f"cannot replay {batch} of {tokens}"):
            routing_control.trace_window(trace, 0, batch, tokens)
    assert [routing_control.spans_per_sequence(trace, b) for b in (1, 2, 3, 4)] == [1, 1, 2, 2]


def test_interleaved_traces_alternate_their_sequences():
    a = numbered_trace(sequences=2, length=4, layers=2)
    b = replace(numbered_trace(sequences=3, length=3), indices=numbered_trace(3, 3).indices + 500)
    both = routing_trace.interleave([a, b])[..., 0]
    # The layers both hold (1), the shorter length (3, a's last three tokens), a0 b0 a1 b1 b2.
    assert both.shape == (1, 5, 3)
    assert both[0].tolist() == [[1, 2, 3], [500, 501, 502], [11, 12, 13], [510, 511, 512], [520, 521, 522]]
    with pytest.raises(Exception, match="cannot be interleaved"):
        routing_trace.interleave([a, replace(b, top_k=2)])


def test_forced_routing_on_a_dense_model_is_refused(tmp_path):
    result = invoke("sweep", "tiny-dense", "--gather", "sorted", "--out", tmp_path)
    assert result.exit_code == 2 and "need an MoE model" in result.stderr


def test_help_names_the_modes():
    text = invoke("sweep", "--help").output
    assert "--routing" in text and "correlated:C" in text and "trace:FILE" in text and "--gather" in text
    assert "--save-trace" in invoke("routing", "--help").output


# ---- digest and report ----


@pytest.fixture(scope="module")
def what_if_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("whatif") / "results.json"
    for routing_mode, gather_mode in (("model", "mlx-lm"), ("model", "sorted"), ("uniform", "mlx-lm")):
        cfg = sweep.SweepConfig(model="tiny-moe", batches=(1,), tokens=(1, 4), context=8, budget=TINY_BUDGET,
                                routing=routing_mode, gather=gather_mode)
        sweep.run_sweep(cfg, ResultsStore(path, META), None)
    return load_results(path)


@pytest.mark.slow
def test_digest_keeps_the_as_run_sweep_first(what_if_results):
    d = Digest(what_if_results)
    (view,) = d.models
    assert (view.routing, view.gather) == ("model", "mlx-lm")
    assert [(v.routing, v.gather) for v in d.what_ifs(view)] == [("model", "sorted"), ("uniform", "mlx-lm")]


@pytest.mark.slow
def test_report_compares_the_gathers_when_both_were_measured(what_if_results, tmp_path):
    paths = report.write_report(what_if_results, tmp_path)
    text = paths["markdown"].read_text()
    assert "## What-ifs: forced routing and sorted gather" in text
    assert "routing model, B=1: a 4-token forward costs" in text and "with every gather sorted" in text
    assert (tmp_path / "figures" / "what_if.png").exists()
    assert "| uniform | mlx-lm | 1 |" in text
    only = {**what_if_results, "sweeps": {k: v for k, v in what_if_results["sweeps"].items()
                                          if v.get("gather") != "sorted" and v.get("routing") == "model"}}
    plain = report.write_report(only, tmp_path / "plain")["markdown"].read_text()
    assert "What-ifs" not in plain and not (tmp_path / "plain" / "figures" / "what_if.png").exists()


def test_fit_of_a_what_if_sweep_alone_says_so():
    from mac_moesd.analysis import fit
    from test_fit import synthetic_results

    data = synthetic_results(noise=0.0)
    next(iter(data["sweeps"].values()))["routing"] = "uniform"
    inputs = fit.inputs_from_results(data)
    assert any("only a what-if sweep" in line for line in inputs.missing)
    assert not any("what-if" in line for line in fit.inputs_from_results(synthetic_results()).missing)


def test_a_sweep_replaying_the_models_own_trace_is_as_run_not_a_what_if():
    # A pair run's sweep replays the routing the target itself chose on the prompts: generation's
    # routing of real text, not a forced one, so its fit is not flagged as a what-if.
    from mac_moesd.analysis import fit
    from test_fit import synthetic_results

    data = synthetic_results(noise=0.0)
    next(iter(data["sweeps"].values()))["routing"] = "trace:traces/target-code+chat.npz"
    assert not any("what-if" in line for line in fit.inputs_from_results(data).missing)
    assert Digest(data).models[0].as_run
