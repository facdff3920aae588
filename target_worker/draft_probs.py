"""q sent by reference: rank 0 fetches the draft distributions the draft actors left in Ray.

A sampled plan's q ([requests, γ, vocab] float64) is the bulk of a step's traffic: 3.5 MiB at 16
requests with the demo's 4k-token vocabulary, 0.5 GB at 64 requests with a 150k one. Only the
target's rank 0 reads it, to decide acceptance. So each draft actor returns its q as a Ray
object of its own (owned by the coordinator, stored on the actor's node), the coordinator puts
the references in the plan (`RemoteDraftProbs`) without fetching them, and rank 0 fetches them
here: q crosses once, from the draft actor's node to rank 0's, instead of through the
coordinator's process and out again.

A part that cannot be fetched (its node died with the object) costs its rows their drafts, not
the step: rank 0 judges those rows as if ℓ_r = 0 (`without_drafts`: A_r = 0, y ~ p_0, the
target's own next-token distribution, whatever the drafts were). The forward has run with the
drafts on every rank, so nothing else changes; the rejected KV entries go in the coordinator's
rollback as any rejection's do. Invariant 5: a draft-side failure changes speed, never output.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from dspark.faults import first_line
from dspark.messages import RemoteDraftProbs, VerifyPlan

logger = logging.getLogger(__name__)

# A part is ready when the coordinator plans (the same Ray task returned the drafts), so a
# fetch waits only for the bytes; one that takes longer has lost its node.
FETCH_TIMEOUT_S = 30.0


def fetch_draft_probs(
    remote: RemoteDraftProbs,
    draft_token_ids: torch.Tensor,  # [num_reqs, width] int64, the plan's drafts, -1 past ℓ_r
    vocab: int,
    timeout: float = FETCH_TIMEOUT_S,
) -> tuple[torch.Tensor, frozenset[int]]:
    """The plan's q, [num_reqs, width, vocab] float64, and the rows whose part was lost.

    Rows in no part are one-hot at their drafts (deterministic drafts); a part's q is cut to the
    plan's width (its rows never plan more than they drafted).
    """
    import ray

    num_reqs, width = draft_token_ids.shape
    q = torch.zeros(num_reqs, width, vocab, dtype=torch.float64)
    valid = draft_token_ids >= 0
    q[valid, draft_token_ids[valid]] = 1.0
    lost: set[int] = set()
    for rows, ref in zip(remote.rows, remote.refs, strict=True):
        try:
            part = ray.get(ref, timeout=timeout)  # [len(rows), part_width, vocab]
        except (ray.exceptions.ObjectLostError, ray.exceptions.GetTimeoutError) as e:
            logger.warning("q of %d rows could not be fetched (%s: %s); they are judged without "
                           "their drafts", len(rows), type(e).__name__, first_line(e))
            lost.update(rows)
            continue
        w = min(width, part.shape[1])
        q[list(rows), :w] = part[:, :w]
    return q, frozenset(lost)


def without_drafts(
    plan: VerifyPlan,
    logits: torch.Tensor,  # [Σ (ℓ_r + 1), vocab] the verify pass's rows, request by request
    rows: frozenset[int],
) -> tuple[VerifyPlan, torch.Tensor]:
    """The plan and logits as if `rows` had planned no drafts: only their p_0 row is kept (their
    q, past ℓ_r = 0 now, is never read)."""
    keep: list[int] = []
    start = 0
    for i, n in enumerate(plan.num_draft):
        keep.extend(range(start, start + (1 if i in rows else n + 1)))
        start += n + 1
    token_ids = plan.draft_token_ids.clone()
    token_ids[list(rows)] = -1
    plan = replace(
        plan,
        num_draft=tuple(0 if i in rows else n for i, n in enumerate(plan.num_draft)),
        draft_token_ids=token_ids,
    )
    return plan, logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
