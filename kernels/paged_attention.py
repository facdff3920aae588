"""Varlen attention over a paged KV cache, and the KV write by slot mapping.

Each request r brings `q_len_r` query tokens at its own absolute positions; its keys are the
first `seq_len_r` entries of its paged cache (the new tokens already written). A query at
position P sees keys at positions <= P: causal within the block, full over the cached prefix.
Prefill chunks and verify blocks share one batch this way.

`paged_attention_ref` and `kv_write_ref` are the specifications; `paged_attention` and `kv_write`
are the dispatches the models call (`dspark.kernels.dispatch`); `paged_attention_triton` and
`kv_write_triton` launch `_paged_attention_kernel` and `_kv_write_kernel`; without triton,
`paged_attention` runs the reference over groups of requests of like query lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dspark.kernels.dispatch import interpreting, lazy_jit, next_power_of_2, use_triton

if TYPE_CHECKING:  # bound on first launch by lazy_jit (dspark.kernels.dispatch)
    import triton.language as tl


# What one more call of the torch path costs, in attended (query row, key) pairs: a pass of 64
# verify blocks of 1..8 tokens (150 cached each, the demo target, one thread) took 0.43 ms more
# for each extra call and 16 us more for each padded query row, so about 32 rows of 150 keys.
GROUP_OVERHEAD = 32 * 150
# Query lengths up to this are classes of their own; longer ones (prompts) class by power of
# two, which bounds the classes (and the cut's work, quadratic in them) at ~30.
SHORT_QUERY = 16
# What the Triton attention kernel takes (tl.dot has no float64); other dtypes run the reference.
ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttentionMetadata:
    """Layout of one varlen batch over a paged cache; built once per forward, shared by layers."""

    positions: torch.Tensor  # [num_tokens] absolute position of each query token
    cu_seqlens_q: torch.Tensor  # [num_reqs + 1] prefix sums of query lengths
    seq_lens: torch.Tensor  # [num_reqs] keys visible to each request (cached + new)
    block_tables: torch.Tensor  # [num_reqs, max_blocks] block ids, -1 padding
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    block_size: int
    max_q: int
    max_ctx: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @cached_property
    def token_req(self) -> torch.Tensor:  # [num_tokens] request of each token
        q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]
        return torch.repeat_interleave(torch.arange(self.num_reqs, device=q_lens.device), q_lens)

    @cached_property
    def token_local(self) -> torch.Tensor:  # [num_tokens] index of each token within its request
        idx = torch.arange(self.positions.shape[0], device=self.positions.device)
        return idx - self.cu_seqlens_q[self.token_req]

    @cached_property
    def ctx_slots(self) -> torch.Tensor:  # [num_reqs, max_ctx] flat slot of each context position
        pos = torch.arange(self.max_ctx, device=self.seq_lens.device)
        blocks = self.block_tables[:, pos // self.block_size].clamp(min=0)
        return blocks * self.block_size + pos % self.block_size

    @cached_property
    def mask(self) -> torch.Tensor:  # [num_reqs, 1, max_q, max_ctx] True where attention is allowed
        q_pos = torch.zeros(
            self.num_reqs, self.max_q, dtype=torch.long, device=self.positions.device
        )
        q_pos[self.token_req, self.token_local] = self.positions
        k_pos = torch.arange(self.max_ctx, device=self.positions.device)
        allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < self.seq_lens[:, None, None]
        )
        return allowed[:, None]

    @cached_property
    def q_lens(self) -> list[int]:  # [num_reqs] query tokens of each request
        return (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).tolist()

    def select(self, rows: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """(token indices, layout) of requests `rows` (ascending) alone, their tokens in batch
        order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.seq_lens.device)
        tokens = torch.isin(self.token_req, index).nonzero().squeeze(1)
        q_lens = [self.q_lens[r] for r in rows]
        cu = torch.zeros(len(rows) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        seq_lens = self.seq_lens[index]
        max_ctx = int(seq_lens.max())
        return tokens, AttentionMetadata(
            positions=self.positions[tokens], cu_seqlens_q=cu.to(self.cu_seqlens_q.device),
            seq_lens=seq_lens,
            block_tables=self.block_tables[index, : -(-max_ctx // self.block_size)],
            slot_mapping=self.slot_mapping[tokens], block_size=self.block_size,
            max_q=max(q_lens), max_ctx=max_ctx,
        )  # fmt: skip

    @cached_property
    def query_groups(self) -> tuple[tuple[torch.Tensor, AttentionMetadata], ...]:
        """(token indices, layout) of each group of requests `paged_attention` (without triton)
        attends in one call; one group (the whole batch) where that is cheapest. Built once per
        forward, as the layout is, and shared by the layers.

        The reference pads every request to the longest query and the longest context of its
        call, and each call costs GROUP_OVERHEAD besides. Length classes (each length up to
        SHORT_QUERY, then powers of two) sorted by length are cut into runs, a class never
        apart, minimising the sum over runs of GROUP_OVERHEAD + requests x longest query x
        longest context, by dynamic programming over the classes.

        A pass that prefills one prompt of 155 tokens beside 15 verify blocks of 4 attended
        16 x 155 query rows in one call, 145 ms where the prompt alone took 43 and the blocks
        alone 24; 64 verify blocks of geometric lengths 1..8 took 47 ms in one call and 44 in
        runs (the demo target, one thread, 150 cached tokens each)."""
        q_lens, ctx = self.q_lens, self.seq_lens.tolist()
        classes: dict[int, list[int]] = {}  # length class: its requests, ascending
        for r, n in enumerate(q_lens):
            classes.setdefault(n if n <= SHORT_QUERY else next_power_of_2(n), []).append(r)
        keys = sorted(classes)
        lengths = [max(q_lens[r] for r in classes[key]) for key in keys]
        counts = [len(classes[key]) for key in keys]
        class_ctx = [max(ctx[r] for r in classes[key]) for key in keys]
        best = [0] * (len(lengths) + 1)  # best[j]: cost of the first j classes, cut[j] its cut
        cut = [0] * (len(lengths) + 1)
        for j in range(1, len(lengths) + 1):
            reqs, longest_ctx, best[j] = 0, 0, -1
            for i in range(j - 1, -1, -1):  # the run of classes i .. j-1
                reqs, longest_ctx = reqs + counts[i], max(longest_ctx, class_ctx[i])
                cost = best[i] + GROUP_OVERHEAD + reqs * lengths[j - 1] * longest_ctx
                if best[j] < 0 or cost < best[j]:
                    best[j], cut[j] = cost, i
        runs, j = [], len(lengths)
        while j:
            runs.append(sorted(r for key in keys[cut[j] : j] for r in classes[key]))
            j = cut[j]
        if len(runs) == 1:
            return ((torch.arange(self.positions.shape[0], device=self.positions.device), self),)
        return tuple(self.select(rows) for rows in reversed(runs))


def kv_write_ref(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keys = k_cache.view(-1, kv_heads, head_dim)[meta.ctx_slots]  # [num_reqs, max_ctx, kv_heads, d]
    values = v_cache.view(-1, kv_heads, head_dim)[meta.ctx_slots]
    q_pad = q.new_zeros(meta.num_reqs, meta.max_q, q.shape[1], head_dim)
    q_pad[meta.token_req, meta.token_local] = q
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=kv_heads != q.shape[1],
    )
    return out.transpose(1, 2)[meta.token_req, meta.token_local]


def kv_write(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """Dispatch: write each new token's keys and values to its cache slot (`kv_write_ref`)."""
    if use_triton(k_cache):
        kv_write_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        kv_write_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Dispatch: varlen causal attention over the paged cache (`paged_attention_ref`). Without
    triton, the reference over each of `meta.query_groups` apart."""
    if use_triton(q, ATTENTION_DTYPES):
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    groups = meta.query_groups
    if len(groups) == 1:
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
    out = q.new_empty(q.shape)
    for tokens, layout in groups:
        out[tokens] = paged_attention_ref(q[tokens], k_cache, v_cache, layout, scale)
    return out


# ---------------------------------------------------------------------------------------------
# Triton


def kv_write_triton(
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim] unit stride in head_dim
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim] unit stride in head_dim
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    slot_mapping: torch.Tensor,  # [num_tokens] int64 or int32; -1 (padding) is skipped
) -> None:
    """`kv_write_ref` as one program per token.

    A negative slot marks a padding token and is not written (the reference, which the engine
    never gives padding, would index the cache from its end).
    """
    num_tokens, kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape, (k.shape, v.shape)
    assert k_cache.shape[2:] == (kv_heads, head_dim), (k_cache.shape, k.shape)
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (k.dtype, k_cache.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must have unit stride"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    assert slot_mapping.dtype in (torch.int64, torch.int32), slot_mapping.dtype
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )  # fmt: skip


@lazy_jit
def _kv_write_kernel(
    k_ptr,  # [num_tokens, kv_heads, head_dim]
    v_ptr,  # [num_tokens, kv_heads, head_dim]
    k_cache_ptr,  # [num_slots, kv_heads, head_dim] contiguous
    v_cache_ptr,  # [num_slots, kv_heads, head_dim] contiguous
    slot_ptr,  # [num_tokens]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    heads = tl.where(slot >= 0, kv_heads, 0)  # a padding token writes no head
    mask = (h < heads) & (d < HEAD_DIM)
    dst = slot * kv_heads * HEAD_DIM + h * HEAD_DIM + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, heads, head_dim] unit stride in head_dim
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    meta: AttentionMetadata,
    scale: float,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """`paged_attention_ref` as a flash-attention loop over each request's pages.

    One program per (request, kv head, tile of BLOCK_M query rows); a row is one (query token,
    query head of this kv head's GQA group), so a verify block's 1 + ℓ tokens and the whole
    group share one read of the keys and values: the kernel is bound by that read. Keys are
    gathered BLOCK_N at a time through the block table (any block size); softmax is online, in
    float32, exp2 with the scale folded in. The loop stops at the tile's largest position + 1,
    so causality costs no extra reads. float32 inputs use IEEE products (no TF32).
    """
    num_tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim, k_cache.shape
    assert heads % kv_heads == 0, (heads, kv_heads)
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    assert q.dtype in ATTENTION_DTYPES, q.dtype
    # Triton 3.x's interpreter multiplies bfloat16 tiles as their raw uint16 bits.
    assert not (q.dtype == torch.bfloat16 and interpreting()), "bfloat16 needs a GPU"
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_size == meta.block_size, (block_size, meta.block_size)
    for name in ("positions", "cu_seqlens_q", "seq_lens", "block_tables"):
        tensor = getattr(meta, name)
        assert tensor.dtype == torch.int64 and tensor.is_contiguous(), (name, tensor.dtype)
    assert meta.positions.shape == (num_tokens,), meta.positions.shape
    out = torch.empty(num_tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = heads // kv_heads
    block_m = min(64, max(16, next_power_of_2(meta.max_q * group)))
    grid = (meta.num_reqs, kv_heads, -(-meta.max_q * group // block_m))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        meta.positions, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), meta.block_tables.shape[1], block_size, kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        IEEE_DOT=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


@lazy_jit
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    v_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim] contiguous
    out_ptr,  # [num_tokens, heads, head_dim]
    positions_ptr,  # [num_tokens] int64
    cu_q_ptr,  # [num_reqs + 1] int64
    seq_lens_ptr,  # [num_reqs] int64
    block_tables_ptr,  # [num_reqs, max_blocks] int64, -1 padding
    scale_log2,  # softmax scale · log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    max_blocks,
    block_size,
    kv_heads,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # float32 inputs: exact products, not TF32
):
    r = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + r)
    q_len = tl.load(cu_q_ptr + r + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # row = (token t, group member g)
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = t < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_offs = (q_start + t)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(positions_ptr + q_start + t, mask=row_ok, other=-1)
    # Keys at positions <= the tile's last query position and < seq_len (the reference's mask).
    kv_end = tl.minimum(tl.load(seq_lens_ptr + r), tl.max(q_pos, axis=0) + 1)

    # A finite floor instead of -inf keeps fully masked (padding) rows free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        page = n // block_size
        block = tl.load(
            block_tables_ptr + r * stride_table + page, mask=n_ok & (page < max_blocks), other=0
        )
        slot = tl.maximum(block, 0) * block_size + n % block_size
        kv_offs = (slot * kv_heads + kv_head)[:, None] * HEAD_DIM + d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2  # [BLOCK_M, BLOCK_N]
        allowed = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + t)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    o_mask = row_ok[:, None] & d_ok[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
