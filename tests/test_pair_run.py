"""`run --target --draft`: the pipeline on a pair of the user's own; the default run's search of
the Hugging Face cache for a known pair."""

import json
import shutil

import pytest
from click.testing import CliRunner
from pairs_helpers import qwen2_pair

from mac_moesd import pair
from mac_moesd.cli import cli
from mac_moesd.errors import BadInput
from mac_moesd.inputs import models, pairs, zoo
from mac_moesd.measure import spec


@pytest.fixture(scope="module")
def own_pair(tmp_path_factory):
    """A pair saved in mlx-lm's format by this test module, seen nowhere else."""
    return qwen2_pair(tmp_path_factory.mktemp("own-pair"))


def cache_snapshot(root, repo, folder):
    snap = root / ("models--" + repo.replace("/", "--")) / "snapshots" / "0123abcd"
    shutil.copytree(folder, snap)
    return snap


def spec_peak(plan, target, draft):
    cfg = spec.SpecConfig(target=target, draft=draft, batches=plan.spec_batches, gammas=plan.spec_gammas,
                          mode="real", context=plan.context, new_tokens=plan.spec_tokens)
    return spec.estimate(cfg, models.build(models.resolve(target)), models.build(models.resolve(draft)))["peak_bytes"]


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
    base = pair.runner.default_plan("metal", quick=True)
    small, big = spec_peak(base, "org/moe", "org/draft"), spec_peak(base, "org/big-moe", "org/big-draft")
    assert small < big
    plan, search = pair.find_default_pair("metal", True, usable_bytes=(small + big) // 2)
    assert (plan.target, plan.draft) == ("org/moe", "org/draft")
    assert plan.found.startswith(f"found in the Hugging Face cache at {tmp_path / 'hub'}")
    assert search.passed_over["org/absent-moe + org/draft"] == "not in the cache: org/absent-moe"
    assert "for SD at full depth" in search.passed_over["org/big-moe + org/big-draft"]
    assert plan.base.bits is None and plan.base.dense is None  # weights as stored, no dense control

    plan, search = pair.find_default_pair("metal", True, usable_bytes=small // 2)
    assert plan is None and search.to_dict()["target"] is None


def test_a_pair_plan_refuses_a_dense_target_and_foreign_vocabularies(tmp_path, own_pair):
    target, draft = own_pair
    with pytest.raises(BadInput, match="is not an MoE model"):
        pair.pair_plan("cpu", True, str(draft), str(draft))
    with pytest.raises(BadInput, match="--draft tiny-draft has no weights here"):
        pair.pair_plan("cpu", True, str(target), "tiny-draft")
    foreign = qwen2_pair(tmp_path, hidden=64)[1]
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(BadInput, match="different vocabularies"):
        pair.pair_plan("cpu", True, str(target), str(foreign))
    with pytest.raises(BadInput, match="prompt file not found: nope.txt"):
        pair.pair_plan("cpu", True, str(target), str(draft), ("code", "nope.txt"))
    plan = pair.pair_plan("cpu", True, str(target), str(draft), ("chat",))
    assert pair.stage_labels(plan) == ["roofline", "sweep my-moe", "routing my-moe on chat", "fit",
                                       "spec my-moe on chat"]


@pytest.mark.parametrize("args, fragment", [
    (["--target", "x"], "--target and --draft go together"),
    (["--draft", "x"], "--target and --draft go together"),
    (["--target", "a", "--draft", "b", "--models", "tiny-moe"], "--models and --full choose zoo models"),
    (["--target", "a", "--draft", "b", "--prompts", ","], "name at least one prompt set"),
])
def test_run_pair_usage_errors(tmp_path, args, fragment):
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path), *args])
    assert result.exit_code == 2
    assert fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_run_pair_of_an_unknown_model_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["run", "--quick", "--out", str(tmp_path), "--target",
                                      str(tmp_path / "nowhere"), "--draft", "tiny-draft"])
    assert result.exit_code == 1
    assert "nowhere' is not a directory" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_dry_run_of_a_pair(own_pair):
    target, draft = own_pair
    result = CliRunner().invoke(cli, ["run", "--quick", "--dry-run", "--target", str(target), "--draft",
                                      str(draft), "--chip", "Apple M1", "--memory", "8", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [s["stage"] for s in doc["stages"]] == ["roofline", f"sweep {target}", f"routing {target}",
                                                   f"spec {target}"]
    assert doc["bits"] is None and doc["stages"][1]["models"] == [str(target), str(draft)]
    assert zoo.expert_shape(models.resolve(str(target)).config) == (8, 2)


def test_routing_on_a_prompt_set_uses_the_tokenizer_one_sequence_per_prompt(tmp_path, own_pair):
    from mac_moesd.inputs.prompts import load_prompts
    from mac_moesd.measure import routing

    target, _ = own_pair
    cfg = routing.RoutingConfig(model=str(target), prompts="chat", batches=(1, 2, 4, 64), tokens=(1, 2, 4),
                                length=16)
    doc = routing.run_routing(cfg, None, trace=tmp_path / "chat.npz")
    assert doc["text"] == "prompt set chat" and doc["token_ids"] == "tokenizer"
    # The byte-level tokenizer gives one id per byte: every chat prompt is longer than 16.
    assert doc["sequences"] == len(load_prompts("chat").prompts) == 30
    assert sorted({w["batch"] for w in doc["windows"]}) == [1, 2, 4]  # 64 sequences do not exist
    assert 0 < doc["correlation"] <= 1 and 0 < doc["batch_correlation"] <= 1
    assert doc["trace"] == str(tmp_path / "chat.npz")

    short = tmp_path / "short.txt"
    short.write_text("hi\n\nyo\n\nok then")
    with pytest.raises(BadInput, match="routing needs two"):
        routing.run_routing(routing.RoutingConfig(model=str(target), prompts=str(short), batches=(1,),
                                                  tokens=(1,), length=16), None)
