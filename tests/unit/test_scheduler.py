"""Scheduler policies on fabricated drafts and step results (no model): case tables."""

from __future__ import annotations

import pytest
import torch

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.scheduler import make_policy, sorted_slots, survivals_of
from dspark.messages import Drafts, RequestStep, StepState


def drafts_of(conf: list[list[float]], ids: tuple[str, ...] | None = None) -> Drafts:
    c = torch.tensor(conf, dtype=torch.float64)
    ids = ids or tuple(f"r{i}" for i in range(len(conf)))
    return Drafts(ids, torch.zeros(c.shape, dtype=torch.long), torch.full((len(conf),), c.shape[1]),
                  None, c)


def test_slots_sorted_by_survival_then_position_then_request() -> None:
    surv = torch.tensor([[0.5, 0.5], [0.5, 0.25]], dtype=torch.float64)
    order = [(s.req, s.pos) for s in sorted_slots(surv, [2, 2])]
    assert order == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert [(s.req, s.pos) for s in sorted_slots(surv, [1, 0])] == [(0, 1)]


@pytest.mark.parametrize(("conf", "per_token", "expected_k"), [
    # step_time = 1 + per_token·B. With R = 1: K=0 gives 1/(1+c); adding slots helps while
    # the marginal survival beats the marginal cost ratio.
    ([[0.9, 0.9, 0.9]], 0.01, 3),
    ([[0.9, 0.1, 0.1]], 0.5, 1),
    ([[0.05, 0.05, 0.05]], 0.5, 0),
])
def test_confidence_sync_early_stop(conf, per_token: float, expected_k: int) -> None:
    cost = CostModel.linear(1.0, per_token)
    policy = make_policy("confidence-sync", 3, cost, AcceptanceTracker(3), a_priori=False)
    d = drafts_of(conf)
    policy.draft_lengths([3], d.req_ids)
    k = policy.choose_budget(d)
    assert k == expected_k
    assert policy.plan_verification(d, k) == [expected_k]


def test_sync_stops_at_first_non_improving_slot_even_if_later_would_help() -> None:
    # SPS(1,2,3) = (1, .5, .45): adding slot 1 (a = .8) lowers Θ, so Algorithm 1 stops at 0
    # although verifying both (a2 = .72) would beat plain decoding: that is its price for safety.
    cost = CostModel("sps", verify=(1.0, 2.0, 1 / 0.45))
    policy = make_policy("confidence-sync", 2, cost, AcceptanceTracker(2), a_priori=False)
    d = drafts_of([[0.8, 0.9]])
    policy.draft_lengths([2], d.req_ids)
    assert policy.choose_budget(d) == 0


def step_of(req_ids, planned, accepted) -> StepState:
    return StepState(0, sum(planned), tuple(
        RequestStep(r, p, p, a, (1,) * (a + 1), 10, None) for r, p, a in zip(req_ids, planned, accepted)))


def test_confidence_budget_reads_survivals_from_two_steps_back() -> None:
    cost = CostModel.linear(1.0, 0.3)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    high, low = [[0.95, 0.95, 0.95]], [[0.05, 0.05, 0.05]]
    budgets = []
    for conf in (high, low, low, low):
        d = drafts_of(conf, ids)
        policy.draft_lengths([3], ids)
        k = policy.choose_budget(d)
        budgets.append(k)
        policy.plan_verification(d, k)
        policy.observe(step_of(ids, [k], [0]))
    # Steps 0 and 1 have no history: the tracker's prior (0.6 per position) gives K = 2;
    # step 2 sees step 0 (high) and takes all 3; step 3 sees step 1 (low) and verifies nothing.
    assert budgets == [2, 2, 3, 0]


