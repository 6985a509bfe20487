"""What kind of sequence state each of a model's cache leaves holds, read off mlx-lm's classes.

- ``kv`` (``KVCache``, ``QuantizedKVCache``, ``ConcatenateKVCache``, ``ChunkedKVCache``): every
  past token's keys and values.
- ``sliding`` (``RotatingKVCache``): the last ``max_size`` tokens' keys and values.
- ``recurrent`` (``ArraysCache``): a fixed-size state, GatedDeltaNet's or Mamba2's.

The sweep counts a model's layers by it, and the SD loops roll each kind back its own way
(``measure.caches.rollback``). A class not listed is refused with its name.
"""

from __future__ import annotations

from mac_moesd import mlxlm_compat
from mac_moesd.errors import MacMoesdError

__all__ = ["CACHE_MODULE", "KINDS", "cache_kinds", "leaf_kind", "leaves"]

KINDS = {
    "KVCache": "kv", "QuantizedKVCache": "kv", "ConcatenateKVCache": "kv", "ChunkedKVCache": "kv",
    "RotatingKVCache": "sliding", "ArraysCache": "recurrent",
}
CACHE_MODULE = "mlx_lm.models.cache"


def leaves(caches) -> list:
    """Every cache leaf, a ``CacheList``'s children in its place."""
    out = []
    for cache in caches:
        if type(cache).__name__ == "CacheList" and type(cache).__module__ == CACHE_MODULE:
            out += leaves(mlxlm_compat.cache_children(cache))
        else:
            out.append(cache)
    return out


def leaf_kind(cache) -> str:
    """``kv``, ``sliding`` or ``recurrent``; any other class is refused with its name."""
    name = type(cache).__name__
    kind = KINDS.get(name) if type(cache).__module__ == CACHE_MODULE else None
    if kind is None:
        raise MacMoesdError(f"cannot roll back a {name} cache after a rejected draft: the SD loops know "
                            f"mlx-lm's {', '.join(KINDS)} and CacheList")
    return kind


def cache_kinds(caches) -> list[str]:
    """The distinct cache classes of ``caches``, sorted (what a run records as ``cache_kinds``)."""
    for leaf in leaves(caches):
        leaf_kind(leaf)
    return sorted({type(leaf).__name__ for leaf in leaves(caches)})
