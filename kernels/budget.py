"""Budget allocation: the K largest survivals over all (request, position) slots.

Survival a_{r,j} = c_{r,1}···c_{r,j}. Slots past a request's drafts are excluded; ties go to the
smaller position j, then the earlier request r (key (−a, j, r)). Since a never grows with j, the
chosen slots form a prefix of each request's drafts, returned as per-request counts.

Worked example (the seed's, DESIGN.md §3): c_1 = [.9, .8, .3], c_2 = [.6, .2, .1], K = 3.
Survivals [.9, .72, .216] and [.6, .12, .012]; the top 3 are .9, .72, .6: counts (2, 1).

There is no Triton kernel: `allocate` sorts on the CPU, in numpy, or in plain Python up to
SMALL_BATCH_SLOTS slots (the torch reference elsewhere). Its caller, the coordinator's
scheduler, holds confidences on the CPU, and the sizes are a few hundred requests times
γ <= 16, a few thousand slots: CPU sorts take microseconds there, while a GPU kernel would
first need a host-to-device copy, a launch and a copy back with a sync (tens of µs). It cannot
pay at these sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch
from numpy.typing import ArrayLike

# Up to this many admissible slots, the budget ranks them in plain floats (`_ranked`: its
# candidates, `small_candidate_plans`, and its allocation, `allocate_survivals`); past it, in
# numpy, whose ~5 µs a call (the caches a forward pass left cold) then costs less than the
# interpreter's loops.
SMALL_BATCH_SLOTS = 64


def allocate_ref(
    confidences: torch.Tensor,  # [num_reqs, max_draft] conditional confidences in [0, 1]
    num_drafts: torch.Tensor,  # [num_reqs] int64 admissible drafts per request
    budget: int,
) -> torch.Tensor:  # [num_reqs] int64 counts, Σ = min(budget, Σ num_drafts)
    """Counts ℓ_r of the `budget` largest survivals, key (−a, j, r); confidences clamped to [0, 1].

    >>> allocate_ref(torch.tensor([[0.9, 0.8, 0.3], [0.6, 0.2, 0.1]]), torch.tensor([3, 3]), 3)
    tensor([2, 1])
    """
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
    counts = torch.bincount(chosen, minlength=num_reqs).to(torch.int64)
    # The prefix property: the counts select exactly the chosen slots, i.e. no slot outside a
    # request's first ℓ_r is chosen. Holds since a_{r,j} <= a_{r,j-1} and ties go to smaller j.
    assert bool((flat_j[order[: max(0, budget)]] < counts[chosen]).all()), "not a prefix"
    return counts


def allocate(confidences: torch.Tensor, num_drafts: torch.Tensor, budget: int) -> torch.Tensor:
    """Dispatch: the numpy sort for CPU tensors (the scheduler's, every step: ~30 µs against the
    reference's ~85, whose dozen torch ops each cost their dispatch), skipped when the budget
    takes no slot or every slot (`allocate_survivals`); the torch reference for others."""
    limits = num_drafts.clamp(0, confidences.shape[1])
    if confidences.device.type == "cpu":
        return _allocate_numpy(confidences, limits, budget)
    return allocate_ref(confidences, num_drafts, budget)


def _allocate_numpy(
    confidences: torch.Tensor,  # [num_reqs, max_draft] on the CPU
    limits: torch.Tensor,  # [num_reqs] int64, within [0, max_draft]
    budget: int,
) -> torch.Tensor:  # [num_reqs] int64
    """`allocate_ref` in numpy (`allocate_survivals`)."""
    surv = np.cumprod(np.clip(confidences.detach().numpy().astype(np.float64), 0.0, 1.0), axis=1)
    return torch.from_numpy(allocate_survivals(surv, limits.numpy(), budget))


def allocate_survivals(
    survivals: np.ndarray,  # [num_reqs, width] float64 survivals (not conditional confidences)
    limits: Sequence[int] | np.ndarray,  # [num_reqs] admissible drafts, within [0, width]
    budget: int,
) -> np.ndarray:  # [num_reqs] int64 counts, Σ = min(budget, Σ limits)
    """Counts of the first `budget` slots of `rank_slots`: `allocate` for a caller that holds
    survivals in numpy already (the scheduler, every step). A budget of no slot or of every slot,
    or of a lone request's slots (a prefix of its positions), needs no ranking."""
    if len(limits) == 1:  # a lone request's slots are its positions in order
        return np.array([max(0, min(budget, int(limits[0])))], dtype=np.int64)
    if 0 < budget and sum(limits) <= SMALL_BATCH_SLOTS:  # a few slots: ranked in plain floats
        counts = [0] * len(limits)
        for _, _, r in _ranked(survivals.tolist(), limits)[:budget]:
            counts[r] += 1
        return np.array(counts, dtype=np.int64)
    limits = np.asarray(limits, dtype=np.int64)
    if budget <= 0:
        return np.zeros_like(limits)
    if budget >= int(limits.sum()):
        return limits.copy()
    chosen = rank_slots(survivals, limits)[2][:budget]
    return np.bincount(chosen, minlength=survivals.shape[0]).astype(np.int64)


def rank_slots(
    survivals: np.ndarray,  # [num_reqs, width] float64
    limits: ArrayLike,  # [num_reqs] admissible drafts per request, within [0, width]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # (a, j 1-based, r): each [num_slots]
    """Every admissible slot (r, j), best first by key (−a, j, r): the order `allocate` takes
    them in, and the order the scheduler's budget walks. numpy: this runs every step on arrays
    small enough that torch's per-op dispatch would dominate. A lone request's slots need no
    sort: its survivals never grow with j, and ties go to the smaller j."""
    num_reqs, width = survivals.shape
    if num_reqs == 1:
        n = min(int(limits[0]), width)
        return survivals[0, :n], np.arange(1, n + 1), np.zeros(n, dtype=np.int64)
    valid = np.arange(1, width + 1)[:, None] <= np.asarray(limits)[None, :]  # [width, num_reqs]
    # The admissible slots in row-major order of [width, num_reqs] are listed by (j, r)
    # already; one stable sort on −a then gives the full key.
    j, r = valid.nonzero()
    a = survivals[r, j]
    order = (-a).argsort(kind="stable")
    return a[order], j[order] + 1, r[order]


def candidate_plans(
    a: np.ndarray,  # [num_slots] survivals in `rank_slots` order
    pos: np.ndarray,  # [num_slots] their positions j (1-based)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # (K, Σ a, depth): each [num_candidates]
    """The budget's candidate plans, K = 0 first: for each depth cap d, the first K slots (in
    `rank_slots` order) among those at positions <= d, with their expected accepted drafts and
    the round's depth. A plan verifies the best slots a round of d positions drafts: without
    the cap, one request's 3rd slot brought along every slot ranked above it, another's 5th
    included, and a round of 5 positions for all. (Where the candidates are the prefixes of the
    whole order, see `prefix_plans`.)

    >>> k, tokens, depth = candidate_plans(np.array([.9, .6, .5]), np.array([1, 1, 2]))
    >>> k.tolist(), tokens.round(2).tolist(), depth.tolist()
    ([0, 1, 2, 1, 2, 3], [0.0, 0.9, 1.5, 0.9, 1.5, 2.0], [0, 1, 1, 1, 1, 2])
    """
    caps = np.arange(1, int(pos.max()) + 1) if pos.size else pos
    keep = pos[None, :] <= caps[:, None]  # [depth caps, num_slots]
    counts = np.concatenate(([0], keep.cumsum(axis=1)[keep]))
    tokens = np.concatenate(([0.0], np.where(keep, a, 0.0).cumsum(axis=1)[keep]))
    depths = np.concatenate(([0], np.maximum.accumulate(np.where(keep, pos, 0), axis=1)[keep]))
    return counts, tokens, depths


def small_candidate_plans(rows: list[list[float]], limits: Sequence[int]
                          ) -> tuple[list[int], list[float], list[int]]:  # each [num_candidates]
    """`candidate_plans` of a small batch in plain floats, from its survival rows (`limits[r]`
    admissible positions of `rows[r]`), its slots ranked here by key (−a, j, r), and each plan
    listed once: a depth cap's first plans, before its first slot at that depth, are the cap
    below's plans again (the same slots, Σ a and depth), already listed there. The budget takes
    the first maximum, so the plan it picks is the same. With the arrays of a batch of a few
    requests, `rank_slots` and `candidate_plans` are ~20 numpy calls, each ~5 µs with the caches
    a forward pass left cold: 130 µs a step at 4 in flight, where this takes ~40 (the budget's
    planning a step, side by side: 0.24 against 0.33 ms at 4 in flight, 0.35 against 0.39 at
    8).

    >>> small_candidate_plans([[.9, .5], [.6, .1]], [2, 1])
    ([0, 1, 2, 3], [0.0, 0.9, 1.5, 2.0], [0, 1, 1, 2])
    """
    ranked = _ranked(rows, limits)
    counts, tokens, depths = [0], [0.0], [0]
    for cap in range(1, max((j for _, j, _ in ranked), default=0) + 1):
        k, total, depth = 0, 0.0, 0
        for neg, j, _ in ranked:
            if j <= cap:
                k += 1
                total += -neg
                depth = max(depth, j)
                if depth == cap:
                    counts.append(k)
                    tokens.append(total)
                    depths.append(depth)
    return counts, tokens, depths


def _ranked(rows: list[list[float]], limits: Sequence[int]) -> list[tuple[float, int, int]]:
    """`rank_slots` of a small batch in plain floats: (−a, j, r) of every admissible slot,
    sorted (`SMALL_BATCH_SLOTS`)."""
    return sorted((-x, j, r) for r, (row, n) in enumerate(zip(rows, limits, strict=True))
                  for j, x in enumerate(row[: int(n)], 1))


def prefix_plans(a: list[float]) -> tuple[list[int], list[float]]:  # (K, Σ a): [num_slots + 1]
    """The candidates where a plan is a prefix of the whole `rank_slots` order, K = 0 first,
    with their expected accepted drafts: a probe's (its round, paid whatever its depth, sets
    its own). At most a few blocks of slots, so plain floats: each numpy call here would cost
    more than all the arithmetic. (A lone request's are these too, its K-th slot its K-th
    position, listed by `small_candidate_plans` with their depths.)

    >>> prefix_plans([.5, .25])
    ([0, 1, 2], [0.0, 0.5, 0.75])
    """
    return list(range(len(a) + 1)), [0.0, *accumulate(a)]