def test_confidence_allocates_budget_by_current_survivals() -> None:
    cost = CostModel.linear(1.0, 0.0)  # free verification: K = every slot
    policy = make_policy("confidence", 2, cost, AcceptanceTracker(2), a_priori=False)
    d = drafts_of([[0.2, 0.9], [0.9, 0.9]])
    lengths = policy.draft_lengths([2, 2], d.req_ids)
    assert lengths == [2, 2]
    k = policy.choose_budget(d)
    assert k == 4 and policy.plan_verification(d, k) == [2, 2]


def test_a_priori_plans_before_drafting_with_tracked_rates() -> None:
    tracker = AcceptanceTracker(4)
    for _ in range(50):  # position 1 always accepted, position 2 never
        tracker.observe(step_of(("x",), [4], [1]))
    rates = tracker.global_rates()
    assert rates[0] > 0.9 and rates[1] < 0.1
    policy = make_policy("confidence", 4, CostModel.linear(1.0, 0.2), tracker, a_priori=True)
    lengths = policy.draft_lengths([4, 4], ("new1", "new2"))
    assert lengths == [1, 1]  # the draft model drafts only what will be verified


def test_tracker_counts_conditional_acceptance() -> None:
    tracker = AcceptanceTracker(3)
    tracker.observe(step_of(("r",), [3], [1]))  # pos 1 accepted, pos 2 rejected, pos 3 unreached
    q = tracker._global
    assert (q[0].reached, q[0].accepted) == (1, 1)
    assert (q[1].reached, q[1].accepted) == (1, 0)
    assert q[2].reached == 0
    assert torch.all(survivals_of(tracker.rates(("r", "new"))) <= 1)


def test_unknown_policy_and_missing_cost_are_refused() -> None:
    with pytest.raises(ValueError, match="policy='best'"):
        make_policy("best", 3)
    with pytest.raises(ValueError, match="needs a cost model"):
        make_policy("confidence", 3)


def test_allocation_ranks_survivals_not_products_of_survivals() -> None:
    # Survivals r1 (.9, .81), r2 (.8): the top 2 are both of r1's slots. Ranking cumulative
    # products of survivals instead (.9, .729 vs .8) would wrongly give (1, 1).
    policy = make_policy("confidence", 2, CostModel.linear(1.0, 0.0), AcceptanceTracker(2),
                         a_priori=False)
    conf = torch.tensor([[0.9, 0.9], [0.8, 0.1]], dtype=torch.float64)
    assert policy.plan_from(("a", "b"), conf, [2, 1], budget=2) == (2, [2, 0])


def test_budget_recovers_after_steps_without_speculation() -> None:
    # Regression: the history once stored only drafted positions, so a step with K = 0 left
    # zero survivals and two steps later K = 0 again, forever.
    tracker = AcceptanceTracker(3)
    cost = CostModel.linear(1.0, 2.0)  # verification so dear that K = 0 at the prior rates
    policy = make_policy("confidence", 3, cost, tracker, a_priori=True)
    for _ in range(3):
        assert policy.draft_lengths([3], ("a",)) == [0]
    for _ in range(200):  # everything gets accepted from now on
        tracker.observe(step_of(("z",), [3], [3]))
    policy.cost = CostModel.linear(1.0, 0.05)
    lengths = [policy.draft_lengths([3], ("a",))[0] for _ in range(3)]
    assert lengths[-1] == 3


def test_monotone_fit_pools_outliers_instead_of_propagating_them() -> None:
    from dspark.coordinator.cost_model import monotone

    fit = monotone([5.0, 1.0, 1.0, 1.0, 2.0, 3.0])
    assert all(a <= b for a, b in zip(fit, fit[1:]))
    assert fit[-1] == 3.0 and fit[0] == 2.0  # the spike pools with its neighbours


def test_vectorised_step_times_equal_scalar_lookup() -> None:
    cost = CostModel("t", verify=(1.0, 1.5, 2.5, 3.0), draft=(0.1, 0.2))
    n = torch.tensor([0, 1, 3, 4, 7])
    pos = torch.tensor([0, 1, 2, 3, 4])
    expected = [cost.step_time(int(b), 2, int(p)) for b, p in zip(n, pos)]
    assert cost.step_times(n, 2, pos).tolist() == pytest.approx(expected)


