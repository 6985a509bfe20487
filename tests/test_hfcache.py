"""Finding models in a faked Hugging Face cache (HF_HUB_CACHE / HF_HOME), never the network."""

import json

import pytest

from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs import hfcache, models, pairs, zoo


def snapshot(root, repo, rev="abc123", weights=("model.safetensors",), index=None, ref=True):
    """A cache entry laid out as huggingface_hub writes it: models--org--name/snapshots/<rev>/."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(zoo.by_name("tiny-moe").config))
    for name in weights:
        (snap / name).write_bytes(b"\0")
    if index is not None:
        (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    if ref:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(rev)
    return snap


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hfcache.cache_root() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hfcache.cache_root() == tmp_path / "hub"


CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def test_cache_root_in_huggingface_hubs_order(tmp_path, monkeypatch):
    """huggingface_hub (constants.py): HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else
    HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert hfcache.cache_root() == tmp_path / "user" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hfcache.cache_root() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hfcache.cache_root() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", "~/legacy")
    assert hfcache.cache_root() == tmp_path / "user" / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", "$HOME/hub")
    assert hfcache.cache_root() == tmp_path / "user" / "hub"


def test_a_model_under_xdg_cache_home_is_found(tmp_path, monkeypatch):
    for name in CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    snap = snapshot(tmp_path / "huggingface" / "hub", "org/moe")
    assert hfcache.cached_model("org/moe") == snap
    assert models.resolve("org/moe").weights_dir == snap


def test_a_complete_snapshot_is_found_through_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    snap = snapshot(tmp_path / "hub", "org/moe")
    assert hfcache.cached_model("org/moe") == snap
    assert hfcache.cached_model("org/other") is None


def test_refs_main_wins_and_a_missing_shard_is_incomplete(tmp_path):
    index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    snapshot(tmp_path, "org/sharded", rev="old", weights=tuple(index.values()), index=index, ref=False)
    partial = snapshot(tmp_path, "org/sharded", rev="new", weights=(index["a"],), index=index)
    assert hfcache.cached_model("org/sharded", tmp_path) == tmp_path / "models--org--sharded" / "snapshots" / "old"
    assert hfcache.cached_model("org/sharded", tmp_path, need_weights=False) == partial


def test_resolve_takes_a_complete_snapshot_over_a_partial_one(tmp_path, monkeypatch):
    """refs/main names a snapshot whose second shard never arrived; an older one is complete:
    the model is the complete one, not the partial one with random weights filling the gap."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    old = snapshot(tmp_path, "org/sharded", rev="old", weights=tuple(index.values()), index=index, ref=False)
    snapshot(tmp_path, "org/sharded", rev="new", weights=(index["a"],), index=index)
    assert models.resolve("org/sharded").weights_dir == old


def test_a_partial_snapshot_alone_is_refused_naming_the_missing_shard(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    index = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    snapshot(tmp_path, "org/partial", weights=(index["a"],), index=index)
    with pytest.raises(MacMoesdError, match="lacks 1 of the 2 weight files .*: model-00002-of-00002.safetensors"):
        models.resolve("org/partial")


def test_resolve_names_a_cached_model_by_its_repo_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshot(tmp_path, "org/config-only", weights=())
    source = models.resolve("org/config-only")
    assert source.name == "org/config-only" and not source.has_weights
    with pytest.raises(MacMoesdError, match="not in the local Hugging Face cache at"):
        models.resolve("org/absent")


def test_a_snapshot_folder_given_by_its_path_is_named_by_its_repo_id(tmp_path, monkeypatch):
    # Its own name is a revision hash; named by its path or by its repo id, it is one model.
    snap = snapshot(tmp_path / "anywhere", "org/moe")
    assert models.resolve(str(snap)).name == "org/moe"
    assert models.resolve(str(snap / "config.json")).name == "org/moe"
    monkeypatch.chdir(snap)
    assert models.resolve(".").name == "org/moe"
    assert hfcache.repo_id_of(tmp_path / "org-moe") is None  # an ordinary folder keeps its name


def test_the_first_cached_pair_that_fits_is_chosen(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    known = (pairs.KnownPair("big/moe", "big/draft", ""), pairs.KnownPair("mid/moe", "mid/draft", ""),
             pairs.KnownPair("small/moe", "small/draft", ""))
    for repo in ("big/moe", "big/draft", "small/moe", "small/draft", "mid/moe"):
        snapshot(tmp_path, repo)
    asked = []

    def fits(target, draft):
        asked.append(target)
        return "needs about 17.0 GiB; 10.7 GiB is usable here" if target == "big/moe" else None

    found = pairs.find_cached_pair(fits, known)
    assert found.pair == known[2] and asked == ["big/moe", "small/moe"]
    assert found.passed_over == {"big/moe + big/draft": "needs about 17.0 GiB; 10.7 GiB is usable here",
                                 "mid/moe + mid/draft": "not in the cache: mid/draft"}
    assert found.to_dict()["cache"] == str(tmp_path)


def test_no_cached_pair_says_what_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    found = pairs.find_cached_pair(lambda t, d: None)
    assert found.pair is None
    assert set(found.passed_over) == {f"{p.target} + {p.draft}" for p in pairs.KNOWN_PAIRS}
