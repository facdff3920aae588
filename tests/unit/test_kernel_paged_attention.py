"""Paged attention and KV write kernels against their references (CUDA, else interpreted).

Attention is compared with `paged_attention_ref` run in float64 on the same inputs, at
(atol, rtol) = (1e-5, 1e-5) for float32, (2e-3, 2e-3) for float16 and (1.6e-2, 1.6e-2) for
bfloat16 (CUDA only: triton's interpreter multiplies bfloat16 tiles as raw integers). The KV
write is a copy: caches are compared with `torch.equal`. Shapes are small and irregular: ℓ = 0
(one query token), ℓ = max, one request, positions on and across block and tile boundaries,
GQA groups 1, 2 and 4, head dims 16, 24, 64 and 128.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.kernels.dispatch import HAS_TRITON, next_power_of_2
from dspark.kernels.paged_attention import (
    GROUP_OVERHEAD,
    SHORT_QUERY,
    AttentionMetadata,
    kv_write,
    kv_write_ref,
    kv_write_triton,
    paged_attention,
    paged_attention_ref,
    paged_attention_triton,
)

# tests/conftest.py asks for triton's interpreter (no CUDA) before anything imports triton.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (Linux x86-64)")

TOLERANCES = {  # dtype: (atol, rtol) against the float64 reference
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(DEVICE == "cpu", reason="interpreter lacks bfloat16 dot"),
    ),
]


def _batch(
    seed: int,
    q_lens: list[int],  # new tokens per request (1 + ℓ for a verify block)
    cached: list[int],  # tokens already in the cache before them
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and caches over shuffled physical blocks; unused slots hold large garbage."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(q_lens)
    seq_lens = [c + n for c, n in zip(cached, q_lens, strict=True)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3  # a few blocks nobody owns
    physical = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((num_reqs, max(blocks) + 1), -1, dtype=torch.long)  # -1 padding
    for r, n in enumerate(blocks):
        tables[r, :n] = torch.tensor(physical[:n])
        physical = physical[n:]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, q_lens, strict=True)])
    token_req = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(q_lens))
    slots = tables[token_req, positions // block_size] * block_size + positions % block_size
    cu = torch.zeros(num_reqs + 1, dtype=torch.long)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    meta = AttentionMetadata(
        positions=positions, cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens),
        block_tables=tables, slot_mapping=slots, block_size=block_size,
        max_q=max(q_lens), max_ctx=max(seq_lens),
    )  # fmt: skip
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, 100.0)  # garbage wherever no request has a key
    v_cache = torch.full(shape, 100.0)
    for r, s in enumerate(seq_lens):
        pos = torch.arange(s)
        b, o = tables[r, pos // block_size], pos % block_size
        k_cache[b, o] = torch.randn(s, kv_heads, head_dim, generator=g)
        v_cache[b, o] = torch.randn(s, kv_heads, head_dim, generator=g)
    q = torch.randn(len(positions), heads, head_dim, generator=g)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta


def _to(meta: AttentionMetadata, device: str) -> AttentionMetadata:
    fields = ("positions", "cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping")
    moved = {f: getattr(meta, f).to(device) for f in fields}
    return AttentionMetadata(
        **moved, block_size=meta.block_size, max_q=meta.max_q, max_ctx=meta.max_ctx
    )


CASES = {  # name: (q_lens, cached, heads, kv_heads, head_dim, block_size)
    # ℓ = 0 (1 token) to ℓ = 8; 61..64 crosses a 64-key tile, 16.. starts on a block boundary
    "verify_varlen_gqa4": ([1, 4, 9, 3], [0, 61, 130, 16], 8, 2, 16, 4),
    "one_request_mha_d64": ([5], [15], 2, 2, 64, 16),  # positions 15..19 cross a block
    "gqa4_d128_block_start": ([1, 8], [64, 200], 8, 2, 128, 16),  # position 64: block and tile
    "prefill_tiles_gqa4": ([70, 2], [0, 5], 4, 1, 16, 8),  # 280 query rows: five 64-row tiles
    "head_dim_24_gqa2": ([3, 1], [10, 0], 2, 1, 24, 4),  # a masked head-dim tail
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_float64_reference(name: str, dtype: torch.dtype) -> None:
    seed = list(CASES).index(name) * 10 + DTYPES.index(dtype) if dtype != torch.bfloat16 else 99
    q, k_cache, v_cache, meta = _batch(seed, *CASES[name], dtype)
    scale = CASES[name][4] ** -0.5
    got = paged_attention_triton(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE),
                                 _to(meta, DEVICE), scale).cpu()  # fmt: skip
    want = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), meta, scale)
    assert got.dtype == dtype and got.shape == q.shape
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


def test_attention_reads_strided_q_and_dispatches_when_forced() -> None:
    q, k_cache, v_cache, meta = _batch(7, [2, 3], [5, 9], 4, 2, 16, 4, torch.float32)
    wide = torch.cat([q, torch.randn_like(q)], dim=1)  # q is a view with head stride 16
    args = (wide[:, :4].to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), _to(meta, DEVICE))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DSPARK_KERNELS", "triton")
        forced = paged_attention(*args, 0.25).cpu()
    want = paged_attention_ref(q.double(), k_cache.double(), v_cache.double(), meta, 0.25)
    torch.testing.assert_close(forced.double(), want, atol=1e-5, rtol=1e-5)


def _runs_cost(runs: list[list[int]], q_lens: list[int], seq_lens: list[int]) -> int:
    return sum(GROUP_OVERHEAD + len(run) * max(q_lens[r] for r in run)
               * max(seq_lens[r] for r in run) for run in runs)  # fmt: skip


@pytest.mark.parametrize(
    "q_lens",
    [[155, 4, 1, 40, 8, 17], [3, 1, 9], [30, 2, 70, 33], [155] + [4] * 15, [5] * 6,
     [1] * 40 + [2] * 14 + [3] * 6 + [8] * 4, [8, 3, 1, 5], [20, 31, 1, 2]],  # fmt: skip
)
def test_torch_path_attends_runs_of_query_lengths_as_the_reference_does(
        q_lens: list[int]) -> None:
    # Prompts beside verify blocks, skewed verify blocks: the reference pads every request to
    # the longest query; the torch path cuts the batch into the cheapest runs of lengths.
    cached = [(0, 61, 130, 16, 7, 40)[r % 6] + r for r in range(len(q_lens))]
    q, k_cache, v_cache, meta = _batch(3, q_lens, cached, 4, 2, 16, 4, torch.float64)
    want = paged_attention_ref(q, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(paged_attention(q, k_cache, v_cache, meta, 0.25), want,
                               atol=1e-12, rtol=1e-12)
    groups = meta.query_groups
    tokens = torch.cat([t for t, _ in groups]).tolist()
    assert sorted(tokens) == list(range(sum(q_lens)))
    seq_lens = meta.seq_lens.tolist()
    runs = [meta.token_req[t].unique().tolist() for t, _ in groups]
    for run, (_, layout) in zip(runs, groups, strict=True):
        assert [q_lens[r] for r in run] == layout.q_lens
        assert [seq_lens[r] for r in run] == layout.seq_lens.tolist()
    # Against every cut of the sorted length classes into runs (a class never apart): each
    # length up to SHORT_QUERY, then powers of two.
    key = [n if n <= SHORT_QUERY else next_power_of_2(n) for n in q_lens]
    keys = sorted(set(key))
    cuts = [[[r for r in range(len(q_lens)) if keys[a] <= key[r] <= keys[b - 1]]
             for a, b in itertools.pairwise((0, *chosen, len(keys)))]
            for k in range(len(keys))
            for chosen in itertools.combinations(range(1, len(keys)), k)]  # fmt: skip
    best = min(_runs_cost(cut, q_lens, seq_lens) for cut in cuts)
    assert _runs_cost(runs, q_lens, seq_lens) == best
    if len(set(key)) == 1:
        assert groups == ((groups[0][0], meta),)  # the whole batch, as it is


def test_attention_launcher_asserts_dtypes() -> None:
    q, k_cache, v_cache, meta = _batch(8, [1], [3], 2, 1, 16, 4, torch.float32)
    with pytest.raises(AssertionError):
        paged_attention_triton(q.half(), k_cache, v_cache, meta, 1.0)
    with pytest.raises(AssertionError):
        bad = AttentionMetadata(**{**meta.__dict__, "seq_lens": meta.seq_lens.int()})
        paged_attention_triton(q, k_cache, v_cache, bad, 1.0)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
def test_kv_write_matches_reference(dtype: torch.dtype) -> None:
    """Slots of a varlen batch in shuffled blocks, on and across block boundaries."""
    _, k_cache, v_cache, meta = _batch(20, [1, 6, 3], [3, 7, 0], 2, 2, 16, 4, dtype)
    g = torch.Generator().manual_seed(21)
    k = torch.randn(len(meta.slot_mapping), 2, 16, generator=g).to(dtype)
    v = torch.randn(len(meta.slot_mapping), 2, 16, generator=g).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_write_ref(k, v, want_k, want_v, meta.slot_mapping)
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    kv_write_triton(k.to(DEVICE), v.to(DEVICE), got_k, got_v, meta.slot_mapping.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_kv_write_strided_inputs_int32_slots_and_padding() -> None:
    """k, v as views of a fused projection; int32 slots; slot -1 (padding) writes nothing."""
    g = torch.Generator().manual_seed(22)
    k_cache, v_cache = torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16)
    fused = torch.randn(5, 3, 2, 16, generator=g)  # [tokens, (q, k, v), kv_heads, head_dim]
    k, v = fused[:, 1], fused[:, 2]
    slots = torch.tensor([11, 0, -1, 4, 3], dtype=torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    real = slots >= 0
    kv_write_ref(k[real], v[real], want_k, want_v, slots[real].long())
    got_k, got_v = k_cache.to(DEVICE), v_cache.to(DEVICE)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DSPARK_KERNELS", "triton")
        kv_write(k.to(DEVICE), v.to(DEVICE), got_k, got_v, slots.to(DEVICE))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_kv_write_launcher_asserts_dtype() -> None:
    cache = torch.zeros(2, 4, 1, 16)
    with pytest.raises(AssertionError):
        kv_write_triton(torch.zeros(1, 1, 16).half(), torch.zeros(1, 1, 16).half(), cache,
                        cache.clone(), torch.tensor([0]))  # fmt: skip
