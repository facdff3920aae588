"""The typed messages of one speculative step (DESIGN.md §2).

Request -> Drafts -> VerifyPlan -> VerifyResult -> StepState -> commit.

- `Drafts` come back from the draft worker: per request up to γ proposed tokens, the draft
  distributions q that produced them, and (when the proposer has a head) confidences.
- `VerifyPlan` goes to the target worker: per request the uncached committed tokens (the last of
  them is the anchor) followed by the ℓ_r admitted drafts.
- `VerifyResult` comes back: A_r accepted drafts and the A_r + 1 output tokens (the accepted
  drafts, then the correction or bonus token y).
- `StepState` is what commit decided: planned ℓ, accepted A, committed tokens after EOS/stop/length
  cuts, and the rollback lengths of both caches, kept as separate fields.

All are frozen; workers receive new requests in full and running ones as deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequest:
    """What a worker needs to know about a request once, when it joins."""

    req_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # resolved seed: the request's own or one drawn by the coordinator


@dataclass(frozen=True)
class DraftQuery:
    """Ask for up to `num_drafts` drafts after `new_token_ids` (committed tokens the worker
    lacks)."""

    req_id: str
    new_token_ids: tuple[int, ...]
    num_drafts: int
    # Target hidden states (the layers the proposer asked for, concatenated) of the target
    # positions the proposer has not seen yet: every committed token but the anchor, in order.
    new_hidden: torch.Tensor | None = None  # [num_new_rows, num_layers * hidden]


@dataclass(frozen=True)
class RemoteDraftProbs:
    """q left in Ray's object store by the draft actors that made it, in parts; the target's
    rank 0 fetches and assembles it (`dspark.target_worker.draft_probs`).

    Part i covers the batch rows `rows[i]`: its object holds their q, [len(rows[i]), width_i,
    vocab] float64 (width_i: that actor's widest row). Rows with drafts in no part drafted
    deterministically (q one-hot at their tokens); rows without drafts need no q.
    """

    rows: tuple[tuple[int, ...], ...]
    refs: tuple[Any, ...]  # Ray ObjectRefs, one per part


@dataclass(frozen=True)
class Drafts:
    """Proposals for one step. Row i belongs to `req_ids[i]`."""

    req_ids: tuple[str, ...]
    token_ids: torch.Tensor  # [num_reqs, max_draft] int64, -1 padding past num_drafts
    num_drafts: torch.Tensor  # [num_reqs] int64, γ_r proposed
    # [num_reqs, max_draft, vocab] float64 warped q, or where it waits over Ray; None: one-hot
    probs: torch.Tensor | RemoteDraftProbs | None
    confidences: torch.Tensor | None  # [num_reqs, max_draft] conditional acceptance estimates

    @staticmethod
    def empty(req_ids: tuple[str, ...] = ()) -> Drafts:
        n = len(req_ids)
        return Drafts(
            req_ids=req_ids,
            token_ids=torch.full((n, 0), -1, dtype=torch.long),
            num_drafts=torch.zeros(n, dtype=torch.long),
            probs=None,
            confidences=None,
        )


@dataclass(frozen=True)
class VerifyPlan:
    """One varlen verify batch: request i feeds `input_ids[i]` from position `starts[i]`.

    `input_ids[i]` = uncached committed tokens (>= 1; the last is the anchor) + ℓ_i drafts.
    """

    req_ids: tuple[str, ...]
    starts: tuple[int, ...]  # target KV length L_r before the step
    input_ids: tuple[tuple[int, ...], ...]
    num_draft: tuple[int, ...]  # ℓ_r admitted drafts (0 allowed)
    draft_token_ids: torch.Tensor  # [num_reqs, max_draft] int64, -1 padding past ℓ_r
    # [num_reqs, max_draft, vocab] float64 q (or where it waits over Ray); None: one-hot
    draft_probs: torch.Tensor | RemoteDraftProbs | None
    budget: int  # K: total draft positions the policy allowed this step


@dataclass(frozen=True)
class VerifyResult:
    """Acceptance as decided by the target (rank 0 when tensor-parallel)."""

    req_ids: tuple[str, ...]
    num_accepted: tuple[int, ...]  # A_r
    output_tokens: tuple[tuple[int, ...], ...]  # A_r + 1 tokens: accepted drafts, then y
    # When asked for: hidden rows of the positions this pass cached for good (the uncached
    # committed tokens and the A_r accepted drafts), per request.
    hidden: tuple[torch.Tensor, ...] | None = None  # each [n_uncached + A_r, num_layers * hidden]
    # Rows whose drafts were not judged because their q could not be fetched (a draft node
    # lost): A_r = 0 and y ~ p_0, the target's own next-token distribution.
    unjudged: tuple[int, ...] = ()


@dataclass(frozen=True)
class RequestStep:
    """One request's part of a step, after commit."""

    req_id: str
    num_drafted: int  # γ_r proposed by the drafter
    num_planned: int  # ℓ_r admitted for verification
    num_accepted: int  # A_r accepted by the target
    committed: tuple[int, ...]  # tokens appended to the request (<= A_r + 1 after cuts)
    target_length: int  # target KV length after rollback (committed tokens minus the anchor)
    finish_reason: str | None  # "stop" | "length" | None while running


@dataclass(frozen=True)
class StepState:
    step: int
    budget: int
    requests: tuple[RequestStep, ...]
