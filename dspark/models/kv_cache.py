"""Paged KV cache: fixed-size blocks, a free list, and a block table per request.

The cache stores, per request, the keys/values of its first `length` positions. Verification
writes past the committed length; rollback is `truncate`, which moves the length back and frees
whole blocks beyond it. Entries past `length` are never visible: attention reads `seq_lens`.
"""

from __future__ import annotations

import torch

from dspark.kernels.paged_attention import AttentionMetadata


class CacheFullError(RuntimeError):
    """No free blocks left for the requested length."""


class PagedKVCache:
    """Keys and values for every layer:
    `[num_layers, num_blocks, block_size, kv_heads, head_dim]`."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}

    # --- accounting ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, req_id: str, new_length: int) -> int:
        have = len(self._tables.get(req_id, ()))
        return max(0, -(-new_length // self.block_size) - have)

    def length(self, req_id: str) -> int:
        return self._lengths.get(req_id, 0)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._tables

    def request_ids(self) -> list[str]:
        return list(self._tables)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    # --- verbs --------------------------------------------------------------------------
    def reserve(self, req_id: str, new_length: int) -> None:
        """Make room for positions up to `new_length`; the length becomes
        max(length, new_length)."""
        need = self.blocks_needed(req_id, new_length)
        if need > len(self._free):
            raise CacheFullError(f"request {req_id} needs {need} blocks, {len(self._free)} free")
        table = self._tables.setdefault(req_id, [])
        for _ in range(need):
            table.append(self._free.pop())
        self._lengths[req_id] = max(new_length, self._lengths.get(req_id, 0))

    def truncate(self, req_id: str, length: int) -> None:
        """Roll back to the first `length` positions; whole blocks past them return to the pool."""
        assert 0 <= length <= self._lengths.get(req_id, 0), (req_id, length)
        table = self._tables[req_id]
        keep = -(-length // self.block_size)
        while len(table) > keep:
            self._free.append(table.pop())
        self._lengths[req_id] = length

    def release(self, req_id: str) -> None:
        """Free every block of `req_id` (a no-op for an unknown id)."""
        for block in reversed(self._tables.pop(req_id, [])):
            self._free.append(block)
        self._lengths.pop(req_id, None)

    # --- views --------------------------------------------------------------------------
    def slots(self, req_id: str, start: int, end: int) -> torch.Tensor:  # [end - start]
        table = torch.tensor(self._tables[req_id], dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def block_table(self, req_ids: list[str]) -> torch.Tensor:  # [num_reqs, max_blocks], -1 padded
        width = max((len(self._tables[r]) for r in req_ids), default=0)
        out = torch.full((len(req_ids), max(width, 1)), -1, dtype=torch.long)
        for i, r in enumerate(req_ids):
            blocks = self._tables[r]
            out[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        return out.to(self.k.device)

    def metadata(
        self, req_ids: list[str], starts: list[int], q_lens: list[int]
    ) -> AttentionMetadata:
        """Layout of a varlen batch: request i writes `q_lens[i]` tokens from position `starts[i]`.

        Call after `reserve(req_id, start + q_len)` for each request.
        """
        device = self.k.device
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens, strict=True)])
        slots = torch.cat(
            [self.slots(r, s, s + n) for r, s, n in zip(req_ids, starts, q_lens, strict=True)]
        )
        seq_lens = [s + n for s, n in zip(starts, q_lens, strict=True)]
        cu = torch.zeros(len(q_lens) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(q_lens).cumsum(0)
        return AttentionMetadata(
            positions=positions.to(device),
            cu_seqlens_q=cu.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_tables=self.block_table(req_ids),
            slot_mapping=slots.to(device),
            block_size=self.block_size,
            max_q=max(q_lens),
            max_ctx=max(seq_lens),
        )

    def read(self, req_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the visible positions: each
        `[num_layers, length, kv_heads, head_dim]`."""
        slots = self.slots(req_id, 0, self.length(req_id)).to(self.k.device)
        flat_k = self.k.view(self.k.shape[0], -1, *self.k.shape[3:])
        flat_v = self.v.view(self.v.shape[0], -1, *self.v.shape[3:])
        return flat_k[:, slots], flat_v[:, slots]
