"""The SD loops' rollback on hybrid and sliding-window models, and the audit that proves it: after
a decode with rejections, every cache equals a plain forward of the emitted tokens. Each model is
the miniature of a zoo architecture; the no-op rollback is what mlx-lm's ``trim_prompt_cache``
does on them (it trims nothing once any layer cannot trim)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, trim_prompt_cache

from mac_moesd.cli import cli
from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs import models, zoo
from mac_moesd.measure.caches import rollback
from mac_moesd.measure.sd import speedup
from mac_moesd.measure.caches.rollback_audit import audit_caches, compare_caches
from mac_moesd.measure.decoding.sd_loop import Decoder
from mac_moesd.results import schema, validate

VOCAB = 256


def build(config_dir, name: str, seed: int, **overrides):
    return build_config(config_dir, {**zoo.miniature(zoo.by_name(name).config), **overrides}, f"{name}-{seed}", seed)


def build_config(config_dir, config: dict, folder: str, seed: int):
    mx.random.seed(seed)
    built = models.build(models.resolve(str(config_dir(config, folder))))
    built.materialise()
    return built.model


def decode(config_dir, name: str, strategy: str = "auto", **overrides) -> Decoder:
    """A target and a differently seeded drafter of one architecture, decoded with emulated
    acceptance at alpha 0.6 from a 24-token prompt: rounds with rejections, past any 8-token window."""
    target, draft = (build(config_dir, name, seed, **overrides) for seed in (0, 1))
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, VOCAB, (2, 25)))
    decoder = Decoder(target, draft, prompt, VOCAB, rollback=strategy)
    decoder.outputs = decoder.speculative(16, 3, "emulated-acceptance", 0.6, rng=rng).outputs
    return decoder


def audits(decoder: Decoder) -> list[dict]:
    return [audit_caches(model, caches, decoder.prompt, decoder.outputs)
            for model, caches in ((decoder.target, decoder.target_cache), (decoder.draft, decoder.draft_cache))]


def no_op_undo(self, forwarded, kept):
    """What the loops did before: mlx-lm's trim, which on these caches trims nothing."""
    trim_prompt_cache(self.caches, forwarded - kept.shape[1])
    return "trim"


ARCHITECTURES = {  # zoo name, config overrides
    "qwen3-next": ("qwen3-next-80b-a3b", {}),
    "gpt-oss past its window": ("gpt-oss-120b", {"sliding_window": 8}),
    "nested qwen3.5-moe": ("tiny-hybrid-moe", {}),
    "nemotron-h": ("tiny-mamba-moe", {}),
}


