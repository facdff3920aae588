"""Scheduler policies on fabricated drafts and step results (no model): case tables. Step
prices are tested in test_step_pricing.py, probes and exploration stretches in
test_exploration.py."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from budget_cases import drafts_of, skipped_drafts, step_of

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.scheduler import BudgetedPolicy, make_policy, sorted_slots
from dspark.coordinator.stale_history import survivals_of
from dspark.messages import Drafts


def test_slots_sorted_by_survival_then_position_then_request() -> None:
    surv = torch.tensor([[0.5, 0.5], [0.5, 0.25]], dtype=torch.float64)
    order = [(s.req, s.pos) for s in sorted_slots(surv, [2, 2])]
    assert order == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert [(s.req, s.pos) for s in sorted_slots(surv, [1, 0])] == [(0, 1)]


def test_a_lone_requests_slots_are_ranked_as_the_full_key_ranks_them() -> None:
    from dspark.kernels.budget import rank_slots

    # Its shortcut (no sort: survivals never grow with j) against the key (−a, j) itself, on
    # rows with ties (confidences of 1 and repeated values) and every limit.
    rng = np.random.default_rng(0)
    for _ in range(200):
        conf = rng.choice([0.0, 0.5, 0.9, 1.0, rng.random()], size=(1, 7))
        surv = survivals_of(conf)
        for limit in range(8):
            a, j, r = rank_slots(surv, [limit])
            order = sorted(range(limit), key=lambda i: (-surv[0, i], i))
            assert j.tolist() == [i + 1 for i in order] and r.tolist() == [0] * limit
            assert a.tolist() == [surv[0, i] for i in order]


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


def test_confidence_budget_reads_survivals_from_two_steps_back() -> None:
    cost = CostModel.linear(1.0, 0.3)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    high, low = [[0.95, 0.95, 0.95]], [[0.05, 0.05, 0.05]]
    budgets = []
    for conf in (high,) + (low,) * 8:
        d = drafts_of(conf, ids)
        policy.draft_lengths([3], ids)
        k = policy.choose_budget(d)
        budgets.append(k)
        policy.plan_verification(d, k)
        policy.observe(step_of(ids, [k], [0]))
    # Steps 1 and 2 have no history: the tracker's prior (0.6 per position) gives K = 2.
    # Step 3 reads step 1 (high) and takes all 3, although its own drafts are low. From then on
    # the average of the rows two steps back and earlier sinks by 0.7 per low row: one unlucky
    # block does not stop speculation, a run of them does.
    assert budgets == [2, 2, 3, 3, 3, 3, 1, 0, 0]


def test_stale_row_reads_rows_two_steps_old_and_averages_them() -> None:
    from dspark.coordinator.stale_history import LONG_RUN, SMOOTHING, StaleRow

    row = StaleRow(long_run=True)
    one = np.full(3, 0.9)
    two = np.full(3, 0.1)
    row.push(1, one)
    assert row.value_at(1) is None and row.value_at(2) is None  # not two steps old yet
    np.testing.assert_array_equal(row.value_at(3), one)
    row.push(4, one)
    np.testing.assert_allclose(row.value_at(6), one, rtol=0, atol=1e-15)
    row.push(5, two)  # the next step's row: weight SMOOTHING
    np.testing.assert_allclose(row.value_at(7), SMOOTHING * two + (1 - SMOOTHING) * one,
                               rtol=0, atol=1e-15)
    # The long-run average takes in the same rows, each at LONG_RUN (a new request's prior).
    np.testing.assert_allclose(row.long_run, LONG_RUN * two + (1 - LONG_RUN) * one,
                               rtol=0, atol=1e-15)
    before = np.array(row.value_at(7))
    row.push(20, one)  # a probe after an idle stretch: readable two steps later, not two pushes
    np.testing.assert_array_equal(row.value_at(21), before)
    # 15 steps after the row before it, it all but replaces the average (weight 1 − 0.7^15).
    keep = (1 - SMOOTHING) ** 15
    np.testing.assert_allclose(row.value_at(22), (1 - keep) * one + keep * before,
                               rtol=0, atol=1e-15)


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
    assert (survivals_of(tracker.rates(("r", "new"))) <= 1).all()


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
    for _ in range(200):  # everything gets accepted from now on (the engine reports each
        step = step_of(("z",), [3], [3])  # step to the tracker and the policy alike)
        tracker.observe(step)
        policy.observe(step)
    policy.cost = CostModel.linear(1.0, 0.05)
    lengths = [policy.draft_lengths([3], ("a",))[0] for _ in range(3)]
    assert lengths[-1] == 3


def test_monotone_fit_pools_outliers_instead_of_propagating_them() -> None:
    from dspark.coordinator.cost_model import monotone

    fit = monotone([5.0, 1.0, 1.0, 1.0, 2.0, 3.0])
    assert all(a <= b for a, b in pairwise(fit))
    assert fit[-1] == 3.0 and fit[0] == 2.0  # the spike pools with its neighbours


def test_timed_sizes_are_smoothed_so_no_size_looks_free() -> None:
    from dspark.coordinator.cost_model import monotone, smooth_profile

    rng = np.random.default_rng(0)
    grid = list(range(1, 17)) + list(range(24, 129, 8))
    noisy = [4.0 + 0.25 * g + rng.normal(0, 0.3) for g in grid]  # a CPU: ~linear, noisy
    pooled = monotone(noisy)
    assert any(b - a < 1e-12 for a, b in pairwise(pooled[:16]))  # "free" sizes
    smooth = monotone(smooth_profile(grid, noisy, 16))
    steps = np.diff(smooth[:16])
    assert (steps > 0.1).all() and abs(steps.mean() - 0.25) < 0.05  # no size for free
    # Regression: one low sparse size (24 tokens timed 1.5 ms under the line) made 16 -> 24
    # look nearly free at 4 in flight, and the budget verified drafts that did not pay.
    dip = list(noisy)
    dip[16] -= 1.5
    sparse = monotone(smooth_profile(grid, dip, 16))
    assert (sparse[16] - sparse[15]) / 8 > 0.15 and (sparse[17] - sparse[16]) / 8 > 0.15
    assert np.abs(np.asarray(sparse) - [4.0 + 0.25 * g for g in grid]).max() < 1.5 / 2  # of the dip
    flat_then_rising = [1.0] * 8 + [1.0 + 0.5 * (g - 8) for g in range(9, 17)]  # a GPU
    np.testing.assert_allclose(smooth_profile(list(range(1, 17)), flat_then_rising, 16),
                               flat_then_rising, atol=1e-9)
    # Regression: a per-position cost measured near 0 came out negative at an end of the line.
    near_zero = [0.0, 0.0004, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert min(smooth_profile(list(range(1, 9)), near_zero, 8)) >= 0.0


def test_a_change_of_slope_among_the_dense_sizes_is_kept_only_where_the_timings_need_it() -> None:
    # Regression: the demo target's verify profile (one thread, 5 repeats) came out at 0.30 ms
    # a token between 1 and 8 tokens and 0.03 between 8 and 16, where passes timed again were
    # about linear: noise had set the slope change at the middle knot.
    from dspark.coordinator.cost_model import _knot_fit, smooth_profile

    grid = list(range(1, 17)) + list(range(24, 129, 8))
    xs = np.asarray(grid, dtype=np.float64)
    rng = np.random.default_rng(1)
    cpu = 4.0 + 0.25 * xs + rng.normal(0, 0.3, xs.size)  # ~linear, noisy
    cpu[7] += 0.8  # one high size at the middle knot
    forced, _ = _knot_fit(xs, cpu, [1, 8, 16, 32, 64, 128])
    assert (forced[7] - forced[0]) / 7 - (forced[15] - forced[7]) / 8 > 0.05  # a kink from noise
    smooth = smooth_profile(grid, list(cpu), 16)
    before, after = (smooth[7] - smooth[0]) / 7, (smooth[15] - smooth[7]) / 8
    assert abs(before - after) < 1e-9 and abs(before - 0.25) < 0.03
    # A GPU's pass, flat up to 8 tokens and rising after, keeps its kink through 5% noise.
    truth = np.where(xs <= 8, 1.0, 1.0 + 0.5 * (xs - 8))
    gpu = truth * (1 + rng.normal(0, 0.05, xs.size))
    smooth = np.asarray(smooth_profile(grid, list(gpu), 16))
    assert np.abs(smooth[:16] / truth[:16] - 1).max() < 0.1


def test_vectorised_step_times_equal_scalar_lookup() -> None:
    cost = CostModel("t", verify=(1.0, 1.5, 2.5, 3.0), draft=(0.1, 0.2))
    pos = [0, 1, 2, 3, 4, 0, 2]
    # Candidates verify n, n + 1, ... tokens: from nothing, inside the table, and past it.
    for n in (0, 1, 2, 3, 9):
        expected = [cost.step_time(n + i, 2, p) for i, p in enumerate(pos)]
        times = cost.verify_times(n, len(pos)) + np.array([cost.draft_time(2, p) for p in pos])
        assert times.tolist() == pytest.approx(expected)


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
    # The history holds the two fresh rows, averaged, not zero rows.
    from dspark.coordinator.stale_history import SMOOTHING

    high, mid = (survivals_of(torch.tensor([[c] * 3], dtype=torch.float64))[0] for c in (0.95, 0.5))
    np.testing.assert_allclose(policy.stale_survivals(ids)[0],
                               SMOOTHING * mid + (1 - SMOOTHING) * high, rtol=0, atol=1e-12)


def test_parallel_round_cost_is_charged_only_when_something_is_verified() -> None:
    # Verification is free here; only the drafting round costs. R = 1 with survival .9 at
    # every position: K = 3 earns 1 + .9 + .81 + .729 = 3.44 tokens for 1 + round seconds.
    conf = torch.full((1, 3), 0.9, dtype=torch.float64)
    for round_cost, expected in ((0.5, 3), (3.0, 0)):
        cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(round_cost,))
        policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
        assert policy.best_budget(survivals_of(conf), [3]) == expected


def test_a_stale_row_reads_the_same_whenever_it_is_read() -> None:
    # The batch means' rows are taken in only when a request without rows reads them (or once
    # BATCH_PENDING wait): read late, the averages must equal those read every step.
    from dspark.coordinator.stale_history import StaleRow

    rng = np.random.default_rng(3)
    eager, lazy = StaleRow(long_run=True), StaleRow(long_run=True)
    step = 0
    for _ in range(40):
        step += int(rng.integers(1, 4))  # gaps: idle steps between pushes
        row = np.cumprod(rng.random(4)).tolist()
        eager.push(step, row)
        lazy.push(step, row)
        eager.value_at(step)
    assert lazy.pending > 2 and lazy.value is None  # nothing read yet
    assert lazy.value_at(step) == eager.value_at(step)
    assert lazy.long_run == eager.long_run and lazy.pending == eager.pending


def test_a_new_request_starts_from_the_long_run_row_not_the_last_requests_last_blocks() -> None:
    # Regression: a request without rows of its own read the batch means' recent average,
    # which with one request in flight is the last request's last few blocks. Where those were
    # hard the next request started idle (and, with the probes' backoff it inherited, stayed
    # idle for its whole life: 1 in flight, T = 0, 2 requests of 8 in a round).
    cost = CostModel.linear(1.0, 0.3)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    for step in range(40):
        lengths = policy.draft_lengths([3], ids)
        hard = step >= 30  # the text turns hard for a's last steps
        d = (drafts_of([[0.02 if hard else 0.95] * 3], ids) if any(lengths)
             else skipped_drafts(ids))
        k = policy.choose_budget(d)
        policy.plan_verification(d, k)
        policy.observe(step_of(ids, [k], [0], finished=step == 39))
    assert k == 0  # a's hard blocks idled it
    recent = np.array(policy.history.batch.value_at(40))  # the batch means' recent average
    assert policy.best_budget(recent[None], [3]) == 0  # read as b's row, it would idle b too
    assert policy.draft_lengths([3], ("b",)) == [3]  # the long-run row: b speculates
    np.testing.assert_array_less(recent, policy.history.batch.long_run)


def test_a_parallel_drafter_drafts_only_as_deep_as_the_budget_reaches() -> None:
    # Verify passes cost 1 s; a round 0.5 s for its first position and 0.3 s per further one.
    # At the prior (0.6 per position: survivals .6, .36, .216, ...) Θ(K) = (1 + Σ a)/(1.5 +
    # 0.3(K − 1)) peaks at K = 2 (1.96 / 1.8), so the round drafts 2 positions, not γ = 7.
    cost = CostModel("t", verify=(1.0,) * 16, draft=(0.3,), draft_first=(0.5,))
    policy = make_policy("confidence", 7, cost, AcceptanceTracker(7), a_priori=False)
    assert policy.draft_lengths([7], ("a",)) == [2]
    assert policy.draft_lengths([1], ("a",)) == [1]  # never past the request's own cap


def test_a_round_drafts_only_as_deep_as_the_best_slots_it_verifies() -> None:
    # Verify passes cost 1 s whatever their size; a round 0.2 s for its first position and 1 s
    # for each further one. Request a's survivals (.9, .85, .8, .75) outrank b's (.5, .3, .1,
    # .05), so every prefix of the ranked slots that reaches b's first slot holds a's four:
    # a round of 4 positions. The best prefix verifies a's first slot alone (2.9 tokens in
    # 1.2 s); drafting one position for both and verifying both first slots earns 3.4 in 1.2 s.
    cost = CostModel("t", verify=(1.0,) * 16, draft=(1.0, 1.0), draft_first=(0.2, 0.2))
    policy = make_policy("confidence", 4, cost, AcceptanceTracker(4), a_priori=False)
    surv = np.array([[0.9, 0.85, 0.8, 0.75], [0.5, 0.3, 0.1, 0.05]])
    assert policy.best_plan(surv, [4, 4]) == (2, 1)


def test_a_plan_made_before_drafting_keeps_to_the_depth_its_budget_priced() -> None:
    # The costs of the test above: one position for both requests beats any deeper round. With
    # tracked confidences the plan comes before drafting and the round drafts it; request a
    # turned out easy (its rates above the global ones), so its 2nd slot now outranks b's 1st,
    # and the K = 2 slots taken without the budget's depth would be (2, 0): a round of two
    # positions, priced as one.
    cost = CostModel("t", verify=(1.0,) * 16, draft=(1.0, 1.0), draft_first=(0.2, 0.2))
    tracker = AcceptanceTracker(3)
    policy = make_policy("confidence", 3, cost, tracker, a_priori=True)
    ids = ("a", "b")
    assert policy.draft_lengths([3, 3], ids) == [1, 1]
    for _ in range(8):
        tracker.observe(step_of(("a",), [3], [3]))
    rates = tracker.rates(ids)
    assert rates[0, 0] * rates[0, 1] > rates[1, 0]  # a's 2nd slot outranks b's 1st
    assert policy.draft_lengths([3, 3], ids) == [1, 1]


def test_a_shallow_row_is_continued_with_the_realised_rates_not_zeros() -> None:
    # Regression guard: drafting to depth d < γ must not store zero survivals past d, or the
    # budget (and so the depth) could only ever shrink.
    tracker = AcceptanceTracker(4)
    policy = make_policy("confidence", 4, CostModel.linear(1.0, 0.0), tracker, a_priori=False)
    ids = ("a",)
    policy.draft_lengths([4], ids)
    d = Drafts(ids, torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), None,
               torch.tensor([[0.9, 0.8]], dtype=torch.float64))
    policy.plan_verification(d, policy.choose_budget(d))
    for _ in range(2):  # two steps later the row is readable
        policy.draft_lengths([4], ids)
        skipped = skipped_drafts(ids)
        policy.plan_verification(skipped, policy.choose_budget(skipped))
    g = tracker.global_rates()  # nothing observed: the prior, 0.6 per position
    expected = [0.9, 0.72, 0.72 * g[2], 0.72 * g[2] * g[3]]
    np.testing.assert_allclose(policy.stale_survivals(ids)[0], expected, rtol=0, atol=1e-12)


def test_a_round_that_must_catch_up_pays_for_it_in_the_budget() -> None:
    # Verify 1 s, a steady round 0.5 s, and 0.01 s per row a round must catch up on first. A
    # new request with 400 rows to catch up and 3 tokens left is not worth a round at the
    # prior rates (Θ = 2.18 / (1.5 + 2.9) < 1: its 400 rows spread over 3 / 2.18 steps), where
    # one with nothing to catch up is.
    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,), catch_up=0.01)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    assert policy.draft_lengths([3], ("b",), backlog=[400]) == [0]
    assert policy.draft_lengths([3], ("c",), backlog=[0]) == [3]
    # The rows are taken in once: spread over a long generation (1000 tokens left, ~460 steps
    # at 2.18 tokens a step) they add 0.01 s to a round, and the round is worth it.
    assert policy.draft_lengths([1000], ("d",), backlog=[400]) == [3]
    # A request that drafted in the previous step has only a steady round's backlog.
    d = drafts_of([[0.9] * 3], ("d",))
    policy.plan_verification(d, policy.choose_budget(d))
    assert policy.draft_lengths([3], ("d",), backlog=[400]) == [3]


def test_resuming_after_a_step_without_speculation_needs_a_margin() -> None:
    from dspark.coordinator.scheduler import RESUME_MARGIN

    # Verify 1 s, a round 1.1126 s: at survivals .6, .36, .216 speculating gains 3% of Θ
    # (2.176 / 2.1126 against 1), less than RESUME_MARGIN.
    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(1.1126,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    surv = survivals_of(torch.full((1, 3), 0.6, dtype=torch.float64))
    assert RESUME_MARGIN > 0.03
    assert policy.best_budget(surv, [3]) == 3
    assert policy.best_budget(surv, [3], margin=RESUME_MARGIN) == 0
    # Through the policy: the first step follows no speculation (K = 0 before it): stay idle.
    assert policy.draft_lengths([3], ("a",)) == [0]


def test_an_idle_batch_plans_again_only_when_its_inputs_change() -> None:
    from dspark.coordinator.exploration import PROBE_EVERY
    from dspark.coordinator.scheduler import ConfidencePolicy

    class Counting(ConfidencePolicy):
        """Records the steps it plans and probes at; `replan` makes it plan at every step (the
        reference)."""

        def __init__(self, replan: bool) -> None:
            # Verify 1 s + 0.2 s a token, a drafting round 1 s: speculation pays only at high
            # confidence.
            verify = tuple(1.0 + 0.2 * b for b in range(16))
            cost = CostModel("t", verify=verify, draft=(0.0,), draft_first=(1.0,))
            super().__init__(3, cost, AcceptanceTracker(3), a_priori=False,
                             sequential_drafts=False)
            self.replan, self.planned_at, self.probed_at = replan, [], []
            self.idle_at: set[int] = set()  # steps whose budget before drafting was K = 0

        def draft_lengths(self, caps, req_ids, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            lengths = super().draft_lengths(caps, req_ids, *args, **kwargs)
            if self._idle:
                self.idle_at.add(self._steps)
            return lengths

        def budget_before_drafting(self, req_ids, limits):  # noqa: ANN001, ANN201
            self.planned_at.append(self._steps)
            return super().budget_before_drafting(req_ids, limits)

        def _idle_plan_holds(self, req_ids: tuple[str, ...], limits: list[int]) -> bool:
            return False if self.replan else super()._idle_plan_holds(req_ids, limits)

        def _probed(self, req_ids: tuple[str, ...]) -> set[int]:
            self.probed_at.append(self._steps)
            return super()._probed(req_ids)

    cached, reference = Counting(replan=False), Counting(replan=True)
    steps = 8 * PROBE_EVERY
    joins, easy_from = 41, 61  # a third request joins; then the text turns easy
    decisions = {True: [], False: []}
    for step in range(1, steps + 1):
        ids = ("a", "b", "c") if step >= joins else ("a", "b")
        conf = [[0.95 if step >= easy_from else 0.1] * 3] * len(ids)
        for policy in (cached, reference):
            lengths = policy.draft_lengths([20] * len(ids), ids)
            d = drafts_of(conf, ids) if any(lengths) else skipped_drafts(ids)
            k = policy.choose_budget(d)
            planned = policy.plan_verification(d, k)
            policy.observe(step_of(ids, planned, [0] * len(ids)))
            decisions[policy is cached].append((step, tuple(lengths), k, tuple(planned)))
    assert decisions[True] == decisions[False]  # the same decisions, step by step
    budgets = {step: k for step, _, k, _ in decisions[True]}
    probes = cached.probed_at
    # Probes come only in idle steps (their own K prices a round that is paid: `probe_budget`).
    assert len(probes) >= 3 and all(p in cached.idle_at for p in probes)
    # The first probe into easy text resumes speculation once its rows are two steps old.
    resumed = min(p for p in probes if p >= easy_from) + 2
    assert all(budgets[s] > 0 for s in range(resumed, steps + 1))
    assert reference.planned_at == list(range(1, steps + 1))
    idle = [s for s in cached.planned_at if s < resumed]
    assert len(idle) < resumed // 3  # an idle batch seldom plans again ...
    gaps = [b - a for a, b in pairwise(idle)]
    assert max(gaps) <= PROBE_EVERY  # ... but reads the step-time fit again at least this often
    assert joins in cached.planned_at  # ... and plans for a new batch
    for p in probes:  # ... and when a probe's rows become readable
        assert p + 2 in cached.planned_at


def test_a_batch_idle_only_for_want_of_slots_plans_again_when_it_may_draft() -> None:
    # Regression: the step that prefills a batch gives every request a draft cap of 0 (its
    # drafter has no rows for the prompt yet), so it plans K = 0 for want of slots; that idle
    # plan was kept for the next PROBE_EVERY decode steps, whose caps were not 0 any more.
    verify = tuple(1.0 + 0.05 * b for b in range(64))
    cost = CostModel("t", verify=verify, draft=(0.01,), draft_first=(0.2,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a", "b")
    easy = drafts_of([[0.9] * 3] * 2, ids)
    for _ in range(4):  # speculation pays: a history of easy blocks
        d = easy if any(policy.draft_lengths([3, 3], ids)) else skipped_drafts(ids)
        policy.plan_verification(d, policy.choose_budget(d))
    # The old batch's last step drafts nothing (its caps are spent) ...
    assert policy.draft_lengths([0, 0], ids) == [0, 0]
    policy.plan_verification(skipped_drafts(ids), policy.choose_budget(skipped_drafts(ids)))
    new = ("c", "d")  # ... and a new batch's prompts are in the next pass: a cold step
    assert policy.draft_lengths([0, 0], new, prompt_tokens=200) == [0, 0]
    skipped = skipped_drafts(new)
    assert policy.plan_verification(skipped, policy.choose_budget(skipped)) == [0, 0]
    assert policy.draft_lengths([3, 3], new) == [3, 3]  # the next step may draft, and does
    # A batch idle on its merits keeps its plan while its caps do not grow.
    dear = make_policy("confidence", 3, CostModel.linear(1.0, 5.0), AcceptanceTracker(3),
                       a_priori=False)
    for _ in range(2):  # the second step follows one without a round: its K = 0 is kept
        assert dear.draft_lengths([3, 3], ids) == [0, 0]
        dear.plan_verification(skipped_drafts(ids), dear.choose_budget(skipped_drafts(ids)))
    assert dear._idle_plan_holds(ids, [3, 2]) and not dear._idle_plan_holds(ids, [3, 4])


def test_a_budget_that_drafted_nothing_leaves_the_next_round_cold() -> None:
    # A new request's first step prefills its prompt: its drafter has no rows yet and drafts
    # nothing whatever the budget, so the round after it follows a step without one.
    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.1,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    assert policy.draft_lengths([3], ids) == [3]
    d = skipped_drafts(ids)  # the drafter was not ready
    policy.plan_verification(d, policy.choose_budget(d))
    assert policy.draft_lengths([3], ids) == [3]
    assert policy._cold  # no round ran in the previous step
    d = drafts_of([[0.9] * 3], ids)
    policy.plan_verification(d, policy.choose_budget(d))
    policy.draft_lengths([3], ids)
    assert not policy._cold  # this time one did


def test_a_cold_rounds_premium_is_spread_over_the_steps_left() -> None:
    from dspark.coordinator.step_pricing import RoundInFlight

    # Verify 1 s, a steady round 0.5 s, a cold one 1.5 s (resume scale 3). At the prior rates
    # (survivals .6, .36, .216: 2.18 tokens a step) a lone request with 100 tokens left
    # resumes (its premium spread over ~46 steps); one with 3 left does not (over 1.4 steps:
    # Θ = 2.18 / 2.22 against 1, short of the resume margin).
    def cold_policy() -> BudgetedPolicy:
        cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,))
        policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
        policy.draft_lengths([3], ("a",))
        d = drafts_of([[0.6] * 3], ("a",))
        planned = policy.plan_verification(d, policy.choose_budget(d))
        policy.pricer.in_flight = RoundInFlight(1, 3, steady=False, cold=True, rows=0,
                                          decode_tokens=1 + sum(planned))
        policy.observe_time(2.5, 1 + sum(planned), draft_seconds=1.5, verify_seconds=1.0)
        policy._budget, policy._last_round = 0, 0  # no round in step 1: step 2 runs cold
        return policy

    assert cold_policy().pricer.time_fit(1).resume_scale == pytest.approx(3.0)
    assert cold_policy().draft_lengths([100], ("a",)) == [3]
    assert cold_policy().draft_lengths([3], ("a",)) == [0]


def test_an_idle_batch_with_tracked_rates_plans_again_only_when_they_move() -> None:
    # Planning every idle step cost ~0.4 ms, 7% of a step at 4 in flight (draft model, T = 1).
    from dspark.coordinator.exploration import PROBE_EVERY
    from dspark.coordinator.scheduler import ConfidencePolicy

    class Counting(ConfidencePolicy):
        def __init__(self, replan: bool, tracker: AcceptanceTracker) -> None:
            verify = tuple(1.0 + 0.05 * b for b in range(16))
            cost = CostModel("t", verify=verify, draft=(0.1,), draft_first=(0.3,))
            super().__init__(3, cost, tracker, a_priori=True, sequential_drafts=True)
            self.replan, self.planned_at = replan, []

        def budget_before_drafting(self, req_ids, limits):  # noqa: ANN001, ANN201
            self.planned_at.append(self._steps)
            return super().budget_before_drafting(req_ids, limits)

        def _idle_plan_holds(self, req_ids: tuple[str, ...], limits: list[int]) -> bool:
            return False if self.replan else super()._idle_plan_holds(req_ids, limits)

    trackers = {True: AcceptanceTracker(3), False: AcceptanceTracker(3)}
    cached, reference = Counting(False, trackers[True]), Counting(True, trackers[False])
    for tracker in trackers.values():  # drafts were seldom accepted so far: K = 0
        for _ in range(50):
            tracker.observe(step_of(("z",), [3], [0]))
    steps, joins, easy = 6 * PROBE_EVERY, 31, 61
    decisions = {True: [], False: []}
    for step in range(1, steps + 1):
        ids = ("a", "b", "c") if step >= joins else ("a", "b")
        for policy, key in ((cached, True), (reference, False)):
            if step == easy:  # another request's verified drafts were all accepted
                for _ in range(100):
                    s = step_of(("z",), [3], [3])
                    trackers[key].observe(s)
                    policy.observe(s)
            lengths = policy.draft_lengths([20] * len(ids), ids)
            d = Drafts(ids, torch.zeros(len(ids), max(lengths), dtype=torch.long),
                       torch.tensor(lengths), None, None)
            d = trackers[key].fill(d)
            k = policy.choose_budget(d)
            planned = policy.plan_verification(d, k)
            s = step_of(ids, planned, planned)
            trackers[key].observe(s)
            policy.observe(s)
            decisions[key].append((step, tuple(lengths), k, tuple(planned)))
    assert decisions[True] == decisions[False]  # the same decisions, step by step
    budgets = {step: k for step, _, k, _ in decisions[True]}
    # The rows that moved at `easy` are read two steps later.
    assert all(budgets[s] == 0 for s in range(1, easy + 2)) and budgets[easy + 2] > 0
    idle = [s for s in cached.planned_at if s < easy]
    assert len(idle) < easy // 4  # an idle batch seldom plans again ...
    assert max(b - a for a, b in pairwise(idle)) <= PROBE_EVERY  # ... at least this often
    assert joins in cached.planned_at and easy in cached.planned_at  # ... and when inputs move
