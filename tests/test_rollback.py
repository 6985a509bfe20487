"""Rolling back and copying rows of every prompt-cache class mlx-lm 0.32 has, through the sweep's
RolledBackCache, on a stand-in model whose caches hold the token ids themselves: position t of
sequence b holds prompt[b, t], so every expected value is read off the prompt."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, ConcatenateKVCache, KVCache,
                                 QuantizedKVCache, RotatingKVCache)

from mac_moesd import mlxlm_compat
from mac_moesd.errors import MacMoesdError
from mac_moesd.inputs import models
from mac_moesd.measure.caches import cache_copy
from mac_moesd.measure.caches.rolled_cache import RolledBackCache

HEAD = 64  # QuantizedKVCache quantizes groups of 32 along the head


class IdsModel:
    """Writes each token id into every cache: as keys and values (B, 1, T, HEAD) of a KV cache,
    and as the running sum of ids per sequence, (B, 1), in an ArraysCache's one state."""

    def __init__(self, make):
        self.make_cache = make

    def __call__(self, ids, cache):
        for c in cache:
            self.write(c, ids)
        return ids

    def write(self, c, ids):
        if isinstance(c, CacheList):
            for child in c.caches:
                self.write(child, ids)
        elif isinstance(c, ArraysCache):
            total = ids.astype(mx.float32).sum(axis=1, keepdims=True)
            c[0] = total if c[0] is None else c[0] + total
        else:
            kv = mx.broadcast_to(ids[:, None, :, None].astype(mx.float32), (*ids.shape[:1], 1, ids.shape[1], HEAD))
            c.update_and_fetch(kv, kv)


FACTORIES = {
    "KVCache": lambda: [KVCache()],
    "RotatingKVCache (within its window)": lambda: [RotatingKVCache(max_size=16)],
    "RotatingKVCache (window full)": lambda: [RotatingKVCache(max_size=6)],  # prefilled to its size
    "QuantizedKVCache": lambda: [QuantizedKVCache(group_size=32, bits=8)],
    "ChunkedKVCache": lambda: [ChunkedKVCache(chunk_size=32)],
    "ConcatenateKVCache": lambda: [ConcatenateKVCache()],
    "ArraysCache": lambda: [ArraysCache(1)],
    "CacheList of KVCaches": lambda: [CacheList(KVCache(), KVCache())],
    "CacheList with an ArraysCache": lambda: [CacheList(KVCache(), ArraysCache(1))],
}

PROMPT = mx.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20, 21, 22, 23, 24]])


def leaves(caches):
    for c in caches:
        yield from (leaves(c.caches) if isinstance(c, CacheList) else [c])


def ids_held(c, batch: int) -> mx.array:
    """What a cache holds per sequence, as the ids it was written: (batch, positions) for a KV
    cache (dequantized where quantized), (batch, 1) for an ArraysCache."""
    if isinstance(c, ArraysCache):
        return c[0]
    keys, _ = c.keys, c.values
    if isinstance(c, QuantizedKVCache):
        keys = mx.dequantize(*keys, group_size=c.group_size, bits=c.bits)
    keys = keys[..., : min(c.offset, keys.shape[2]), 0]  # the positions written, not the spare slots
    assert keys.shape[0] == batch
    return keys[:, 0, :]


@pytest.mark.parametrize("kind", FACTORIES)
def test_rows_are_the_first_sequences_and_the_parent_is_left_as_it_was(kind):
    parent = RolledBackCache(IdsModel(FACTORIES[kind]), 4, 6, 50, PROMPT)
    before = [mx.array(ids_held(c, 4)) for c in leaves(parent.cache)]
    child = parent.rows(2)
    for c, held in zip(leaves(child.cache), before):
        assert mx.array_equal(ids_held(c, 2), held[:2]).item(), kind
    # A forward and a rollback of the copy leave the parent's rows untouched, and the copy's own
    # rows back where they were.
    child_model = IdsModel(None)
    child_model(mx.array([[40], [41]]), child.cache)
    child.rollback(1)
    for c, held in zip(leaves(child.cache), before):
        assert mx.array_equal(ids_held(c, 2), held[:2]).item(), kind
    for c, held in zip(leaves(parent.cache), before):
        assert mx.array_equal(ids_held(c, 4), held).item(), kind
    assert set(cache_copy.offsets(child.cache)) <= {6}


def test_a_cache_list_is_rolled_back_with_its_rows_sliced():
    """The issue's case: CacheList.state holds (state, class name) pairs, which a row take over
    the state never sliced; the copy kept all four rows and shared its parent's arrays."""
    parent = RolledBackCache(IdsModel(FACTORIES["CacheList with an ArraysCache"]), 4, 6, 50, PROMPT)
    child = parent.rows(1)
    (kv, arrays), = [c.caches for c in child.cache]
    assert kv.keys.shape[0] == 1 and kv.offset == 6
    assert mx.array_equal(kv.keys[0, 0, :6, 0], mx.array([1, 2, 3, 4, 5, 6], dtype=mx.float32)).item()
    assert arrays[0].tolist() == [[21.0]]  # 1 + 2 + ... + 6
    (parent_kv, parent_arrays), = [c.caches for c in parent.cache]
    assert parent_kv.keys is not kv.keys and parent_kv.keys.shape[0] == 4
    assert parent_arrays[0].tolist() == [[21.0], [57.0], [93.0], [129.0]]  # 6*7/2 + 6*6*k


