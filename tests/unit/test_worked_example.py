"""The seed's exercise (docs/worked-example.md): allocation and state corrections."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.coordinator.commit import commit
from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.request import Request
from dspark.coordinator.scheduler import EqualPolicy, make_policy
from dspark.coordinator.stale_history import survivals_of
from dspark.draft_worker.draft_model import DraftModelProposer
from dspark.kernels.budget import allocate
from dspark.messages import DraftQuery, Drafts, NewRequest, VerifyPlan, VerifyResult
from dspark.sampling_params import SamplingParams

CONF = torch.tensor([[0.9, 0.8, 0.3], [0.6, 0.2, 0.1]], dtype=torch.float64)
SURV = survivals_of(CONF)


def expected_accepted(alloc: tuple[int, int]) -> float:
    return float(sum(SURV[r, :n].sum() for r, n in enumerate(alloc)))


def test_expected_acceptance_allocation_beats_equal() -> None:
    counts = allocate(CONF, torch.tensor([3, 3]), 3)
    assert tuple(counts.tolist()) == (2, 1)
    assert expected_accepted((2, 1)) == pytest.approx(2.22)
    assert expected_accepted((1, 2)) == pytest.approx(1.62)
    assert expected_accepted((1, 1)) == pytest.approx(1.50)
    assert expected_accepted((3, 0)) == pytest.approx(1.836)
    best = max(
        (a for a in itertools.product(range(4), repeat=2) if sum(a) == 3), key=expected_accepted
    )
    assert best == (2, 1)


def test_policies_plan_the_example() -> None:
    cost = CostModel.linear(1.0, 0.01)
    conf_policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    assert conf_policy.plan_from(("r1", "r2"), CONF, [3, 3], budget=3) == (3, [2, 1])
    k, counts = EqualPolicy(3, cost, AcceptanceTracker(3), False, False).plan_from(
        ("r1", "r2"), CONF, [3, 3], budget=3)
    assert k == 3 and sorted(counts) == [1, 2]


@pytest.mark.parametrize(("name", "accepted", "tokens", "length_gain"), [
    ("r1", 2, (101, 102, 500), 3),  # d11, d12 accepted; bonus b
    ("r1", 1, (101, 501), 2),  # d11 accepted; correction y
    ("r1", 0, (502,), 1),  # d11 rejected; correction y
    ("r2", 1, (201, 503), 2),
    ("r2", 0, (504,), 1),
])
def test_state_corrections(
    name: str, accepted: int, tokens: tuple[int, ...], length_gain: int
) -> None:
    planned = 2 if name == "r1" else 1
    req = Request(name, tuple(range(1, 11)), SamplingParams(max_tokens=50), seed=0)
    req.output_ids = [7]  # a running request: its anchor t_r = 7 is not yet in the target cache
    req.target_length = before = req.num_tokens - 1
    drafts = Drafts((name,), torch.tensor([[101, 102, 103]]), torch.tensor([3]), None, None)
    plan = VerifyPlan((name,), (before,), ((7, 101, 102)[: planned + 1],), (planned,),
                      torch.tensor([[101, 102][:planned]]), None, 3)
    result = VerifyResult((name,), (accepted,), (tokens,))
    step = commit(1, {name: req}, drafts, plan, result, frozenset(), 512, str).requests[0]
    assert step.committed == tokens
    assert step.target_length == before + length_gain == req.num_tokens - 1
    assert req.output_ids[-1] == tokens[-1]  # the next anchor


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_draft_model_keeps_only_accepted_fed_drafts(tiny_pair, accepted: int) -> None:
    _, drafter = tiny_pair
    prop = DraftModelProposer(drafter, num_blocks=32, block_size=4)
    prop.add_request(NewRequest("r1", (1, 2, 3), SamplingParams(temperature=0), seed=0))
    drafts = prop.propose([DraftQuery("r1", (1, 2, 3), 3)])
    assert int(drafts.num_drafts[0]) == 3
    # Fed: the 3 committed tokens and d1, d2 (d3 was sampled last, never fed).
    assert prop.cache.length("r1") == 5
    prop.commit("r1", accepted)
    assert prop.cache.length("r1") == 3 + min(accepted, 2)
