"""DSpark proposer: a block of γ drafts per request in one drafter pass (DESIGN.md §5).

Draft state per request is the projected context only: for each draft layer, the keys/values of
one context row per committed target position (every committed token but the anchor), in a paged
cache. Rows come from verified target positions alone (the target runner's hidden states, relayed
by the engine as `DraftQuery.new_hidden`), so a rejected draft never enters them and `commit`
has nothing to roll back (DESIGN.md §4, invariant 2). Each `propose` appends the new rows, runs
the block [anchor, MASK×(d−1)] at positions P..P+d−1 over the context, d the round's depth (at
most γ), and keeps none of the block's keys/values. A request whose context is not complete yet
(its first step, before any target pass) gets no drafts.

Sampling: the Markov head's corrected logits are warped with the request's own temperature,
top-k and top-p (`warp_probs`, the warp the target's p gets) into q_k and sampled left to
right from the request's draft generator; greedy requests take the argmax (q one-hot, not
materialised). Confidences are the conditional c_k of the confidence head, STS-calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.draft_worker.dspark_checkpoint import load_drafter
from dspark.draft_worker.dspark_model import DSparkDrafter
from dspark.kernels.paged_attention import kv_write
from dspark.kernels.sampling import sample_from_probs, warp_probs
from dspark.messages import DraftQuery, Drafts, NewRequest
from dspark.models.kv_cache import PagedKVCache
from dspark.sampling_params import SamplingParams

# Draft randomness comes from a generator seeded apart from the target's (and the draft model's).
_DSPARK_SEED_OFFSET = 0xD5A4C


@dataclass
class _DSparkState:
    params: SamplingParams
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # committed tokens known to the drafter


class DSparkProposer:
    name = "dspark"
    sequential_drafts = False  # one block pass per round: a further position adds a block slot

    def __init__(
        self,
        drafter_dir: str | Path,
        target_dir: str | Path | None,
        num_blocks: int = 2048,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        self.path = Path(drafter_dir)
        self.model: DSparkDrafter = load_drafter(drafter_dir, target_dir, dtype, device)
        cfg = self.model.config
        self.has_confidence_head = cfg.enable_confidence_head
        lc = cfg.layers
        self.hidden_layers: tuple[int, ...] = (
            cfg.target_layer_ids
        )  # the engine asks the target for these
        self.vocab_size = lc.vocab_size
        self.gamma = cfg.block_size
        self.device, self.dtype = device, dtype
        self.cache = PagedKVCache(
            lc.num_hidden_layers,
            lc.num_key_value_heads,
            lc.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
        )
        self._states: dict[str, _DSparkState] = {}

    def add_request(self, new: NewRequest) -> None:
        gen = torch.Generator().manual_seed((new.seed + _DSPARK_SEED_OFFSET) % 2**63)
        self._states[new.req_id] = _DSparkState(params=new.params, generator=gen)

    def context_length(self, req_id: str) -> int:
        """Context rows held for `req_id` (the committed target positions seen so far)."""
        return self.cache.length(req_id)

    @torch.inference_mode()
    def propose(self, queries: list[DraftQuery]) -> Drafts:
        self._ingest(queries)
        counts = [min(q.num_drafts, self.gamma) if self._ready(q.req_id) else 0 for q in queries]
        n, width = len(queries), max(counts, default=0)
        ids = torch.full((n, width), -1, dtype=torch.long)
        conf = torch.zeros(n, width, dtype=torch.float64)
        rows = [i for i, c in enumerate(counts) if c > 0]
        greedy = all(self._states[queries[i].req_id].params.greedy for i in rows)
        probs = None if greedy else torch.zeros(n, width, self.vocab_size, dtype=torch.float64)
        if rows:
            req_ids = [queries[i].req_id for i in rows]
            tokens, q_probs, c = self._draft(req_ids, [counts[i] for i in rows], greedy)
            if len(rows) == n:  # every request drafts (the common case): no scatter
                ids, conf, probs = tokens, c.to(torch.float64), q_probs
            else:
                index = torch.tensor(rows)
                ids[index] = tokens
                conf[index] = c.to(torch.float64)
                if probs is not None:
                    probs[index] = q_probs
        return Drafts(
            req_ids=tuple(q.req_id for q in queries),
            token_ids=ids,
            num_drafts=torch.tensor(counts, dtype=torch.long),
            probs=probs,
            confidences=conf if self.model.confidence_head is not None else None,
        )

    def _ready(self, req_id: str) -> bool:
        # Drafting needs the context of every committed position before the anchor.
        n = self.cache.length(req_id)
        return 0 < n == len(self._states[req_id].tokens) - 1

    def _ingest(self, queries: list[DraftQuery]) -> None:
        """Append new committed tokens and project the new target hidden rows into the cache."""
        hidden, positions, slots = [], [], []
        for q in queries:
            state = self._states[q.req_id]
            state.tokens.extend(q.new_token_ids)
            if q.new_hidden is None or q.new_hidden.shape[0] == 0:
                continue
            start, m = self.cache.length(q.req_id), q.new_hidden.shape[0]
            assert start + m <= len(state.tokens) - 1, (q.req_id, start, m, len(state.tokens))
            self.cache.reserve(q.req_id, start + m)
            hidden.append(q.new_hidden)
            positions.append(torch.arange(start, start + m))
            slots.append(self.cache.slots(q.req_id, start, start + m))
        if not hidden:
            return
        rows = self.model.context_rows(torch.cat(hidden).to(self.device, self.dtype))
        kv = self.model.context_kv(rows, torch.cat(positions).to(self.device))
        slot_mapping = torch.cat(slots).to(self.device)
        for i, (k, v) in enumerate(kv):
            kv_write(k, v, self.cache.k[i], self.cache.v[i], slot_mapping)

    def _gather_context(
        self, req_ids: list[str], width: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Per layer keys, values [R, kv_heads, C + width, hd]: each request's context in the
        first C rows (padded to the longest), the last `width` left for the block
        (`DSparkDrafter.run_blocks`); and the context lengths [R]. One `index_select` a tensor
        straight into that layout: half the time of gathering [R, C, kv_heads, hd] rows by
        indexing, and no copy to join the block after."""
        lens = torch.tensor([self.cache.length(r) for r in req_ids])
        bs, heads, hd = self.cache.block_size, self.cache.k.shape[3], self.cache.k.shape[4]
        pos = torch.arange(int(lens.max()))
        table = self.cache.block_table(req_ids).cpu()
        slots = table[:, pos // bs].clamp(min=0) * bs + pos % bs  # [R, C]
        # The block's rows read slot 0 until run_blocks writes them.
        slots = torch.cat([slots, slots.new_zeros(len(req_ids), width)], dim=1)  # [R, C + width]
        index = (slots[:, None, :] * heads + torch.arange(heads)[None, :, None]).flatten()
        index = index.to(self.device)  # rows of hd values, in [R, kv_heads, C + width] order
        kv = []
        for i in range(self.cache.k.shape[0]):
            k = self.cache.k[i].view(-1, hd).index_select(0, index)
            v = self.cache.v[i].view(-1, hd).index_select(0, index)
            kv.append((k.view(len(req_ids), heads, -1, hd), v.view(len(req_ids), heads, -1, hd)))
        return kv, lens

    def _draft(
        self, req_ids: list[str], counts: list[int], greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Tokens [R, width] (-1 past each count), q [R, width, vocab] or None, c [R, width].

        Request r's block is cut to its count d_r: [anchor, MASK×(d_r−1)] at positions
        P..P+d_r−1 (batched `width` = max(counts) wide, slots past d_r masked as keys). A
        round's depths are decided before drafting (DESIGN.md §3), so the cut never depends
        on the drafts, and q and c are those of the block that ran: any proposal is verified
        losslessly. On the demo drafter the cut costs ~2% of τ at depth 1 and nothing
        measurable at depth 3, and saves the backbone's unused slots (a depth-1 round at 16
        in flight took 13.7 ms against 18.9, fixed k = 1, T = 1).
        """
        num, width = len(req_ids), max(counts)
        ctx_kv, lens = self._gather_context(req_ids, width)
        ctx = int(lens.max())
        ctx_ok = torch.arange(ctx)[None, :] < lens[:, None]  # [R, C]
        # Each request's block is its own depth: slots past its count are keys to none, so its
        # drafts do not depend on what the rest of the batch drafts (seeded runs repeat).
        slot_ok = torch.arange(width)[None, :] < torch.tensor(counts)[:, None]  # [R, width]
        mask = torch.cat([ctx_ok, slot_ok], dim=-1)[:, None, :].expand(num, width, ctx + width)
        anchors = torch.tensor([self._states[r].tokens[-1] for r in req_ids])
        positions = lens[:, None] + torch.arange(width)  # block slot k at anchor position + k
        h = self.model.run_blocks(
            self.model.block_inputs(anchors, width).to(self.device),
            positions.to(self.device),
            ctx_kv,
            mask[:, None].to(self.device),
        )  # [R, width, d]
        # h is contiguous (the block is no wider than drafted), so the LM head, the round's
        # largest matmul, runs as one 2-D matmul: on a strided slice of a γ-wide block it ran
        # as a batched matmul over a copy of the weight per request (3x slower at 16 in flight).
        base = self.model.base_logits(h)  # [R, width, vocab] U_k
        tokens, probs = self._sample_markov(req_ids, counts, base, anchors, greedy)
        prev = torch.cat([anchors[:, None], tokens[:, : width - 1]], dim=1).clamp(min=0)
        z = self.model.confidence_logits(h, prev.to(self.device))
        conf = torch.zeros(num, width) if z is None else self.model.calibrated(z).cpu()
        return tokens, probs, conf * slot_ok

    def _sample_markov(
        self,
        req_ids: list[str],
        counts: list[int],
        base: torch.Tensor,  # [R, width, vocab] U_k
        anchors: torch.Tensor,  # [R]
        greedy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Left to right: logits_k = U_k + W2(W1[x_{k−1}]), x_0 the anchor; keep each q_k."""
        num, width = len(req_ids), max(counts)
        tokens = torch.full((num, width), -1, dtype=torch.long)
        probs = None if greedy else torch.zeros(num, width, self.vocab_size, dtype=torch.float64)
        # Each request's uniforms in one draw from its own generator: the same numbers, in the
        # same order, as one draw per position.
        u = None if greedy else self._uniforms(req_ids, counts, width)  # [R, width]
        warp = None if greedy else self._warp_params(req_ids)
        live = torch.tensor(counts)
        prev = anchors.clone()
        for j in range(width):
            # Rows still drafting at position j; all of them (a slice, no gather) when every
            # count reaches j.
            rows = slice(None) if min(counts) > j else torch.nonzero(live > j).flatten()
            logits = base[rows, j] + self.model.markov_bias(prev[rows].to(self.device))
            if greedy:
                step = logits.argmax(dim=-1).cpu()
            else:
                assert probs is not None and u is not None and warp is not None
                q = warp_probs(logits.float().cpu(), *(t[rows] for t in warp))
                step = sample_from_probs(q, u[rows, j])
                probs[rows, j] = q
            tokens[rows, j] = step
            prev[rows] = step
        return tokens, probs

    def _uniforms(self, req_ids: list[str], counts: list[int], width: int) -> torch.Tensor:
        u = torch.zeros(len(req_ids), width, dtype=torch.float64)  # [R, width]
        for i, (r, c) in enumerate(zip(req_ids, counts, strict=True)):
            u[i, :c] = torch.rand(c, dtype=torch.float64, generator=self._states[r].generator)
        return u

    def _warp_params(self, req_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p) per request, as `warp_probs` takes them: each [R]."""
        params = [self._states[r].params for r in req_ids]
        return (
            torch.tensor([p.temperature for p in params], dtype=torch.float64),
            torch.tensor([p.top_k for p in params], dtype=torch.long),
            torch.tensor([p.top_p for p in params], dtype=torch.float64),
        )

    def commit(self, req_id: str, num_accepted: int) -> None:
        # Nothing to roll back: the block's keys/values were never stored, and the context grows
        # only from verified positions (the next query brings the A + 1 new rows).
        assert req_id in self._states, req_id

    def release(self, req_id: str) -> None:
        self.cache.release(req_id)
        self._states.pop(req_id, None)

    def usage(self) -> dict[str, object]:
        """Requests holding state here and KV blocks in use (leak checks read this)."""
        held = set(self._states) | set(self.cache.request_ids())
        return {"requests": sorted(held), "used_blocks": self.cache.num_used_blocks}