def test_a_full_window_restores_the_prefill_after_in_place_writes():
    """A sliding window filled to its size cannot trim, so it is restored from a snapshot; its
    one-token updates write into its buffers in place, which must never reach the snapshot."""
    cache = RolledBackCache(IdsModel(FACTORIES["RotatingKVCache (window full)"]), 1, 6, 50, PROMPT[:1])
    prefilled = mx.array(cache.cache[0].keys)
    for token in (30, 31, 32):
        IdsModel(None)(mx.array([[token]]), cache.cache)
        cache.rollback(1)
    assert mx.array_equal(cache.cache[0].keys, prefilled).item()
    assert cache.cache[0].offset == 6


class OwnCache(KVCache):
    """A cache class the rollback does not know (same state as KVCache, other behaviour maybe)."""


def test_a_cache_class_it_does_not_know_is_refused():
    with pytest.raises(MacMoesdError, match="cannot roll back a OwnCache cache"):
        RolledBackCache(IdsModel(lambda: [OwnCache()]), 2, 3, 50, PROMPT[:2, :3])
    with pytest.raises(MacMoesdError, match="cannot copy or roll back a OwnCache cache"):
        cache_copy.copy_cache(CacheList(KVCache(), OwnCache()))


def test_a_cache_whose_state_layout_changed_is_refused(monkeypatch):
    monkeypatch.setitem(mlxlm_compat.CACHE_LAYOUTS, "KVCache", ("rows", "rows"))
    with pytest.raises(MacMoesdError, match=r"needs mlx-lm >=0.32,<0.33 \(KVCache.state with 2 fields"):
        cache_copy.copy_cache(KVCache())


def held_arrays(caches) -> list:
    """Every array a cache holds as its state: a KV cache's up to its offset (the spare slots
    past it are not part of the context), a window's whole buffer, a recurrent layer's states."""
    out = []
    for leaf in leaves(caches):
        if isinstance(leaf, ArraysCache):
            state = leaf.state[0]
        elif isinstance(leaf, RotatingKVCache):
            state = leaf.state[:2]
        else:
            state = [a[..., : leaf.offset, :] for a in leaf.state[:2]]
        out += [np.array(a) for a in state if a is not None]
    return out


@pytest.mark.parametrize("name", ["tiny-hybrid-moe", "tiny-swa-moe", "tiny-mamba-moe"])
@pytest.mark.parametrize("settle", [True, False], ids=["synchronous", "in a pipelined chain"])
def test_a_hybrid_or_full_window_cache_goes_back_bit_for_bit(name, settle):
    """After timed forwards of 1 and 4 tokens, every array of every cache equals the prefill's,
    bit for bit (context 24 fills tiny-swa-moe's 16-token window)."""
    built = models.build(models.resolve(name))
    built.materialise()
    rolled = RolledBackCache(built.model, 2, 24, 4096)
    assert not rolled.trimmable
    before = held_arrays(rolled.cache)
    for tokens in (1, 4, 1):
        out = built.model(mx.random.randint(0, 4096, (2, tokens)), cache=rolled.cache)
        rolled.rollback(tokens, settle=settle)
        mx.eval(out, cache_copy.arrays(rolled.cache))
        after = held_arrays(rolled.cache)
        assert len(after) == len(before)
        assert all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("name", ["tiny-hybrid-moe", "tiny-swa-moe"])
def test_a_cache_that_cannot_trim_gives_the_second_context_its_prefill_passed(name):
    built = models.build(models.resolve(name))
    built.materialise()
    prompt = mx.random.randint(0, 4096, (2, 40))
    parent = RolledBackCache(built.model, 2, 40, 4096, prompt, also_at=20)
    short = parent.shortened(2, 20)
    alone = RolledBackCache(built.model, 2, 20, 4096, prompt[:, :20])
    assert short.context == 20 and set(cache_copy.offsets(short.cache)) <= {20}
    assert all(np.array_equal(a, b) for a, b in zip(held_arrays(short.cache), held_arrays(alone.cache)))
    assert parent.shortened(1, 10) is None  # a context its prefill did not pass


def test_a_trim_that_would_take_back_fewer_tokens_is_never_used():
    from mlx_lm.models.cache import ChunkedKVCache, KVCache

    from mac_moesd.measure.caches import rollback

    chunked = ChunkedKVCache(chunk_size=8)
    chunked.update_and_fetch(mx.zeros((1, 1, 10, 4)), mx.zeros((1, 1, 10, 4)))
    chunked.maybe_trim_front()  # 10 tokens into a chunk of 8: it starts at position 2
    assert (chunked.offset, chunked.start_position) == (10, 2)
    assert rollback._trims(chunked, 8) and not rollback._trims(chunked, 9)  # trim(9) would take back 8
    plain = KVCache()
    plain.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    assert rollback._trims(plain, 3) and not rollback._trims(plain, 4)
