"""Models already in the local Hugging Face cache, found without the network.

The hub's cache layout (huggingface_hub's ``file_download.py``): ``<root>/models--<org>--<name>/``
holds ``snapshots/<revision>/`` (the files) and ``refs/main`` (the revision ``main`` points to).
The root comes from the same variables, in the same order, as huggingface_hub's ``constants.py``:
``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE`` (its older name), ``$HF_HOME/hub``,
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``, each with ``~`` and
``$VARS`` expanded. It is read at each call (huggingface_hub reads it once, at import), so a test
can point it anywhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["cache_root", "cached_model", "repo_id_of"]


def _named(variable: str) -> Path | None:
    value = os.environ.get(variable)  # set but empty counts as unset
    return Path(os.path.expandvars(value)).expanduser() if value else None


def cache_root() -> Path:
    """The hub cache folder the environment names now."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if (root := _named(variable)) is not None:
            return root
    home = _named("HF_HOME") or (_named("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return home / "hub"


def _complete(snapshot: Path, need_weights: bool) -> bool:
    """config.json, and (``need_weights``) every weight file the snapshot's index names, or one
    model*.safetensors when it has no index."""
    if not (snapshot / "config.json").is_file():
        return False
    if not need_weights:
        return True
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return bool(shards) and all((snapshot / s).is_file() for s in shards)
    return any(snapshot.glob("model*.safetensors"))


def repo_id_of(snapshot: Path) -> str | None:
    """``org/name`` of a folder laid out as a cache's snapshot (``.../models--org--name/snapshots/
    <revision>``, wherever the cache is), else None: such a folder's own name is a revision hash."""
    snapshot = Path(os.path.abspath(snapshot))
    repo = snapshot.parent.parent.name
    if snapshot.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/")


def cached_model(repo_id: str, root: Path | None = None, need_weights: bool = True) -> Path | None:
    """The snapshot folder of ``repo_id`` with its config and (``need_weights``) all its weights,
    or None.

    The revision ``refs/main`` names comes first; without it (a cache copied by hand), the most
    recently modified complete snapshot.
    """
    repo = (root or cache_root()) / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        pinned = snapshots / ref.read_text().strip()
        if _complete(pinned, need_weights):
            return pinned
    candidates = sorted((p for p in snapshots.iterdir() if p.is_dir() and _complete(p, need_weights)),
                        key=lambda p: p.stat().st_mtime, reverse=True)
    return candidates[0] if candidates else None
