"""Varlen attention over a paged KV cache, and the KV write by slot mapping.

Each request r brings `q_len_r` query tokens at its own absolute positions; its keys are the
first `seq_len_r` entries of its paged cache (the new tokens already written). A query at
position P sees keys at positions <= P: causal within the block, full over the cached prefix.
Prefill chunks and verify blocks share one batch this way.

`paged_attention_ref` is the specification; `paged_attention` is the one dispatch the models call
(a Triton kernel slots in beside the reference on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F


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
        q_pos = torch.zeros(self.num_reqs, self.max_q, dtype=torch.long, device=self.positions.device)
        q_pos[self.token_req, self.token_local] = self.positions
        k_pos = torch.arange(self.max_ctx, device=self.positions.device)
        allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < self.seq_lens[:, None, None]
        )
        return allowed[:, None]


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


def kv_write(k, v, k_cache, v_cache, slot_mapping) -> None:  # noqa: ANN001 - same as kv_write_ref
    """Dispatch: the torch reference (a Triton kernel is added for CUDA by the kernels issue)."""
    kv_write_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:  # noqa: ANN001
    """Dispatch: the torch reference (a Triton kernel is added for CUDA by the kernels issue)."""
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)
