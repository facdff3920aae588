"""Speculative acceptance over a varlen batch (Leviathan et al. 2023; Chen et al. 2023).

Request r verifies ℓ_r drafts x_1..x_ℓ (ℓ_r may be 0). The target returns ℓ_r + 1 warped
distributions p_0..p_ℓ, where p_j is the target's distribution of the token after input j (input
0 is the anchor, DESIGN.md §4); x_j was drawn from the warped draft distribution q_j.

Terms:
- accepted: x_j is accepted iff u_j < min(1, p_{j-1}(x_j) / q_j(x_j)), scanning j = 1..ℓ and
  stopping at the first rejection; A_r is the number accepted (0..ℓ_r).
- residual: after a rejection at j = A + 1, the final token y ~ norm(max(0, p_A - q_{A+1})).
  For a deterministic draft (q one-hot at x) this is p_A with the rejected token zeroed.
- bonus: if all ℓ drafts are accepted, y ~ p_ℓ.
Each request emits A + 1 tokens: x_1..x_A, y. The emitted tokens have exactly the target's
distribution whatever q is (tests/unit/test_acceptance.py checks this by χ²).

Greedy needs no branch: `warp_probs` makes a greedy row's p one-hot, so x_j is accepted iff it is
the target argmax, the residual keeps only the argmax, and y is the argmax.

`accept_ref` is the specification; `accept` is the dispatch (a Triton kernel slots in later).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.kernels.sampling import sample_from_probs


@dataclass(frozen=True)
class AcceptanceOutput:
    """What the acceptance step decided; commit applies it (STYLE.md: decide, commit, free)."""

    num_accepted: torch.Tensor  # [num_reqs] int64: A_r, accepted drafts (0..ℓ_r)
    output_tokens: torch.Tensor  # [num_reqs, max_draft + 1] int64: x_1..x_A then y, -1 after


def accept_ref(
    target_probs: torch.Tensor,  # [num_rows, vocab] float64 warped p; rows of r: cu[r]..cu[r+1]-1
    cu_num_rows: torch.Tensor,  # [num_reqs + 1] int64 prefix sums of ℓ_r + 1
    draft_token_ids: torch.Tensor,  # [num_reqs, max_draft] int64, -1 past ℓ_r
    draft_probs: torch.Tensor
    | None,  # [num_reqs, max_draft, vocab] float64 warped q; None: one-hot
    u_accept: torch.Tensor,  # [num_reqs, max_draft] float64 uniforms in [0, 1)
    u_sample: torch.Tensor,  # [num_reqs] float64 uniform for the final token y
) -> AcceptanceOutput:
    """Accept a prefix of each request's drafts and sample its final token (residual or bonus).

    `draft_probs=None` means every draft is deterministic (q_j one-hot at x_j, so q_j(x_j) = 1).
    If q_j(x_j) == 0 the draft cannot have been sampled from q_j; the ratio is then taken as 1
    when p_{j-1}(x_j) > 0 (accept) and 0 otherwise (reject), so p/q never produces NaN. Draft
    entries past ℓ_r are ignored. Requires ℓ_r <= max_draft (not checked: it would need a sync).

    >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64)
    >>> out = accept_ref(p, torch.tensor([0, 2]), torch.tensor([[1]]), None,
    ...                  torch.tensor([[0.5]], dtype=torch.float64),
    ...                  torch.tensor([0.5], dtype=torch.float64))
    >>> out.num_accepted, out.output_tokens
    (tensor([1]), tensor([[1, 2]]))
    """
    num_reqs, max_draft = draft_token_ids.shape
    assert target_probs.dtype == torch.float64, target_probs.dtype
    assert cu_num_rows.shape == (num_reqs + 1,), cu_num_rows.shape
    assert u_accept.shape == (num_reqs, max_draft) and u_sample.shape == (num_reqs,)
    assert draft_probs is None or draft_probs.shape == (num_reqs, max_draft, target_probs.shape[1])
    row_start = cu_num_rows[:-1]  # [num_reqs] row of p_0
    num_drafts = cu_num_rows[1:] - row_start - 1  # [num_reqs] ℓ_r
    tokens = draft_token_ids.clamp(min=0)  # [num_reqs, max_draft] padding read as token 0, masked

    accepted = _accept_mask(target_probs, row_start, num_drafts, tokens, draft_probs, u_accept)
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)  # stop at 1st reject

    final_probs = _final_distribution(
        target_probs, row_start, num_drafts, num_accepted, tokens, draft_probs
    )
    final_token = sample_from_probs(final_probs, u_sample)

    column = torch.arange(max_draft, device=tokens.device)
    output_tokens = torch.full(
        (num_reqs, max_draft + 1), -1, dtype=torch.int64, device=tokens.device
    )
    output_tokens[:, :max_draft] = torch.where(column < num_accepted[:, None], tokens, -1)
    output_tokens[torch.arange(num_reqs, device=tokens.device), num_accepted] = final_token
    return AcceptanceOutput(num_accepted=num_accepted, output_tokens=output_tokens)


def accept(
    target_probs: torch.Tensor,  # [num_rows, vocab] float64
    cu_num_rows: torch.Tensor,  # [num_reqs + 1] int64
    draft_token_ids: torch.Tensor,  # [num_reqs, max_draft] int64, -1 padding
    draft_probs: torch.Tensor | None,  # [num_reqs, max_draft, vocab] float64 or None
    u_accept: torch.Tensor,  # [num_reqs, max_draft] float64
    u_sample: torch.Tensor,  # [num_reqs] float64
) -> AcceptanceOutput:
    """The acceptance step the engine calls; same contract as `accept_ref`."""
    return accept_ref(target_probs, cu_num_rows, draft_token_ids, draft_probs, u_accept, u_sample)


def _accept_mask(
    target_probs: torch.Tensor,  # [num_rows, vocab] float64
    row_start: torch.Tensor,  # [num_reqs] int64 row of p_0
    num_drafts: torch.Tensor,  # [num_reqs] int64 ℓ_r
    tokens: torch.Tensor,  # [num_reqs, max_draft] int64 x_j, padding clamped to 0
    draft_probs: torch.Tensor | None,  # [num_reqs, max_draft, vocab] float64 or None
    u_accept: torch.Tensor,  # [num_reqs, max_draft] float64
) -> torch.Tensor:  # [num_reqs, max_draft] bool: u_j < min(1, p_{j-1}(x_j)/q_j(x_j)), j <= ℓ_r
    column = torch.arange(tokens.shape[1], device=tokens.device)
    valid = column[None, :] < num_drafts[:, None]
    rows = torch.where(valid, row_start[:, None] + column[None, :], 0)  # row of p_{j-1}
    p_x = target_probs[rows, tokens]
    if draft_probs is None:
        return valid & (u_accept < p_x.clamp(max=1.0))
    q_x = draft_probs.gather(2, tokens[:, :, None]).squeeze(2)
    # q_x == 0: the ratio is 1 if p_x > 0 else 0 (documented in accept_ref).
    ratio = torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, 1.0), (p_x > 0).to(p_x.dtype))
    return valid & (u_accept < ratio.clamp(max=1.0))


def _final_distribution(
    target_probs: torch.Tensor,  # [num_rows, vocab] float64
    row_start: torch.Tensor,  # [num_reqs] int64
    num_drafts: torch.Tensor,  # [num_reqs] int64 ℓ_r
    num_accepted: torch.Tensor,  # [num_reqs] int64 A_r
    tokens: torch.Tensor,  # [num_reqs, max_draft] int64
    draft_probs: torch.Tensor | None,  # [num_reqs, max_draft, vocab] float64 or None
) -> torch.Tensor:  # [num_reqs, vocab] float64, unnormalised distribution of y
    """Residual max(0, p_A - q_{A+1}) after a rejection, p_ℓ (bonus) when all were accepted."""
    p_a = target_probs[row_start + num_accepted]
    num_reqs, max_draft = tokens.shape
    if max_draft == 0:
        return p_a
    rejected = num_accepted < num_drafts
    req = torch.arange(num_reqs, device=tokens.device)
    next_draft = num_accepted.clamp(max=max_draft - 1)  # index of x_{A+1}, valid where rejected
    if draft_probs is None:
        q_next = torch.zeros_like(p_a)
        q_next[req, tokens[req, next_draft]] = 1.0
    else:
        q_next = draft_probs[req, next_draft]
    residual = (p_a - torch.where(rejected[:, None], q_next, 0.0)).clamp(min=0.0)
    # In exact arithmetic a rejection leaves positive residual mass; in float p_A can equal
    # q_{A+1}, and then y is drawn from p_A (the distribution the residual approximates).
    return torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_a)
