"""Copies of mlx-lm prompt caches, whole or the first B sequences, for every cache class of mlx-lm 0.32.

A cache's ``state`` is a tuple laid out by its class (mlx_lm/models/cache.py). A copy holds new
array objects for every array in it, cut to the first B rows where asked (each per-sequence
array holds the batch on axis 0), so a write into the copy (KVCache writes its buffers in
place) never reaches the original, nor the original's into the copy. A ``CacheList`` is copied
cache by cache. A class not listed in ``mlxlm_compat.CACHE_LAYOUTS``, or one whose state no longer has the listed
layout, is refused: a wrong copy would time another cache than the one asked for.
"""

from __future__ import annotations

import copy
from typing import Iterator

import mlx.core as mx

from mac_moesd import mlxlm_compat
from mac_moesd.errors import MacMoesdError

__all__ = ["arrays", "can_shorten", "copy_cache", "offsets", "restore"]

CACHE_MODULE = "mlx_lm.models.cache"

def _is_cache_list(cache) -> bool:
    return type(cache).__name__ == "CacheList" and type(cache).__module__ == CACHE_MODULE


def _layout(cache) -> tuple[str, ...]:
    name = type(cache).__name__
    layout = mlxlm_compat.CACHE_LAYOUTS.get(name) if type(cache).__module__ == CACHE_MODULE else None
    if layout is None:
        raise MacMoesdError(f"cannot copy or roll back a {name} cache: the sweep and SD loops know mlx-lm's "
                            f"{', '.join(mlxlm_compat.CACHE_LAYOUTS)} and CacheList")
    if len(cache.state) != len(layout):
        raise mlxlm_compat.incompatible("rolling back a KV cache", f"{name}.state with {len(layout)} fields")
    return layout


def _rows(value, rows: int | None):
    if value is None:
        return None
    return mx.array(value if rows is None else value[:rows])


def _copied(kind: str, value, rows: int | None):
    if kind == "rows":
        return _rows(value, rows)
    if kind == "quantized":
        return None if value is None else tuple(_rows(v, rows) for v in value)
    if kind == "row list":
        return [_rows(v, rows) for v in value]
    return value


def copy_cache(cache, rows: int | None = None):
    """A copy of ``cache`` holding its first ``rows`` sequences (every one with None)."""
    if _is_cache_list(cache):
        return type(cache)(*(copy_cache(c, rows) for c in mlxlm_compat.cache_children(cache)))
    layout = _layout(cache)
    out = copy.copy(cache)
    out.state = tuple(_copied(kind, value, rows) for kind, value in zip(layout, cache.state))
    if hasattr(cache, "offset"):
        out.offset = cache.offset  # ConcatenateKVCache's setter takes it from the keys, not from a trim
    return out


def restore(cache, saved) -> None:
    """Put ``saved`` (a ``copy_cache`` of ``cache``) back into ``cache``, in place, as fresh
    arrays: the next writes into ``cache`` leave ``saved`` as it is."""
    if _is_cache_list(cache):
        for child, saved_child in zip(mlxlm_compat.cache_children(cache), mlxlm_compat.cache_children(saved)):
            restore(child, saved_child)
        return
    layout = _layout(cache)
    cache.state = tuple(_copied(kind, value, None) for kind, value in zip(layout, saved.state))
    if hasattr(saved, "offset"):
        cache.offset = saved.offset


def _leaves(cache) -> Iterator:
    if _is_cache_list(cache):
        for child in mlxlm_compat.cache_children(cache):
            yield from _leaves(child)
    else:
        yield cache


def offsets(caches) -> list[int]:
    """The token offset of every cache that keeps one (a state-space layer's cache keeps none)."""
    return [c.offset for cache in caches for c in _leaves(cache) if isinstance(getattr(c, "offset", None), int)]


def arrays(caches) -> list[mx.array]:
    """Every array the caches hold (to evaluate them)."""
    out = []
    for cache in caches:
        for leaf in _leaves(cache):
            for kind, value in zip(_layout(leaf), leaf.state):
                if kind == "rows":
                    out.append(value)
                elif kind in ("quantized", "row list"):
                    out.extend(value or ())
    return [a for a in out if a is not None]


def can_shorten(cache, context: int) -> bool:
    """Whether ``cache``, prefilled to ``context``, can be trimmed back to a shorter context: plain,
    quantized and concatenating KV caches can; a sliding window filled to its size, a chunked
    cache past its chunk and a state-space layer's cache cannot."""
    if _is_cache_list(cache):
        return all(can_shorten(c, context) for c in mlxlm_compat.cache_children(cache))
    name = type(cache).__name__
    if name == "RotatingKVCache":
        return context < cache.max_size
    return name in ("KVCache", "QuantizedKVCache", "ConcatenateKVCache")
