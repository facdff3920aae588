"""The target model runner: paged KV cache, one varlen verify forward, acceptance sampling.

Verbs (the coordinator's only way in): `add_request`, `verify`, `rollback`, `release`.
The runner keeps, per request, only its KV length, its sampling parameters and its random
generator; committed tokens live in the coordinator, which sends the uncached ones each step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dspark.faults import WorkersUnavailable
from dspark.kernels.acceptance import AcceptanceOutput, accept, accept_greedy
from dspark.kernels.sampling import warp_probs
from dspark.messages import NewRequest, RemoteDraftProbs, VerifyPlan, VerifyResult
from dspark.models.checkpoint import load_model
from dspark.models.kv_cache import PagedKVCache
from dspark.sampling_params import SamplingParams
from dspark.target_worker.draft_probs import without_drafts


class TargetRunner:
    """Runs the target model for verification. Acceptance is decided here (rank 0's job)."""

    def __init__(
        self,
        path: str | Path,
        num_blocks: int = 2048,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        hidden_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = load_model(path, dtype=dtype, device=device)
        self.hidden_layers = hidden_layers  # decoder layers whose outputs a drafter consumes
        self.config = self.model.config
        self.device = device
        self.cache = PagedKVCache(
            self.config.num_hidden_layers,
            self.config.num_key_value_heads,
            self.config.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
        )
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator] = {}

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def add_request(self, new: NewRequest) -> None:
        self._params[new.req_id] = new.params
        self._generators[new.req_id] = torch.Generator().manual_seed(new.seed)

    @torch.inference_mode()
    def verify(self, plan: VerifyPlan, unjudged: frozenset[int] = frozenset()) -> VerifyResult:
        """Run one varlen forward over every request's inputs and decide acceptance.

        `unjudged`: rows whose drafts go through the forward (every rank runs the same pass)
        but are not judged, as their q was lost: they accept none and sample y from p_0.
        """
        assert not isinstance(plan.draft_probs, RemoteDraftProbs), "fetch q first (rank 0)"
        req_ids = list(plan.req_ids)
        q_lens = [len(ids) for ids in plan.input_ids]
        for r, start, n in zip(req_ids, plan.starts, q_lens, strict=True):
            assert self.cache.length(r) == start, (r, self.cache.length(r), start)
            self.cache.reserve(r, start + n)
        meta = self.cache.metadata(req_ids, list(plan.starts), q_lens)
        flat_ids = torch.tensor([t for ids in plan.input_ids for t in ids], device=self.device)
        # Rows that need logits: the anchor and each admitted draft (ℓ_r + 1 per request).
        ends = torch.tensor(q_lens).cumsum(0)
        rows = [
            torch.arange(e - l - 1, e) for e, l in zip(ends.tolist(), plan.num_draft, strict=True)
        ]
        out = self.model.forward_paged(
            flat_ids, meta, self.cache, torch.cat(rows).to(self.device), self.hidden_layers
        )
        unjudged = frozenset(i for i in unjudged if plan.num_draft[i])
        if unjudged:
            judged, logits = without_drafts(plan, out.logits, unjudged)
            result = replace(self._accept(judged, logits), unjudged=tuple(sorted(unjudged)))
        else:
            result = self._accept(plan, out.logits)
        if out.hidden is None:
            return result
        # Keep the rows of positions cached for good: uncached committed tokens + accepted drafts.
        starts = (ends - torch.tensor(q_lens)).tolist()
        keep = [
            out.hidden[s : s + n - l + a].cpu()
            for s, n, l, a in zip(starts, q_lens, plan.num_draft, result.num_accepted, strict=True)
        ]
        return replace(result, hidden=tuple(keep))

    def _accept(self, plan: VerifyPlan, logits: torch.Tensor) -> VerifyResult:
        num_rows = [l + 1 for l in plan.num_draft]
        params = [self._params[r] for r in plan.req_ids]
        rep = torch.tensor(num_rows)
        cu = torch.zeros(len(num_rows) + 1, dtype=torch.long)
        cu[1:] = rep.cumsum(0)
        if all(p.temperature == 0 for p in params):
            # A greedy batch is decided by its argmaxes (`accept_greedy`): at 64 in flight,
            # fixed k = 7, judging one-hot rows took 7.9 ms a step, the argmaxes 1.6 ms.
            out = accept_greedy(logits.argmax(dim=-1).cpu(), cu, plan.draft_token_ids)
            return self._result(plan, out)
        temperature = torch.tensor(
            [p.temperature for p in params], dtype=torch.float64
        ).repeat_interleave(rep)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long).repeat_interleave(rep)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64).repeat_interleave(rep)
        target_probs = warp_probs(logits.cpu(), temperature, top_k, top_p)
        max_draft = plan.draft_token_ids.shape[1]
        u_accept = torch.zeros(len(params), max_draft, dtype=torch.float64)
        u_sample = torch.zeros(len(params), dtype=torch.float64)
        for i, (r, l) in enumerate(zip(plan.req_ids, plan.num_draft, strict=True)):
            # ℓ_r + 1 float64 uniforms from the request's own generator: the same request draws
            # the same numbers whatever else shares the batch.
            u = torch.rand(l + 1, dtype=torch.float64, generator=self._generators[r])
            u_accept[i, :l] = u[:l]
            u_sample[i] = u[l]
        out = accept(target_probs, cu, plan.draft_token_ids, plan.draft_probs, u_accept, u_sample)
        return self._result(plan, out)

    @staticmethod
    def _result(plan: VerifyPlan, out: AcceptanceOutput) -> VerifyResult:
        accepted = out.num_accepted.tolist()  # the step's one sync point
        tokens = out.output_tokens.tolist()
        return VerifyResult(
            req_ids=plan.req_ids,
            num_accepted=tuple(accepted),
            output_tokens=tuple(tuple(t[: a + 1]) for t, a in zip(tokens, accepted, strict=True)),
        )

    def rollback(self, lengths: dict[str, int]) -> None:
        """Keep only the first `lengths[r]` KV entries of each request (the committed ones)."""
        for r, n in lengths.items():
            self.cache.truncate(r, n)

    def release(self, req_id: str) -> None:
        """Forget a finished or cancelled request and free its blocks."""
        self.cache.release(req_id)
        self._params.pop(req_id, None)
        self._generators.pop(req_id, None)

    def recover(self) -> None:
        """An in-process runner never loses a worker (`verify` does not raise WorkerLost)."""
        raise WorkersUnavailable("the in-process target runner cannot be rebuilt")

    def usage(self) -> dict[str, object]:
        """Requests holding state here and KV blocks in use (leak checks read this)."""
        held = set(self._params) | set(self._generators) | set(self.cache.request_ids())
        return {"requests": sorted(held), "used_blocks": self.cache.num_used_blocks}
