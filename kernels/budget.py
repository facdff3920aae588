"""Budget allocation: the K largest survivals over all (request, position) slots.

Survival a_{r,j} = c_{r,1}···c_{r,j}. Slots past a request's drafts are excluded; ties go to the
smaller position j, then the earlier request r (key (−a, j, r)). Since a never grows with j, the
chosen slots form a prefix of each request's drafts, returned as per-request counts.
"""

from __future__ import annotations

import torch


def allocate_ref(
    confidences: torch.Tensor,  # [num_reqs, max_draft] conditional confidences in [0, 1]
    num_drafts: torch.Tensor,  # [num_reqs] int64 admissible drafts per request
    budget: int,
) -> torch.Tensor:  # [num_reqs] int64 counts, Σ = min(budget, Σ num_drafts)
    num_reqs, max_draft = confidences.shape
    surv = torch.cumprod(confidences.to(torch.float64).clamp(0, 1), dim=1)
    pos = torch.arange(max_draft, device=confidences.device)
    valid = pos[None, :] < num_drafts[:, None]
    req = torch.arange(num_reqs, device=confidences.device)[:, None].expand(num_reqs, max_draft)
    flat_a = surv[valid]
    flat_j = pos[None, :].expand(num_reqs, max_draft)[valid]
    flat_r = req[valid]
    # Lexicographic (−a, j, r): stable sorts from the last key to the first.
    order = torch.argsort(flat_r, stable=True)
    order = order[torch.argsort(flat_j[order], stable=True)]
    order = order[torch.argsort(-flat_a[order], stable=True)]
    chosen = flat_r[order[: max(0, budget)]]
    return torch.bincount(chosen, minlength=num_reqs).to(torch.int64)


def allocate(confidences: torch.Tensor, num_drafts: torch.Tensor, budget: int) -> torch.Tensor:
    """Dispatch: the torch reference (sizes here are a few hundred slots)."""
    return allocate_ref(confidences, num_drafts, budget)
