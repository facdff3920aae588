"""The acceptance tracker: sliding windows per position, per request and global, with a prior;
and its drift correction of a confidence head."""

from __future__ import annotations

import random

import pytest
import torch

from dspark.coordinator.confidence import (
    DRIFT_WINDOW,
    GLOBAL_PRIOR_WEIGHT,
    PRIOR_MEAN,
    REQUEST_PRIOR_WEIGHT,
    AcceptanceTracker,
    _Queue,
)
from dspark.messages import Drafts, RequestStep, StepState


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


def _head_drafts(req_ids: tuple[str, ...], conf: list[list[float]]) -> Drafts:
    c = torch.tensor(conf, dtype=torch.float64)
    return Drafts(req_ids, torch.zeros(c.shape, dtype=torch.long),
                  torch.full((len(req_ids),), c.shape[1]), None, c)


def test_drift_correction_starts_at_the_offline_calibration() -> None:
    tracker = AcceptanceTracker(max_draft=3)
    d = _head_drafts(("a", "b"), [[0.9, 0.5, 0.2], [0.3, 0.3, 0.3]])
    assert torch.equal(tracker.fill(d, [False, True]).confidences, d.confidences)


def test_drift_correction_learns_the_live_acceptance_of_each_kind_apart() -> None:
    # The head says 0.8 everywhere; greedy requests really accept position 1 with rate 0.4 and,
    # once there, position 2 with rate 0.8. Sampled requests are never observed: untouched.
    rng = random.Random(1)
    tracker = AcceptanceTracker(max_draft=2)
    head = [[0.8, 0.8]]
    for _ in range(DRIFT_WINDOW):
        tracker.fill(_head_drafts(("g",), head), [False])
        accepted = 0 if rng.random() >= 0.4 else (2 if rng.random() < 0.8 else 1)
        tracker.observe(_step("g", planned=2, accepted=accepted))
    greedy = tracker.fill(_head_drafts(("g", "s"), head * 2), [False, True]).confidences
    # Within 3σ of the truth: 512 slots reach position 1 (σ ≈ 0.022), ~200 position 2 (≈ 0.028).
    assert greedy[0, 0].item() == pytest.approx(0.4, abs=0.07)
    assert greedy[0, 1].item() == pytest.approx(0.8, abs=0.09)
    assert greedy[1].tolist() == [0.8, 0.8]
    ratios = tracker.drift.ratios(sampled=False)
    assert ratios[0] == pytest.approx(0.5, abs=0.09)  # 0.4 / 0.8


def test_drift_correction_never_raises_a_confidence_past_one_and_can_be_off() -> None:
    tracker = AcceptanceTracker(max_draft=1)
    for _ in range(200):  # the head says 0.5; everything is accepted: ρ → 2
        tracker.fill(_head_drafts(("a",), [[0.5]]), [True])
        tracker.observe(_step("a", planned=1, accepted=1))
    assert tracker.fill(_head_drafts(("a",), [[0.9]]), [True]).confidences.tolist() == [[1.0]]
    off = AcceptanceTracker(max_draft=1, correct_drift=False)
    off.fill(_head_drafts(("a",), [[0.5]]), [True])
    off.observe(_step("a", planned=1, accepted=1))
    assert off.fill(_head_drafts(("a",), [[0.5]]), [True]).confidences.tolist() == [[0.5]]