@pytest.mark.parametrize("arch", ["qwen3-next", "gpt-oss past its window"])
def test_the_audit_catches_a_rollback_that_did_nothing(arch, config_dir, monkeypatch):
    monkeypatch.setattr(rollback.Rollback, "undo", no_op_undo)
    name, overrides = ARCHITECTURES[arch]
    target, _ = audits(decode(config_dir, name, **overrides))
    assert target["ok"] is False
    assert "holds" in target["reason"] or target["max_abs_diff"] > target["tolerance"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("strategy", rollback.STRATEGIES)
def test_every_cache_kind_rolls_back_to_what_plain_decoding_holds(arch, strategy, config_dir):
    name, overrides = ARCHITECTURES[arch]
    decoder = decode(config_dir, name, strategy, **overrides)
    for audit in audits(decoder):
        assert audit["ok"], audit
    for applied in (decoder.target_rollback.applied, decoder.draft_rollback.applied):
        assert sum(applied.values()) > applied["none"]  # some rounds rejected
        used = {how for how, rounds in applied.items() if rounds and how != "none"}
        if strategy == "re-forward":
            assert used == {"re-forward"}
        elif arch in ("qwen3-next", "nested qwen3.5-moe", "nemotron-h"):  # no re-forward on a hybrid
            assert used == {"replay" if strategy == "replay" else "per-position"}
    if strategy != "re-forward" and arch == "gpt-oss past its window":
        # The verify forward leaves a window it can cut; the drafter's one-token steps do not.
        assert decoder.target_rollback.applied["window"] > 0 and decoder.target_rollback.applied["re-forward"] == 0


@pytest.mark.parametrize("strategy", ["per-position", "replay"])
@pytest.mark.parametrize("arch", ["qwen3-next", "nemotron-h"])
def test_a_recurrent_state_goes_back_to_the_kept_position_without_a_forward(arch, strategy, config_dir):
    """Four tokens forwarded, two kept: every recurrent leaf (convolution rows and state) equals a
    forward of those two alone from the same prompt, and nothing stays patched afterwards."""
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from mac_moesd import mlxlm_compat
    from mac_moesd.inputs.cache_kinds import leaf_kind, leaves

    name, overrides = ARCHITECTURES[arch]
    model = build(config_dir, name, 0, **overrides)
    prompt, tokens = mx.array([[5, 9, 2, 7, 1, 3]]), mx.array([[11, 4, 8, 6]])
    rolled, fresh = make_prompt_cache(model), make_prompt_cache(model)
    for caches in (rolled, fresh):
        model(prompt, cache=caches)
    conv_call = nn.Conv1d.__call__
    functions = [(module, n, getattr(module, n)) for module, n in mlxlm_compat.recurrence_sites(model)]
    undo = rollback.Rollback(model, rolled, strategy)
    undo.mark()
    model(tokens, cache=rolled)
    assert undo.undo(4, tokens[:, :2]) == strategy
    model(tokens[:, :2], cache=fresh)
    pairs = [(a, b) for a, b in zip(leaves(rolled), leaves(fresh)) if leaf_kind(a) == "recurrent"]
    assert pairs
    for got, want in pairs:
        for x, y in zip(got.cache, want.cache):
            assert x.shape == y.shape and mx.allclose(x, y, atol=1e-5).item()
    assert nn.Conv1d.__call__ is conv_call
    assert all(getattr(module, n) is f for module, n, f in functions)


def test_a_recurrence_the_suite_cannot_follow_is_re_forwarded_or_refused():
    """A model whose recurrent layers compute their state their own way (as Jamba's do): ``auto``
    re-forwards, ``per-position`` and ``replay`` are refused with the reason."""
    from mac_moesd.errors import BadInput

    class OwnScan:  # a module whose own module binds no recurrence function
        def named_modules(self):
            return [("", self)]

    caches = [KVCache(), ArraysCache(2)]
    assert rollback.Rollback(OwnScan(), caches).recurrent_way == "re-forward"
    for strategy in ("per-position", "replay"):
        with pytest.raises(BadInput, match=f"--rollback {strategy} cannot .* call neither of mlx-lm's gated_delta"):
            rollback.Rollback(OwnScan(), caches, strategy)
    assert rollback.Rollback(OwnScan(), [KVCache()], "per-position").recurrent_way is None


FAMILIES = Path(__file__).parent / "data" / "hybrid_families"  # mlx-lm 0.32's other hybrids, CI-sized
# How ``auto`` takes each family's recurrent state back: per position where its layers call
# mlx-lm's shared recurrence functions; Jamba's own Mamba scan and Bailing's GLA are re-forwarded.
FAMILY_WAYS = {"granitemoehybrid": "per-position", "kimi_linear": "per-position", "falcon_h1": "per-position",
               "olmo_hybrid": "per-position", "jamba": "re-forward", "bailing_hybrid": "re-forward"}


@pytest.mark.slow  # two models built and decoded per family
@pytest.mark.parametrize("family", sorted(FAMILY_WAYS))
def test_the_other_hybrid_families_roll_back_correctly(family, config_dir):
    config = json.loads((FAMILIES / f"{family}.json").read_text())
    target, draft = (build_config(config_dir, config, f"{family}-{seed}", seed) for seed in (0, 1))
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(0, VOCAB, (2, 25)))
    decoder = Decoder(target, draft, prompt, VOCAB)
    decoder.outputs = decoder.speculative(16, 3, "emulated-acceptance", 0.6, rng=rng).outputs
    for audit in audits(decoder):
        assert audit["ok"], audit
    assert decoder.target_rollback.applied[FAMILY_WAYS[family]] > 0
    if FAMILY_WAYS[family] == "re-forward":
        with pytest.raises(MacMoesdError, match=f"--rollback replay cannot .*\\({family}\\) call neither"):
            Decoder(target, draft, prompt, VOCAB, rollback="replay")