def skipped_drafts(ids: tuple[str, ...]) -> Drafts:
    """What a parallel drafter returns when asked for no drafts: width 0, zero counts."""
    n = len(ids)
    return Drafts(ids, torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                  None, torch.zeros(n, 0, dtype=torch.float64))


def test_parallel_drafter_skips_its_round_when_the_budget_is_zero_but_probes() -> None:
    from dspark.coordinator.scheduler import PROBE_EVERY

    cost = CostModel.linear(1.0, 2.0)  # verification so dear that K = 0 at the prior rates
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a", "b")
    asked = []
    for _ in range(2 * PROBE_EVERY):
        lengths = policy.draft_lengths([3, 3], ids)
        asked.append(lengths)
        d = drafts_of([[0.9, 0.9, 0.9]] * 2, ids) if any(lengths) else skipped_drafts(ids)
        k = policy.choose_budget(d)
        assert k == 0 and policy.plan_verification(d, k) == [0, 0]
        policy.observe(step_of(ids, [0, 0], [0, 0]))
    probes = [i + 1 for i, lengths in enumerate(asked) if any(lengths)]
    assert probes == [PROBE_EVERY, 2 * PROBE_EVERY]
    assert all(lengths == [3, 3] for lengths in asked if any(lengths))  # 2 <= PROBE_REQUESTS


def test_probes_of_a_large_batch_take_a_few_requests_in_turn() -> None:
    from dspark.coordinator.scheduler import PROBE_EVERY, PROBE_REQUESTS

    policy = make_policy("confidence", 3, CostModel.linear(1.0, 2.0), AcceptanceTracker(3),
                         a_priori=False)
    ids = tuple(f"r{i}" for i in range(3 * PROBE_REQUESTS))
    probed = []
    for _ in range(3 * PROBE_EVERY):
        lengths = policy.draft_lengths([3] * len(ids), ids)
        d = drafts_of([[0.9] * 3] * len(ids), ids) if any(lengths) else skipped_drafts(ids)
        d = Drafts(ids, d.token_ids, torch.tensor(lengths), None, d.confidences)
        policy.plan_verification(d, policy.choose_budget(d))
        if any(lengths):
            probed.append({i for i, n in enumerate(lengths) if n})
    assert [len(p) for p in probed] == [PROBE_REQUESTS] * 3
    assert set().union(*probed) == set(range(len(ids)))  # every request in turn


def test_rows_without_drafts_leave_the_history_alone() -> None:
    # Regression: a row with nothing drafted (a skipped round, or DSpark's first step before
    # the target has produced hidden rows) was stored as zero survivals, and two steps later
    # it counted as "never accepted".
    cost = CostModel.linear(1.0, 0.3)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    fresh = (drafts_of([[0.95, 0.95, 0.95]], ids), drafts_of([[0.5, 0.5, 0.5]], ids))
    for d in fresh + (skipped_drafts(ids), skipped_drafts(ids)):
        policy.draft_lengths([3], ids)
        k = policy.choose_budget(d)
        policy.plan_verification(d, k)
    # The ring still holds the two fresh rows (two steps back: the 0.95s), not zero rows.
    torch.testing.assert_close(policy.stale_survivals(ids)[0],
                               survivals_of(torch.tensor([[0.95] * 3], dtype=torch.float64))[0], rtol=0, atol=1e-12)


def test_parallel_round_cost_is_charged_only_when_something_is_verified() -> None:
    # Verification is free here; only the drafting round costs. R = 1 with survival .9 at
    # every position: K = 3 earns 1 + .9 + .81 + .729 = 3.44 tokens for 1 + round seconds.
    conf = torch.full((1, 3), 0.9, dtype=torch.float64)
    for round_cost, expected in ((0.5, 3), (3.0, 0)):
        cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(round_cost,))
        policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
        assert policy.best_budget(survivals_of(conf), [3]) == expected
