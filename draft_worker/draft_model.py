"""Draft-model proposer: a small independent LM drafting autoregressively.

It has its own paged KV cache. Per request it knows the committed tokens (they arrive as deltas
in each query) and how many of them are cached. Drafting γ tokens feeds the uncached committed
tokens (the anchor last) and then x_1..x_{γ-1}, one forward per position, batched over requests.
After verification `commit(A)` keeps the cached drafts that were accepted and drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.kernels.sampling import sample_from_probs, warp_probs
from dspark.messages import DraftQuery, Drafts, NewRequest
from dspark.models.checkpoint import load_model
from dspark.models.kv_cache import PagedKVCache
from dspark.sampling_params import SamplingParams

# Drafts use a generator seeded apart from the target's, so the two streams never coincide.
_DRAFT_SEED_OFFSET = 0x5EED


@dataclass
class _DraftState:
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # committed tokens known to the drafter
    committed_cached: int = 0  # committed tokens in the KV cache after the last proposal's catch-up
    drafts_cached: int = 0  # drafts of the last proposal in the KV cache (γ - 1)


class DraftModelProposer:
    name = "draft-model"
    sequential_drafts = True  # one forward per drafted position: cost grows with ℓ
    has_confidence_head = False

    def __init__(
        self,
        path: str | Path,
        num_blocks: int = 2048,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        self.path = Path(path)
        self.model = load_model(path, dtype=dtype, device=device)
        cfg = self.model.config
        self.device = device
        self.vocab_size = cfg.vocab_size
        self.max_model_len = cfg.max_position_embeddings
        self.cache = PagedKVCache(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
            num_blocks=num_blocks, block_size=block_size, dtype=dtype, device=device,
        )
        self._states: dict[str, _DraftState] = {}

    def add_request(self, new: NewRequest) -> None:
        gen = torch.Generator().manual_seed((new.seed + _DRAFT_SEED_OFFSET) % 2**63)
        self._states[new.req_id] = _DraftState(params=new.params, generator=gen)

    @torch.inference_mode()
    def propose(self, queries: list[DraftQuery]) -> Drafts:
        for q in queries:
            self._states[q.req_id].tokens.extend(q.new_token_ids)
        active = [q for q in queries if q.num_drafts > 0]
        gamma = max((q.num_drafts for q in active), default=0)
        n = len(queries)
        row = {q.req_id: i for i, q in enumerate(queries)}
        ids = torch.full((n, gamma), -1, dtype=torch.long)
        greedy = all(self._states[q.req_id].params.greedy for q in active)
        probs = None if greedy else torch.zeros(n, gamma, self.vocab_size, dtype=torch.float64)
        # Position 1 feeds the uncached committed tokens; position j > 1 feeds x_{j-1}.
        inputs = {q.req_id: self._uncached(q.req_id) for q in active}
        for j in range(gamma):
            step = [q for q in active if q.num_drafts > j]
            logits = self._forward(step, inputs)
            if probs is None:  # all greedy: q is one-hot at the argmax, nothing to sample
                tokens, q_rows = logits.argmax(dim=-1), [None] * len(step)
            else:
                q_rows = self._warp([q.req_id for q in step], logits)
                u = torch.stack([
                    torch.rand((), dtype=torch.float64, generator=self._states[q.req_id].generator)
                    for q in step
                ])
                tokens = sample_from_probs(q_rows, u)
            for q, t, q_row in zip(step, tokens.tolist(), q_rows, strict=True):
                ids[row[q.req_id], j] = t
                if probs is not None:
                    probs[row[q.req_id], j] = q_row
                inputs[q.req_id] = [t]
        for q in active:
            # The last draft was sampled but never fed: γ - 1 drafts sit in the cache.
            self._states[q.req_id].drafts_cached = q.num_drafts - 1
        return Drafts(
            req_ids=tuple(q.req_id for q in queries),
            token_ids=ids,
            num_drafts=torch.tensor([q.num_drafts for q in queries], dtype=torch.long),
            probs=probs,
            confidences=None,
        )

    def _uncached(self, req_id: str) -> list[int]:
        """Committed tokens not yet in the cache; after feeding them all committed ones are."""
        state = self._states[req_id]
        state.committed_cached = len(state.tokens)
        return state.tokens[self.cache.length(req_id) :]

    def _forward(self, step: list[DraftQuery], inputs: dict[str, list[int]]) -> torch.Tensor:
        req_ids = [q.req_id for q in step]
        starts = [self.cache.length(r) for r in req_ids]
        q_lens = [len(inputs[r]) for r in req_ids]
        for r, s, l in zip(req_ids, starts, q_lens, strict=True):
            self.cache.reserve(r, s + l)
        meta = self.cache.metadata(req_ids, starts, q_lens)
        flat = torch.tensor([t for r in req_ids for t in inputs[r]], device=self.device)
        last = torch.tensor(q_lens).cumsum(0) - 1
        return self.model.forward_paged(flat, meta, self.cache, last.to(self.device)).logits

    def _warp(self, req_ids: list[str], logits: torch.Tensor) -> torch.Tensor:
        params = [self._states[r].params for r in req_ids]
        return warp_probs(
            logits.cpu(),
            torch.tensor([p.temperature for p in params], dtype=torch.float64),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float64),
        )

    def commit(self, req_id: str, num_accepted: int) -> None:
        state = self._states[req_id]
        if req_id in self.cache:
            keep = state.committed_cached + min(num_accepted, state.drafts_cached)
            self.cache.truncate(req_id, min(keep, self.cache.length(req_id)))
        state.drafts_cached = 0
        state.committed_cached = self.cache.length(req_id)

    def release(self, req_id: str) -> None:
        self.cache.release(req_id)
        self._states.pop(req_id, None)

    def usage(self) -> dict[str, object]:
        """Requests holding state here and KV blocks in use (leak checks read this)."""
        held = set(self._states) | set(self.cache.request_ids())
        return {"requests": sorted(held), "used_blocks": self.cache.num_used_blocks}