def test_the_audit_fails_a_cache_holding_nan():
    ones = KVCache()
    ones.update_and_fetch(mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 2, 4)))
    nan = KVCache()
    nan.update_and_fetch(mx.full((1, 1, 2, 4), float("nan")), mx.ones((1, 1, 2, 4)))
    result = compare_caches([nan], [ones])
    assert result["ok"] is False and "NaN" in result["reason"]


def test_which_caches_mlx_lm_rolls_back():
    assert rollback.mlx_lm_can_roll_back([KVCache(), KVCache()], longest=500)
    assert not rollback.mlx_lm_can_roll_back([KVCache(), ArraysCache(2)], longest=10)
    window = [KVCache(), RotatingKVCache(max_size=16)]
    assert rollback.mlx_lm_can_roll_back(window, longest=15)
    assert not rollback.mlx_lm_can_roll_back(window, longest=17)  # the window fills mid-decode


def test_a_cache_class_it_does_not_know_is_refused_by_name():
    class PagedCache:
        pass

    with pytest.raises(MacMoesdError, match="cannot roll back a PagedCache cache"):
        rollback.Rollback(None, [KVCache(), PagedCache()])
    with pytest.raises(MacMoesdError, match="unknown rollback strategy"):
        rollback.Rollback(None, [KVCache()], "replay-all")


@pytest.mark.slow  # loads and times models end to end
def test_a_spec_run_on_a_hybrid_records_its_rollback_and_audit():
    doc = speedup.run_spec(speedup.SpecConfig(target="tiny-hybrid-moe", draft="tiny-draft", batches=(1, 2),
                                        gammas=(2,), mode="emulated-acceptance", alphas=(0.7,),
                                        context=8, new_tokens=8, repeats=1))
    assert doc["valid"] is True
    assert validate.undeclared_keys(doc, schema.SpecDocument) == []
    for run in doc["runs"]:
        record = run["rollback"]
        assert (record["strategy"], record["requested"]) == ("per-position", "auto") and run["valid"] is True
        assert "ArraysCache" in record["cache_kinds"] and record["audit"]["ok"] is True
        assert record["rounds"]["target"]["per-position"] > 0 and record["rounds"]["target"]["re-forward"] == 0
        assert run["round"]["median_s"]["rollback"] > 0


def test_real_batch_one_on_a_hybrid_runs_in_the_suites_loop_not_mlx_lm():
    doc = speedup.run_spec(speedup.SpecConfig(target="tiny-hybrid-moe", draft="tiny-draft", batches=(1,),
                                        gammas=(2,), mode="real", context=8, new_tokens=6, repeats=1))
    (run,) = doc["runs"]
    assert run["engine"] == speedup.LOOP_FOR_MLX_LM and run["rollback"]["audit"]["ok"] and run["valid"]


def test_spec_exits_1_when_a_rollback_did_not_restore(tmp_path, monkeypatch):
    monkeypatch.setattr(rollback.Rollback, "undo", no_op_undo)
    result = CliRunner().invoke(cli, ["spec", "tiny-hybrid-moe", "--draft", "tiny-draft", "--batch", "2",
                                      "--gamma", "2", "--tokens", "8", "--repeats", "1", "--alpha", "0.5",
                                      "--context", "8", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 1, result.output
    assert "INVALID" in result.stderr or "invalid" in result.stderr
