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

Greedy: `warp_probs` makes a greedy row's p one-hot, so x_j is accepted iff it is the target
argmax, the residual keeps only the argmax, and y is the argmax, whatever q is. `accept_greedy`
decides a batch of greedy requests from each row's argmax alone, with the same outputs: no
[rows, vocab] distribution to build, no uniforms to draw (on a GPU only the argmaxes leave it).

`accept_ref` is the specification; `accept_triton` launches `_accept_kernel` and
`_accept_final_kernel`; `accept` is the dispatch (`dspark.kernels.dispatch`). The kernels decide
acceptance with the reference's float64 comparisons and sample y by the same inverse CDF of the
same `u_sample`, so they return the reference's tokens; the one difference is the order of the
float64 sums behind the CDF, which can move y only when u_sample · total falls within rounding
error of a CDF step (probability ~1e-15 per draw).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dspark.kernels.dispatch import lazy_jit, next_power_of_2, num_sms, use_triton
from dspark.kernels.sampling import sample_from_probs

if TYPE_CHECKING:  # bound on first launch by lazy_jit (dspark.kernels.dispatch)
    import triton.language as tl


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


def accept_greedy(
    target_argmax: torch.Tensor,  # [num_rows] int64 argmax of each row's logits (first on ties)
    cu_num_rows: torch.Tensor,  # [num_reqs + 1] int64 prefix sums of ℓ_r + 1
    draft_token_ids: torch.Tensor,  # [num_reqs, max_draft] int64, -1 past ℓ_r
) -> AcceptanceOutput:
    """`accept_ref`'s outputs for greedy requests (p one-hot at each row's argmax), from the
    argmaxes: A_r counts the leading drafts equal to the argmax of the row before them, and y
    is the argmax of row A_r.

    >>> out = accept_greedy(torch.tensor([5, 7, 2]), torch.tensor([0, 3]), torch.tensor([[5, 1]]))
    >>> out.num_accepted, out.output_tokens
    (tensor([1]), tensor([[ 5,  7, -1]]))
    """
    num_reqs, max_draft = draft_token_ids.shape
    assert cu_num_rows.shape == (num_reqs + 1,), cu_num_rows.shape
    row_start = cu_num_rows[:-1]  # [num_reqs] row of p_0
    num_drafts = cu_num_rows[1:] - row_start - 1  # [num_reqs] ℓ_r
    column = torch.arange(max_draft, device=draft_token_ids.device)
    valid = column[None, :] < num_drafts[:, None]
    rows = torch.where(valid, row_start[:, None] + column[None, :], 0)  # row of p_{j-1}
    matched = valid & (draft_token_ids == target_argmax[rows])
    num_accepted = torch.cumprod(matched.to(torch.int64), dim=1).sum(dim=1)  # stop at 1st miss
    output_tokens = torch.full(
        (num_reqs, max_draft + 1), -1, dtype=torch.int64, device=draft_token_ids.device
    )
    output_tokens[:, :max_draft] = torch.where(column < num_accepted[:, None], draft_token_ids, -1)
    output_tokens[torch.arange(num_reqs, device=draft_token_ids.device), num_accepted] = (
        target_argmax[row_start + num_accepted])
    return AcceptanceOutput(num_accepted=num_accepted, output_tokens=output_tokens)


def accept(
    target_probs: torch.Tensor,  # [num_rows, vocab] float64
    cu_num_rows: torch.Tensor,  # [num_reqs + 1] int64
    draft_token_ids: torch.Tensor,  # [num_reqs, max_draft] int64, -1 padding
    draft_probs: torch.Tensor | None,  # [num_reqs, max_draft, vocab] float64 or None
    u_accept: torch.Tensor,  # [num_reqs, max_draft] float64
    u_sample: torch.Tensor,  # [num_reqs] float64
) -> AcceptanceOutput:
    """The acceptance step the engine calls; same contract as `accept_ref`.

    The Triton path (CUDA, or forced by DSPARK_KERNELS=triton) returns the reference's outputs;
    only the order of float64 sums behind the final token's CDF differs (module docstring).
    """
    args = (target_probs, cu_num_rows, draft_token_ids, draft_probs, u_accept, u_sample)
    return accept_triton(*args) if use_triton(target_probs) else accept_ref(*args)


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


