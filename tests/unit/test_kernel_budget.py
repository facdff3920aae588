"""Budget allocation (`dspark.kernels.budget`) against a brute-force sort of all slots.

`allocate` has no Triton kernel (the module says why), so these tests need no interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.kernels.budget import (
    allocate,
    allocate_ref,
    candidate_plans,
    prefix_plans,
    rank_slots,
    small_candidate_plans,
)


def _brute_force(confidences: torch.Tensor, num_drafts: torch.Tensor, budget: int) -> list[int]:
    """Every admissible slot (r, j) with a_{r,j} as a Python float product, sorted by (−a, j, r)."""
    num_reqs, max_draft = confidences.shape
    slots = []
    for r in range(num_reqs):
        a = 1.0
        for j in range(min(int(num_drafts[r]), max_draft)):
            a *= min(max(float(confidences[r, j]), 0.0), 1.0)
            slots.append((-a, j, r))
    slots.sort()
    counts = [0] * num_reqs
    for _, _, r in slots[: max(budget, 0)]:
        counts[r] += 1
    return counts


def test_seed_worked_example() -> None:
    """DESIGN.md §3: survivals [.9, .72, .216] and [.6, .12, .012], K = 3 -> (2, 1)."""
    conf = torch.tensor([[0.9, 0.8, 0.3], [0.6, 0.2, 0.1]])
    counts = allocate_ref(conf, torch.tensor([3, 3]), 3)
    assert counts.dtype == torch.int64 and torch.equal(counts, torch.tensor([2, 1]))
    assert torch.equal(allocate(conf, torch.tensor([3, 3]), 3), counts)


@pytest.mark.parametrize("dyadic", [False, True], ids=["continuous", "dyadic_ties"])
def test_matches_brute_force_on_random_cases(dyadic: bool) -> None:
    """200 random cases; dyadic confidences (k/4) make exact ties, so the tie-break is tested.
    Batches of up to 12 requests of up to 8 drafts: `allocate`'s plain-float path (up to
    SMALL_BATCH_SLOTS slots) and its numpy one both."""
    g = torch.Generator().manual_seed(30 + dyadic)
    for _ in range(200):
        num_reqs = int(torch.randint(1, 13, (), generator=g))
        max_draft = int(torch.randint(0, 9, (), generator=g))
        if dyadic:
            conf = torch.randint(0, 5, (num_reqs, max_draft), generator=g) / 4.0
        else:
            conf = torch.rand(num_reqs, max_draft, generator=g, dtype=torch.float64)
        num_drafts = torch.randint(0, max_draft + 2, (num_reqs,), generator=g)  # may exceed γ
        total = int(num_drafts.clamp(max=max_draft).sum())
        budget = int(torch.randint(-1, total + 3, (), generator=g))
        counts = allocate_ref(conf, num_drafts, budget)
        assert counts.tolist() == _brute_force(conf, num_drafts, budget), (conf, num_drafts, budget)
        assert int(counts.sum()) == min(max(budget, 0), total)
        assert torch.equal(allocate(conf, num_drafts, budget), counts)  # its fast paths too


def test_budget_beyond_the_slots_takes_all_of_them() -> None:
    conf = torch.tensor([[0.5, 0.4, 0.3], [0.9, 0.1, 0.0], [0.7, 0.7, 0.7]])
    num_drafts = torch.tensor([3, 1, 0])
    assert allocate_ref(conf, num_drafts, 100).tolist() == [3, 1, 0]


def test_slots_past_num_drafts_are_excluded() -> None:
    """r0's high survivals past ℓ_max = 1 never count; r1 gets the rest of the budget."""
    conf = torch.tensor([[0.9, 1.0, 1.0], [0.5, 0.5, 0.5]])
    assert allocate_ref(conf, torch.tensor([1, 3]), 3).tolist() == [1, 2]


def test_ties_go_to_smaller_position_then_earlier_request() -> None:
    """All survivals 1: order (j=1, r0), (j=1, r1), (j=2, r0), ... -> K = 3 gives (2, 1)."""
    conf = torch.ones(2, 3)
    assert allocate_ref(conf, torch.tensor([3, 3]), 3).tolist() == [2, 1]
    assert allocate_ref(conf, torch.tensor([3, 3]), 1).tolist() == [1, 0]


def test_empty_batch_and_zero_budget() -> None:
    assert allocate_ref(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), 4).tolist() == []
    assert allocate_ref(torch.rand(2, 3), torch.tensor([3, 3]), 0).tolist() == [0, 0]


def test_candidate_plans_are_the_best_slots_of_each_round_depth() -> None:
    """For each depth cap d and each K, the candidate is the first K slots (key (−a, j, r)) at
    positions <= d, with their Σ a and depth, against a brute-force filter of the sorted
    slots; `prefix_plans`, the prefixes of the whole order. Dyadic survivals make ties (and
    exact sums)."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        num_reqs, width = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        conf = rng.integers(0, 5, (num_reqs, width)) / 4.0
        survivals = np.cumprod(conf, axis=1)
        limits = rng.integers(0, width + 1, num_reqs)
        a, pos, _ = rank_slots(survivals, limits)
        counts, tokens, depths = candidate_plans(a, pos)
        expected = [(0, 0.0, 0)]
        for d in range(1, int(pos.max(initial=0)) + 1):
            kept = [(x, j) for x, j in zip(a.tolist(), pos.tolist(), strict=True) if j <= d]
            for k in range(1, len(kept) + 1):
                expected.append((k, sum(x for x, _ in kept[:k]), max(j for _, j in kept[:k])))
        got = list(zip(counts.tolist(), tokens.tolist(), depths.tolist(), strict=True))
        assert got == expected  # dyadic: sums are exact
        counts, tokens = prefix_plans(a.tolist())
        assert counts == list(range(a.size + 1))
        assert tokens == [0.0, *np.cumsum(a).tolist()]  # dyadic: sums are exact


@pytest.mark.parametrize("dyadic", [False, True], ids=["continuous", "dyadic_ties"])
def test_small_candidate_plans_are_candidate_plans_listed_once(dyadic: bool) -> None:
    """The plain-float candidates of a small batch are `candidate_plans`' with each repeated
    plan (the same K, Σ a and depth under a deeper cap) dropped, in the same order and to the
    last bit: the budget's first maximum is the same plan either way. Dyadic survivals make
    ties between requests and positions."""
    rng = np.random.default_rng(11 + dyadic)
    for _ in range(300):
        num_reqs, width = int(rng.integers(1, 11)), int(rng.integers(1, 8))
        shape = (num_reqs, width)
        conf = rng.integers(0, 5, shape) / 4.0 if dyadic else rng.random(shape)
        survivals = np.cumprod(conf, axis=1)
        limits = rng.integers(0, width + 1, num_reqs).tolist()
        counts, tokens, depths = candidate_plans(*rank_slots(survivals, limits)[:2])
        plans = zip(counts.tolist(), tokens.tolist(), depths.tolist(), strict=True)
        once = list(dict.fromkeys(plans))
        got = small_candidate_plans(survivals.tolist(), limits)
        assert list(zip(*got, strict=True)) == once, (survivals, limits)
