"""Logit warping (temperature, top-k, top-p) and inverse-CDF sampling, in float64.

The same warp is applied to the target's logits (giving p) and to the draft's (giving q), so that
speculative acceptance (`dspark.kernels.acceptance`) compares like with like (DESIGN.md §4).

Terms:
- temperature T: logits are divided by T; T == 0 marks a *greedy* row, whose distribution is the
  one-hot at `argmax(logits)` (first index on ties) and ignores top-k and top-p.
- top-k: keep the k largest tempered logits (ties broken by stable descending sort, i.e. the
  lower token id wins); k <= 0 or k >= vocab is off.
- top-p (nucleus): on the tempered, top-k-filtered distribution, keep the smallest prefix of tokens
  in descending-probability order whose cumulative probability reaches top_p; the top token is
  always kept; top_p >= 1 is off.

Sampling draws from float64 uniforms the caller supplies (drawn from each request's own generator,
DESIGN.md §4), so a step is reproducible and rank 0 alone decides it.
"""

from __future__ import annotations

import torch


def warp_probs(
    logits: torch.Tensor,  # [num_rows, vocab] any float dtype
    temperature: torch.Tensor,  # [num_rows] float; 0 = greedy
    top_k: torch.Tensor,  # [num_rows] int64; 0 = off
    top_p: torch.Tensor,  # [num_rows] float; 1.0 = off
) -> torch.Tensor:  # [num_rows, vocab] float64, rows sum to 1
    """Turn logits into the warped sampling distribution, row by row, with no loop over rows.

    Order: divide by temperature, keep the top-k, keep the top-p nucleus of what remains,
    renormalise. Rows with temperature 0 come back exactly one-hot at their argmax.

    >>> logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    >>> warp_probs(logits, torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    tensor([[0., 1., 0.],
            [0., 1., 0.]], dtype=torch.float64)
    """
    num_rows, vocab = logits.shape
    assert logits.is_floating_point(), logits.dtype
    assert temperature.shape == top_k.shape == top_p.shape == (num_rows,)
    temperature = temperature.to(torch.float64)
    greedy = temperature == 0
    if bool(greedy.all()):  # no softmax to take: a greedy batch's warp is its argmaxes
        return _one_hot_argmax(logits)
    # Greedy rows are divided by 1 so they stay finite; their result is replaced below.
    scaled = logits.to(torch.float64) / torch.where(greedy, 1.0, temperature)[:, None]
    filtered = ~greedy & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))
    # Fast paths first: only rows with a top-k/top-p cut pay for the sort over the vocabulary.
    probs = torch.softmax(scaled, dim=-1)
    if bool(filtered.any()):
        rows = torch.nonzero(filtered).flatten()
        probs[rows] = _top_k_top_p(scaled[rows], top_k[rows], top_p[rows])
    if bool(greedy.any()):
        rows = torch.nonzero(greedy).flatten()
        probs.index_copy_(0, rows, _one_hot_argmax(logits[rows]))
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab] float64
    """Each row one-hot at its argmax (the first on ties), without the softmax that greedy
    rows used to get and then overwrite."""
    one_hot = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    return one_hot.scatter_(1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)


def _top_k_top_p(
    scaled: torch.Tensor,  # [num_rows, vocab] float64 tempered logits
    top_k: torch.Tensor,  # [num_rows] int64; 0 = off
    top_p: torch.Tensor,  # [num_rows] float; 1.0 = off
) -> torch.Tensor:  # [num_rows, vocab] float64
    vocab = scaled.shape[1]
    # Work in descending order: top-k is a rank cut, top-p a cumulative-mass cut.
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    sorted_logits = sorted_logits.masked_fill(rank[None, :] >= k[:, None], float("-inf"))

    # Keep token i iff the mass strictly before it has not yet reached top_p: this is the smallest
    # prefix reaching top_p, and always includes the top token. top_p >= 1 is off explicitly, so
    # float rounding in the cumulative sum can never drop a tail token then.
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    top_p = top_p.to(torch.float64)[:, None]
    keep = (mass_before < top_p) | (top_p >= 1.0)
    keep[:, 0] = True
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)


def sample_from_probs(
    probs: torch.Tensor,  # [n, vocab] float64, non-negative; rows need not sum to exactly 1
    u: torch.Tensor,  # [n] float64 uniforms in [0, 1)
) -> torch.Tensor:  # [n] int64 sampled token ids
    """Inverse-CDF sampling: the first token whose cumulative mass exceeds `u * total`.

    `total` is the row's own cumulative sum at the last token, so unnormalised rows (a residual
    max(0, p - q)) need no division. A zero-probability token never comes back: its cumulative
    sum equals its predecessor's, so the predecessor is found first, and if rounding puts the
    threshold at or past the end of the CDF the index is clamped to the last positive token.

    >>> sample_from_probs(torch.tensor([[0.0, 0.5, 0.5, 0.0]], dtype=torch.float64),
    ...                   torch.tensor([1 - 2**-53], dtype=torch.float64))
    tensor([2])
    """
    n, vocab = probs.shape
    assert probs.dtype == torch.float64 and u.dtype == torch.float64, (probs.dtype, u.dtype)
    assert u.shape == (n,), u.shape
    cdf = torch.cumsum(probs, dim=-1)
    threshold = (u * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, threshold, right=True).squeeze(1)
    # A found index < vocab has cdf[index] > cdf[index - 1], so its token has positive mass;
    # only a row whose threshold reached the end of its CDF needs its last positive token (the
    # scan for it costs more than the search: drafting samples a row per request per position).
    past = torch.nonzero(index >= vocab).flatten()
    if past.numel():
        flipped = (probs[past] > 0).flip(-1).to(torch.int32)
        index[past] = vocab - 1 - torch.argmax(flipped, dim=-1)
    return index
