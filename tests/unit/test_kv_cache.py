"""PagedKVCache: block accounting (no leak, no double owner), read-back, truncate, full cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.kernels.paged_attention import kv_write
from dspark.models.kv_cache import CacheFullError, PagedKVCache

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 3


def _cache(num_blocks: int = 12, block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, num_blocks, block_size)


def _snapshot(cache: PagedKVCache) -> dict[str, Any]:
    tables = {r: list(cache._tables[r]) for r in cache.request_ids()}
    return {
        "free": list(cache._free),
        "tables": tables,
        "lengths": {r: cache.length(r) for r in cache.request_ids()},
    }


def _check_accounting(cache: PagedKVCache) -> None:
    """Every block is owned exactly once (free list or one table); tables fit their lengths."""
    owned = [b for r in cache.request_ids() for b in cache._tables[r]]
    assert sorted(owned + list(cache._free)) == list(range(cache.num_blocks))
    assert cache.num_free_blocks == cache.num_blocks - len(owned)
    for r in cache.request_ids():
        assert len(cache._tables[r]) == -(-cache.length(r) // cache.block_size), r


def _write(cache: PagedKVCache, req: str, start: int, end: int, seed: int) -> torch.Tensor:
    """Write random K (and V = -K) for positions [start, end) of every layer; return K."""
    k = torch.randn(
        LAYERS, end - start, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)
    )
    slots = cache.slots(req, start, end)
    for layer in range(LAYERS):
        kv_write(k[layer], -k[layer], cache.k[layer], cache.v[layer], slots)
    return k


_op = st.tuples(
    st.sampled_from(["reserve", "truncate", "release"]),
    st.sampled_from(["a", "b", "c", "d"]),
    st.integers(0, 30),
)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(_op, max_size=40), block_size=st.sampled_from([1, 3, 4]))
def test_random_operations_never_leak_blocks(
    ops: list[tuple[str, str, int]], block_size: int
) -> None:
    cache = _cache(num_blocks=16, block_size=block_size)
    for verb, req, n in ops:
        before = _snapshot(cache)
        if verb == "reserve":
            target = cache.length(req) + n
            need = cache.blocks_needed(req, target)
            if need > cache.num_free_blocks:
                with pytest.raises(CacheFullError):
                    cache.reserve(req, target)
                assert _snapshot(cache) == before  # a failed reserve changes nothing
            else:
                cache.reserve(req, target)
                assert cache.length(req) == target
                assert cache.num_free_blocks == len(before["free"]) - need
        elif verb == "truncate" and req in cache:
            keep = min(n, cache.length(req))
            cache.truncate(req, keep)
            assert cache.length(req) == keep
        elif verb == "release":
            cache.release(req)
            assert req not in cache and cache.length(req) == 0
        _check_accounting(cache)
    for req in cache.request_ids():
        cache.release(req)
    assert sorted(cache._free) == list(range(cache.num_blocks))


@settings(max_examples=15, deadline=None)
@given(
    chunks=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 9)), min_size=1, max_size=12
    )
)
def test_read_returns_what_was_written(chunks: list[tuple[str, int]]) -> None:
    """Requests grow in interleaved chunks (so their blocks interleave in the pool)."""
    cache = _cache(num_blocks=40, block_size=4)
    expected: dict[str, list[torch.Tensor]] = {}
    for seed, (req, n) in enumerate(chunks):
        start = cache.length(req)
        cache.reserve(req, start + n)
        expected.setdefault(req, []).append(_write(cache, req, start, start + n, seed))
    for req, parts in expected.items():
        k, v = cache.read(req)
        want = torch.cat(parts, dim=1)
        assert k.shape == (LAYERS, cache.length(req), KV_HEADS, HEAD_DIM)
        assert torch.equal(k, want)
        assert torch.equal(v, -want)


def test_truncate_frees_only_whole_blocks_past_the_kept_length() -> None:
    cache = _cache(num_blocks=8, block_size=4)
    cache.reserve("a", 10)  # 3 blocks
    k_before = _write(cache, "a", 0, 10, seed=0)
    assert cache.num_free_blocks == 5
    cache.truncate("a", 9)
    assert cache.num_free_blocks == 5  # block 3 still holds positions 8
    cache.truncate("a", 8)
    assert cache.num_free_blocks == 6
    k, _ = cache.read("a")
    assert torch.equal(k, k_before[:, :8])  # kept positions untouched
    cache.truncate("a", 0)
    assert cache.num_free_blocks == 8
    assert "a" in cache and cache.length("a") == 0
    # Grow again after a rollback: new values are visible, nothing stale.
    cache.reserve("a", 5)
    k_new = _write(cache, "a", 0, 5, seed=1)
    assert torch.equal(cache.read("a")[0], k_new)


def test_rollback_then_rewrite_keeps_prefix() -> None:
    """Verify writes past the committed length; rejected entries are replaced by the next step."""
    cache = _cache(num_blocks=8, block_size=4)
    cache.reserve("a", 6)
    prefix = _write(cache, "a", 0, 6, seed=0)
    cache.reserve("a", 11)
    _write(cache, "a", 6, 11, seed=1)  # drafts
    cache.truncate("a", 7)  # one accepted
    kept, _ = cache.read("a")
    assert torch.equal(kept[:, :6], prefix)
    cache.reserve("a", 9)
    fresh = _write(cache, "a", 7, 9, seed=2)
    k, _ = cache.read("a")
    assert torch.equal(k[:, :6], prefix) and torch.equal(k[:, 7:], fresh)


def test_cache_full_changes_nothing() -> None:
    cache = _cache(num_blocks=4, block_size=4)
    cache.reserve("a", 9)  # 3 blocks
    before = _snapshot(cache)
    with pytest.raises(CacheFullError):
        cache.reserve("b", 5)  # needs 2, 1 free
    with pytest.raises(CacheFullError):
        cache.reserve("a", 17)  # needs 2 more
    assert _snapshot(cache) == before
    assert "b" not in cache
    cache.reserve("b", 4)  # exactly the last block
    assert cache.num_free_blocks == 0
    cache.reserve("a", 12)  # fits in a's third block: no new block needed
    assert cache.length("a") == 12


def test_metadata_layout() -> None:
    cache = _cache(num_blocks=8, block_size=4)
    cache.reserve("a", 3)
    cache.reserve("b", 9)
    meta = cache.metadata(["a", "b"], [1, 5], [2, 4])
    assert torch.equal(meta.positions, torch.tensor([1, 2, 5, 6, 7, 8]))
    assert torch.equal(meta.cu_seqlens_q, torch.tensor([0, 2, 6]))
    assert torch.equal(meta.seq_lens, torch.tensor([3, 9]))
    assert meta.max_q == 4 and meta.max_ctx == 9
    assert torch.equal(meta.block_tables[0, 1:], torch.tensor([-1, -1]))
    table_b = meta.block_tables[1]
    assert torch.equal(
        meta.slot_mapping[2:],
        torch.tensor([table_b[1] * 4 + 1, table_b[1] * 4 + 2, table_b[1] * 4 + 3, table_b[2] * 4]),
    )