# ---------------------------------------------------------------------------------------------
# Triton


def accept_triton(
    target_probs: torch.Tensor,  # [num_rows, vocab] float64
    cu_num_rows: torch.Tensor,  # [num_reqs + 1] int64
    draft_token_ids: torch.Tensor,  # [num_reqs, max_draft] int64, -1 padding
    draft_probs: torch.Tensor | None,  # [num_reqs, max_draft, vocab] float64 or None
    u_accept: torch.Tensor,  # [num_reqs, max_draft] float64
    u_sample: torch.Tensor,  # [num_reqs] float64
    num_splits: int | None = None,
    block_v: int = 2048,
) -> AcceptanceOutput:
    """`accept_ref` in two launches, reading each final distribution from memory once.

    `_accept_kernel`, grid (request, vocabulary split): every program decides acceptance (the
    reference's rule, vectorised over j: A_r is the index of the first rejection; cheap, so each
    split repeats it), then streams its slice of the final distribution w (residual
    max(0, p_A - q_{A+1}), or p_ℓ for the bonus) and of p_A, writing one sum per chunk of
    `block_v` tokens. `_accept_final_kernel`, one program per request: inverse-CDF sampling as in
    `sample_from_probs`, in two levels: the prefix sums of the chunk sums locate the chunk holding
    u_sample · Σw, and only that chunk is read again and scanned. If Σw = 0 (p_A equal to q_{A+1}
    up to rounding) it samples p_A instead, as the reference does.

    Splitting the vocabulary (default: about four programs per SM) is what makes it fast: one
    program per request would stream 2.4 MB (p_A and q_{A+1}, 151,936 float64 each) through one
    SM. An exponential race (y = argmax w_i / E_i) would need one pass too, but it costs a
    Philox draw and a float64 log per token: compute-bound at these sizes.
    """
    num_reqs, max_draft = draft_token_ids.shape
    vocab = target_probs.shape[1]
    f64, i64 = torch.float64, torch.int64
    assert target_probs.dtype == f64 and target_probs.is_contiguous(), "p: contiguous float64"
    assert cu_num_rows.dtype == i64 and cu_num_rows.shape == (num_reqs + 1,), cu_num_rows.shape
    assert draft_token_ids.dtype == i64 and draft_token_ids.is_contiguous()
    assert u_accept.dtype == f64 and u_accept.shape == (num_reqs, max_draft)
    assert u_sample.dtype == f64 and u_sample.shape == (num_reqs,)
    assert u_accept.is_contiguous() and u_sample.is_contiguous() and cu_num_rows.is_contiguous()
    if draft_probs is not None:
        assert draft_probs.dtype == f64 and draft_probs.is_contiguous(), "q: contiguous float64"
        assert draft_probs.shape == (num_reqs, max_draft, vocab), draft_probs.shape
    assert block_v >= 16 and block_v & (block_v - 1) == 0, block_v
    device = target_probs.device
    num_accepted = torch.empty(num_reqs, dtype=i64, device=device)
    output_tokens = torch.empty(num_reqs, max_draft + 1, dtype=i64, device=device)
    if num_reqs == 0:
        return AcceptanceOutput(num_accepted=num_accepted, output_tokens=output_tokens)

    block_v = min(block_v, max(16, next_power_of_2(vocab)))
    num_chunks = -(-vocab // block_v)
    if num_splits is None:
        num_splits = -(-4 * num_sms(device) // num_reqs)
    chunks_per_split = -(-num_chunks // max(1, min(num_splits, num_chunks)))
    num_splits = -(-num_chunks // chunks_per_split)
    chunk_sums = torch.empty(2, num_reqs, num_chunks, dtype=f64, device=device)  # Σw, Σp_A
    _accept_kernel[(num_reqs, num_splits)](
        target_probs, cu_num_rows, draft_token_ids,
        target_probs if draft_probs is None else draft_probs,
        u_accept, num_accepted, output_tokens, chunk_sums,
        vocab, max_draft, num_chunks, chunks_per_split, num_reqs * num_chunks,
        HAS_Q=draft_probs is not None,
        DRAFT_BLOCK=next_power_of_2(max(max_draft, 1)),
        OUT_BLOCK=next_power_of_2(max_draft + 1),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )  # fmt: skip
    _accept_final_kernel[(num_reqs,)](
        target_probs, cu_num_rows, draft_token_ids,
        target_probs if draft_probs is None else draft_probs,
        u_sample, num_accepted, output_tokens, chunk_sums,
        vocab, max_draft, num_chunks, num_reqs * num_chunks,
        HAS_Q=draft_probs is not None,
        CHUNKS_BLOCK=next_power_of_2(num_chunks),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )  # fmt: skip
    return AcceptanceOutput(num_accepted=num_accepted, output_tokens=output_tokens)


@lazy_jit
def _accept_kernel(
    p_ptr,  # [num_rows, vocab] float64
    cu_ptr,  # [num_reqs + 1] int64
    ids_ptr,  # [num_reqs, max_draft] int64
    q_ptr,  # [num_reqs, max_draft, vocab] float64 (p_ptr when HAS_Q is False: never read)
    u_acc_ptr,  # [num_reqs, max_draft] float64
    num_acc_ptr,  # [num_reqs] int64 out: A_r
    out_ptr,  # [num_reqs, max_draft + 1] int64 out: x_1..x_A then -1 (y is written later)
    sums_ptr,  # [2, num_reqs, num_chunks] float64 out: per chunk Σw, then Σp_A
    vocab,
    max_draft,
    num_chunks,
    chunks_per_split,
    p_sums_offset,  # num_reqs * num_chunks: where the Σp_A half of sums_ptr starts
    HAS_Q: tl.constexpr,
    DRAFT_BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row0 = tl.load(cu_ptr + r)  # row of p_0
    num_drafts = tl.minimum(tl.load(cu_ptr + r + 1) - row0 - 1, max_draft)  # ℓ_r

    # Acceptance: u_j < min(1, p_{j-1}(x_j) / q_j(x_j)), the reference's float64 rule.
    j = tl.arange(0, DRAFT_BLOCK)
    valid = j < num_drafts
    x = tl.load(ids_ptr + r * max_draft + j, mask=valid, other=0)
    p_x = tl.load(p_ptr + (row0 + j) * vocab + x, mask=valid, other=0.0)
    if HAS_Q:
        q_x = tl.load(q_ptr + (r * max_draft + j) * vocab + x, mask=valid, other=1.0)
        safe_q = tl.where(q_x > 0, q_x, 1.0)
        ratio = tl.where(q_x > 0, p_x / safe_q, tl.where(p_x > 0, 1.0, 0.0))
    else:
        ratio = p_x
    u = tl.load(u_acc_ptr + r * max_draft + j, mask=valid, other=1.0)
    accepted = valid & (u < tl.minimum(ratio, 1.0))
    num_accepted = tl.min(tl.where(accepted, DRAFT_BLOCK, j), axis=0)  # first rejection
    num_accepted = tl.minimum(num_accepted, num_drafts).to(tl.int64)  # A_r

    if split == 0:
        tl.store(num_acc_ptr + r, num_accepted)
        col = tl.arange(0, OUT_BLOCK)
        tokens = tl.load(ids_ptr + r * max_draft + col, mask=col < num_accepted, other=-1)
        tl.store(out_ptr + r * (max_draft + 1) + col, tokens, mask=col <= max_draft)

    # Chunk sums of w = max(0, p_A - q_{A+1}) after a rejection (w = p_ℓ for the bonus) and p_A.
    rejected = num_accepted < num_drafts
    p_row = p_ptr + (row0 + num_accepted) * vocab
    q_row = q_ptr + (r * max_draft + num_accepted) * vocab
    x_next = tl.load(ids_ptr + r * max_draft + num_accepted, mask=rejected, other=-1)
    q_end = tl.where(rejected, vocab, 0)  # q_{A+1} is read only after a rejection
    first = split * chunks_per_split
    for c in range(first, tl.minimum(first + chunks_per_split, num_chunks)):
        v = c * BLOCK_V + tl.arange(0, BLOCK_V)
        p = tl.load(p_row + v, mask=v < vocab, other=0.0)
        if HAS_Q:
            q = tl.load(q_row + v, mask=v < q_end, other=0.0)
        else:
            q = tl.where(v == x_next, 1.0, 0.0)  # one-hot at the rejected draft
        w = tl.maximum(p - q, 0.0)
        tl.store(sums_ptr + r * num_chunks + c, tl.sum(w, axis=0))
        tl.store(sums_ptr + p_sums_offset + r * num_chunks + c, tl.sum(p, axis=0))


@lazy_jit
def _accept_final_kernel(
    p_ptr,  # [num_rows, vocab] float64
    cu_ptr,  # [num_reqs + 1] int64
    ids_ptr,  # [num_reqs, max_draft] int64
    q_ptr,  # [num_reqs, max_draft, vocab] float64 (p_ptr when HAS_Q is False: never read)
    u_sample_ptr,  # [num_reqs] float64
    num_acc_ptr,  # [num_reqs] int64: A_r
    out_ptr,  # [num_reqs, max_draft + 1] int64: y is written at column A_r
    sums_ptr,  # [2, num_reqs, num_chunks] float64: per chunk Σw, then Σp_A
    vocab,
    max_draft,
    num_chunks,
    p_sums_offset,
    HAS_Q: tl.constexpr,
    CHUNKS_BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row0 = tl.load(cu_ptr + r)
    num_drafts = tl.minimum(tl.load(cu_ptr + r + 1) - row0 - 1, max_draft)
    num_accepted = tl.load(num_acc_ptr + r)
    rejected = num_accepted < num_drafts

    # Level 1: the chunk holding the threshold u · total, from prefix sums of the chunk sums.
    c = tl.arange(0, CHUNKS_BLOCK)
    in_row = c < num_chunks
    w_sums = tl.load(sums_ptr + r * num_chunks + c, mask=in_row, other=0.0)
    p_sums = tl.load(sums_ptr + p_sums_offset + r * num_chunks + c, mask=in_row, other=0.0)
    w_cdf = tl.cumsum(w_sums, axis=0)
    use_w = tl.max(w_cdf, axis=0) > 0  # else no residual mass: sample p_A (the reference's rule)
    sums = tl.where(use_w, w_sums, p_sums)
    cdf = tl.where(use_w, w_cdf, tl.cumsum(p_sums, axis=0))
    threshold = tl.load(u_sample_ptr + r) * tl.max(cdf, axis=0)
    chunk = tl.min(tl.where(in_row & (cdf > threshold), c, CHUNKS_BLOCK), axis=0)
    found = chunk < CHUNKS_BLOCK
    # Rounding can put the threshold at the end of the CDF: then the last positive token wins.
    chunk = tl.where(found, chunk, tl.max(tl.where(sums > 0, c, 0), axis=0))
    base = tl.sum(tl.where(c == chunk - 1, cdf, 0.0), axis=0)  # mass before the chunk

    # Level 2: scan that chunk only.
    v = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    p = tl.load(p_ptr + (row0 + num_accepted) * vocab + v, mask=v < vocab, other=0.0)
    q_end = tl.where(use_w & rejected, vocab, 0)
    if HAS_Q:
        q = tl.load(q_ptr + (r * max_draft + num_accepted) * vocab + v, mask=v < q_end, other=0.0)
    else:
        x_next = tl.load(ids_ptr + r * max_draft + num_accepted, mask=rejected, other=-1)
        q = tl.where((v == x_next) & (v < q_end), 1.0, 0.0)
    w = tl.maximum(p - q, 0.0)
    # First token whose cumulative mass exceeds the threshold; a zero-mass token never is.
    first = tl.min(tl.where(base + tl.cumsum(w, axis=0) > threshold, v, vocab), axis=0)
    last_positive = tl.max(tl.where(w > 0, v, 0), axis=0)
    y = tl.where(found & (first < vocab), first, last_positive)
    tl.store(out_ptr + r * (max_draft + 1) + num_accepted, y)
