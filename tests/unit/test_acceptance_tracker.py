"""The acceptance tracker: sliding windows per position, per request and global, with a prior."""

from __future__ import annotations

import random

import pytest
import torch

from dspark.coordinator.confidence import (
    GLOBAL_PRIOR_WEIGHT,
    PRIOR_MEAN,
    REQUEST_PRIOR_WEIGHT,
    AcceptanceTracker,
    _Queue,
)
from dspark.messages import RequestStep, StepState


def test_window_count_stays_the_sum_of_what_is_inside() -> None:
    rng = random.Random(0)
    q = _Queue(window=7)
    for _ in range(100):
        q.add(rng.random() < 0.6)
        assert q.accepted == sum(q.outcomes) and q.reached == min(len(q.outcomes), 7)


def _step(req_id: str, planned: int, accepted: int) -> StepState:
    rs = RequestStep(req_id, planned, planned, accepted, (1,) * (accepted + 1), 10, None)
    return StepState(1, planned, (rs,))


def test_rates_follow_the_documented_prior_then_the_observations() -> None:
    tracker = AcceptanceTracker(max_draft=3, window=8, request_window=4)
    assert tracker.rates(["new"]).tolist() == [[PRIOR_MEAN] * 3]  # nothing seen: the prior
    tracker.observe(_step("a", planned=3, accepted=1))  # position 1 accepted, 2 rejected
    g = [(1 + GLOBAL_PRIOR_WEIGHT * PRIOR_MEAN) / (1 + GLOBAL_PRIOR_WEIGHT),
         (0 + GLOBAL_PRIOR_WEIGHT * PRIOR_MEAN) / (1 + GLOBAL_PRIOR_WEIGHT), PRIOR_MEAN]
    assert tracker.global_rates().tolist() == pytest.approx(g)
    own = [(1 + REQUEST_PRIOR_WEIGHT * g[0]) / (1 + REQUEST_PRIOR_WEIGHT),
           (0 + REQUEST_PRIOR_WEIGHT * g[1]) / (1 + REQUEST_PRIOR_WEIGHT), g[2]]
    rates = tracker.rates(["a", "other"])
    assert rates.dtype == torch.float64
    assert rates[0].tolist() == pytest.approx(own) and rates[1].tolist() == pytest.approx(g)
