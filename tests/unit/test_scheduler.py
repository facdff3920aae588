"""Scheduler policies on fabricated drafts and step results (no model): case tables."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.scheduler import BudgetedPolicy, make_policy, sorted_slots, survivals_of
from dspark.coordinator.step_time_fit import Fit, StepTimeFit
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


def test_candidate_step_times_equal_the_fit_applied_to_each() -> None:
    # The budget's grouped form (`Fit.candidate_times`) against `Fit.apply` of each candidate,
    # for fits with and without a split of the drafting scale and a cost of rounds' other work.
    rng = np.random.default_rng(1)
    depths = np.array([0, 1, 2, 3, 5, 7, 0, 4])
    verify = rng.random(depths.size)
    first, each = 0.3, 0.07
    for split, busy in ((False, None), (True, None), (True, 0.004), (False, 0.002)):
        fit = Fit(verify_scale=0.8, verify_per_sequence=0.001, draft_scale=1.1, per_request=0.002,
                  resume_scale=1.6, round_per_request=busy,
                  first_scale=1.3 if split else None, further_scale=0.6 if split else None,
                  verify_fixed=0.01, verify_after_round=0.02)
        for num_reqs, cold in ((1, 0.0), (5, 1.0), (12, 0.3)):
            drafting = np.where(depths > 0, first + (depths - 1) * each, 0.0)
            further = np.maximum(depths - 1, 0) * each
            expected = [fit.apply(float(v), float(d), num_reqs, cold, float(f), bool(n > 0))
                        for v, d, f, n in zip(verify, drafting, further, depths)]
            got = fit.candidate_times(verify, depths, first, each, num_reqs, cold)
            assert got.tolist() == pytest.approx(expected)


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


def step_of(req_ids, planned, accepted, finished: bool = False) -> StepState:
    reason = "length" if finished else None
    return StepState(0, sum(planned), tuple(
        RequestStep(r, p, p, a, (1,) * (a + 1), 10, reason)
        for r, p, a in zip(req_ids, planned, accepted)))


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
    before = row.value_at(7)
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
    assert all(a <= b for a, b in zip(fit, fit[1:]))
    assert fit[-1] == 3.0 and fit[0] == 2.0  # the spike pools with its neighbours


def test_timed_sizes_are_smoothed_so_no_size_looks_free() -> None:
    from dspark.coordinator.cost_model import monotone, smooth_profile

    rng = np.random.default_rng(0)
    grid = list(range(1, 17)) + list(range(24, 129, 8))
    noisy = [4.0 + 0.25 * g + rng.normal(0, 0.3) for g in grid]  # a CPU: ~linear, noisy
    pooled = monotone(noisy)
    assert any(b - a < 1e-12 for a, b in zip(pooled[:16], pooled[1:16]))  # "free" sizes
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


def test_vectorised_step_times_equal_scalar_lookup() -> None:
    cost = CostModel("t", verify=(1.0, 1.5, 2.5, 3.0), draft=(0.1, 0.2))
    pos = [0, 1, 2, 3, 4, 0, 2]
    # Candidates verify n, n + 1, ... tokens: from nothing, inside the table, and past it.
    for n in (0, 1, 2, 3, 9):
        expected = [cost.step_time(n + i, 2, p) for i, p in enumerate(pos)]
        times = cost.verify_times(n, len(pos)) + np.array([cost.draft_time(2, p) for p in pos])
        assert times.tolist() == pytest.approx(expected)


def skipped_drafts(ids: tuple[str, ...]) -> Drafts:
    """What a parallel drafter returns when asked for no drafts: width 0, zero counts."""
    n = len(ids)
    return Drafts(ids, torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                  None, torch.zeros(n, 0, dtype=torch.float64))


def test_parallel_drafter_skips_its_round_when_the_budget_is_zero_but_probes() -> None:
    from dspark.coordinator.scheduler import PROBE_EVERY, probe_interval

    every = probe_interval(2)
    assert every == PROBE_EVERY // 2  # two requests: probed twice as often as four or more
    cost = CostModel.linear(1.0, 2.0)  # verification so dear that K = 0 at the prior rates
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a", "b")
    asked = []
    for _ in range(7 * every):
        lengths = policy.draft_lengths([3, 3], ids)
        asked.append(lengths)
        # The probes find a drafter not worth its round (c = 0.1): K stays 0 throughout.
        d = drafts_of([[0.1, 0.1, 0.1]] * 2, ids) if any(lengths) else skipped_drafts(ids)
        k = policy.choose_budget(d)
        assert k == 0 and policy.plan_verification(d, k) == [0, 0]
        policy.observe(step_of(ids, [0, 0], [0, 0]))
    probes = [i + 1 for i, lengths in enumerate(asked) if any(lengths)]
    # Each probe that finds speculation still not worth it doubles the gap to the next.
    assert probes == [every, 3 * every, 7 * every]
    assert probe_interval(2, idle_probes=2) == 4 * every
    assert all(lengths == [3, 3] for lengths in asked if any(lengths))  # 2 <= PROBE_REQUESTS


def test_a_probe_verifies_its_drafts_when_its_paid_round_makes_that_worth_it() -> None:
    # Verify 1 s + 0.3 s a token beyond the first, a drafting round 2 s; two requests at the
    # prior rates (0.6 a position: survivals .6, .36, .216). Speculating does not repay the
    # round: at best 4.35 tokens in 5.1 s against 2 in 1.3 s. But a probe's round is paid
    # whatever it verifies, and beside it two slots per request gain (3.92 tokens in 4.5 s
    # against 2 in 3.3 s), while the third does not (4.35 in 5.1 s).
    from dspark.coordinator.scheduler import probe_interval

    cost = CostModel("t", verify=tuple(1.0 + 0.3 * b for b in range(16)), draft=(0.0,),
                     draft_first=(2.0,))
    ids = ("a", "b")
    for live in (0.05, 0.99):  # the probe's K is the same whatever its drafts' confidences
        policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
        budgets, lengths = [], []
        for _ in range(probe_interval(2)):
            lengths.append(policy.draft_lengths([3, 3], ids))
            d = drafts_of([[live] * 3] * 2, ids) if any(lengths[-1]) else skipped_drafts(ids)
            budgets.append(policy.choose_budget(d))
            planned = policy.plan_verification(d, budgets[-1])
            assert policy._idle  # a probe that verifies is still an idle step
        assert lengths[-1] == [3, 3] and not any(map(any, lengths[:-1]))  # the probe
        assert budgets == [0] * (len(budgets) - 1) + [4]
        assert planned == [2, 2]  # the slots: each request's first two drafts
    # Probes that make verifying not worth it even beside a paid round verify nothing.
    dear = CostModel("t", verify=tuple(1.0 + 5.0 * b for b in range(16)), draft=(0.0,),
                     draft_first=(2.0,))
    policy = make_policy("confidence", 3, dear, AcceptanceTracker(3), a_priori=False)
    assert policy.probe_budget(ids, [3, 3]) == 0
    assert policy.probe_budget(ids, [0, 0]) == 0  # nothing drafted: nothing to verify


def test_probes_of_a_large_batch_take_a_few_requests_in_turn() -> None:
    from dspark.coordinator.scheduler import PROBE_EVERY, PROBE_REQUESTS

    # Verifying costs 5 s a token: even the probes' 0.9 confidences never make K > 0.
    policy = make_policy("confidence", 3, CostModel.linear(1.0, 5.0), AcceptanceTracker(3),
                         a_priori=False)
    ids = tuple(f"r{i}" for i in range(3 * PROBE_REQUESTS))
    probed = []
    for _ in range(7 * PROBE_EVERY):  # probes at 16, 48 and 112 (the gap doubles)
        lengths = policy.draft_lengths([3] * len(ids), ids)
        d = drafts_of([[0.9] * 3] * len(ids), ids) if any(lengths) else skipped_drafts(ids)
        d = Drafts(ids, d.token_ids, torch.tensor(lengths), None, d.confidences)
        policy.plan_verification(d, policy.choose_budget(d))
        if any(lengths):
            probed.append({i for i, n in enumerate(lengths) if n})
    assert [len(p) for p in probed] == [PROBE_REQUESTS] * 3
    # Later probes keep to the requests drafted last: their drafter context is nearly complete,
    # where a request never drafted would first take in its whole prompt.
    assert probed[1] == probed[0] and probed[2] == probed[0]
    policy.observe(step_of([ids[i] for i in probed[0]], [0] * PROBE_REQUESTS,
                           [0] * PROBE_REQUESTS, finished=True))
    rest = tuple(r for i, r in enumerate(ids) if i not in probed[0])
    later = []
    for _ in range(8 * PROBE_EVERY):  # those finished: the next probe takes others
        lengths = policy.draft_lengths([3] * len(rest), rest)
        d = drafts_of([[0.9] * 3] * len(rest), rest) if any(lengths) else skipped_drafts(rest)
        d = Drafts(rest, d.token_ids, torch.tensor(lengths), None, d.confidences)
        policy.plan_verification(d, policy.choose_budget(d))
        if any(lengths):
            later.append(lengths)
    assert later and sum(1 for n in later[0] if n) == PROBE_REQUESTS


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


def test_a_lone_request_idled_by_bad_blocks_speculates_again_after_a_good_probe() -> None:
    # Regression: the history read rows two *pushes* back, so for a lone request whose budget
    # fell to 0 a probe's row waited for the next probe. Rows are now read two *steps* after
    # they were drafted, and a lone request is probed every probe_interval(1) steps.
    from dspark.coordinator.scheduler import PROBE_EVERY, probe_interval

    every = probe_interval(1)
    assert every < PROBE_EVERY
    cost = CostModel.linear(1.0, 0.3)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    # The prior rates speculate at steps 1 and 2, until step 1's hard row is two steps old; the
    # first probe comes `every` steps after that round, and finding the text still hard it
    # doubles the gap to the second.
    first = 2 + every
    second = first + 2 * every
    budgets, probes = [], []
    for step in range(1, second + 4):
        lengths = policy.draft_lengths([3], ids)
        good = step >= second  # the text turns easy at the second probe
        if any(lengths):
            probes.append(step)
        d = drafts_of([[0.95 if good else 0.02] * 3], ids) if any(lengths) else skipped_drafts(ids)
        k = policy.choose_budget(d)
        budgets.append(k)
        policy.plan_verification(d, k)
        policy.observe(step_of(ids, [k], [0]))
    assert probes[:4] == [1, 2, first, second]  # the first probe found the text still hard ...
    assert budgets[second - 2] == 0  # ... so the request stayed idle until then
    assert budgets[second + 1] > 0  # two steps after the good probe (steps are 1-based)
    # Speculating again resets the backoff: the next idle stretch is probed after `every`.
    assert policy._idle_probes == 0


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
    recent = policy._global_history.value
    assert policy.best_budget(recent[None], [3]) == 0  # read as b's row, it would idle b too
    assert policy.draft_lengths([3], ("b",)) == [3]  # the long-run row: b speculates
    np.testing.assert_array_less(recent, policy._global_history.long_run)


def test_unprofiled_step_time_is_learned_and_changes_the_budget() -> None:
    # The profile: a verify pass costs 1 s whatever B, a drafting round 0.5 s. With survivals
    # (.3, .09, .027) speculating does not pay: Θ(0) = 1/1 > Θ(3) = 1.417/1.5. When every step
    # really takes 2 s more than profiled (engine work, remote calls), Θ(0) = 1/3 < 1.417/3.5.
    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    surv = survivals_of(torch.full((1, 3), 0.3, dtype=torch.float64))
    assert policy.best_budget(surv, [3]) == 0
    ids = ("a",)
    for _ in range(300):
        lengths = policy.draft_lengths([3], ids)
        d = drafts_of([[0.3] * 3], ids) if any(lengths) else skipped_drafts(ids)
        planned = policy.plan_verification(d, policy.choose_budget(d))
        verify = cost.verify_time(1 + sum(planned))
        drafting = cost.draft_time(1, int(any(lengths)))
        policy.observe_time(verify + drafting + 2.0, 1 + sum(planned), drafting, verify)
    fit = policy.time_fit(1, sampled=False)
    assert fit.per_request == pytest.approx(2.0)
    assert fit.verify_scale == pytest.approx(1.0) and fit.draft_scale == pytest.approx(1.0)
    assert policy.time_fit(1, sampled=True) == Fit()  # sampling batches: apart
    assert policy.time_fit(2, sampled=False) == Fit()  # other batch sizes: apart
    assert policy.best_budget(surv, [3]) == 3


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


def test_step_time_fit_is_kept_per_kind_of_batch_and_follows_a_faster_machine() -> None:
    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a", "b")

    def run(verify_scale: float, draft_scale: float, other: float, steps: int) -> None:
        for _ in range(steps):  # confidences 0.9: K > 0, the drafter drafts every step
            lengths = policy.draft_lengths([3, 3], ids)
            d = drafts_of([[0.9] * 3] * 2, ids) if any(lengths) else skipped_drafts(ids)
            planned = policy.plan_verification(d, policy.choose_budget(d))
            verify = verify_scale * cost.verify_time(2 + sum(planned))
            drafting = draft_scale * cost.draft_time(2, max(lengths))
            policy.observe_time(verify + drafting + other, 2 + sum(planned), drafting, verify)

    run(1.0, 1.0, 3.0, 300)
    assert policy.time_fit(2, sampled=False).per_request == pytest.approx(1.5)  # 3 s / 2
    assert policy.time_fit(3, sampled=False) == policy.time_fit(2, sampled=False)  # same bucket
    assert policy.time_fit(4, sampled=False) == Fit()
    # The machine now verifies twice as fast as when profiled, and drafts at 0.8 of the profile.
    run(0.5, 0.8, 0.02, 800)
    fit = policy.time_fit(2, sampled=False)
    assert fit.verify_scale == pytest.approx(0.5, rel=0.1)
    assert fit.draft_scale == pytest.approx(0.8, rel=0.1)
    assert fit.per_request == pytest.approx(0.01, rel=0.01)


def test_prompt_tokens_of_a_step_are_profiled_not_learned_as_overhead() -> None:
    # Regression: a step that prefilled new prompts was compared with the profiled time of
    # its drafts alone, and its prompt work entered the learned overhead as a large spike.
    cost = CostModel.linear(0.001, 0.001)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a", "b")
    policy.draft_lengths([3, 3], ids)
    d = skipped_drafts(ids)
    planned = policy.plan_verification(d, policy.choose_budget(d))
    assert planned == [0, 0]
    prompt_tokens = 500  # two prompts of 250 tokens: 0.501 s profiled, no drafts
    profiled = cost.step_time(prompt_tokens)
    policy.observe_time(profiled, prompt_tokens, 0.0, profiled)
    # Measured as profiled: the fit stays the identity (a spike would read as a slow machine).
    fit = policy.time_fit(2, sampled=False)
    assert fit.verify_scale == pytest.approx(1.0) and fit.draft_scale == 1.0
    assert fit.per_request == pytest.approx(0.0, abs=1e-9)


def test_step_time_fit_reads_scales_and_other_work_apart_and_forgets() -> None:
    fit = StepTimeFit()
    for r in (1, 3, 2, 5) * 50:  # verify at 0.6x the profile, drafting at 1.3x, 3 ms/request
        verify, drafting = 0.01 + 0.002 * r, 0.004 * r
        fit.add(verify, drafting, r, 0.6 * verify + 1.3 * drafting + 0.003 * r,
                0.6 * verify, 1.3 * drafting)
    assert fit.fit.verify_scale == pytest.approx(0.6, rel=0.1)
    assert fit.fit.draft_scale == pytest.approx(1.3, rel=0.1)
    assert fit.fit.per_request == pytest.approx(0.003)
    for i in range(400):  # verify slows to 1.5x the profile: the old speed is forgotten
        x = 0.01 * (1 + i % 3)
        fit.add(x, 0.0, 1, 1.5 * x + 0.003, 1.5 * x, 0.0)
    assert fit.fit.verify_scale == pytest.approx(1.5, rel=0.1)
    assert fit.fit.verify_fixed < 0.001  # against 0.005 for a pass's fixed cost (below)
    assert fit.fit.apply(0.01, 0.0, 1) == pytest.approx(0.018, rel=0.1)
    # One pass size throughout cannot tell a slower token from a dearer pass: the scale keeps
    # its prior (the profile's slope) and the pass's fixed cost takes the excess; a pass of
    # that size is priced as measured either way.
    one_size = StepTimeFit()
    for _ in range(400):
        one_size.add(0.01, 0.0, 1, 0.018, 0.015, 0.0)
    assert one_size.fit.verify_scale == pytest.approx(1.0, rel=0.01)
    assert one_size.fit.verify_fixed == pytest.approx(0.005, rel=0.02)
    assert one_size.fit.apply(0.01, 0.0, 1) == pytest.approx(0.018, rel=0.02)
    clock_skew = StepTimeFit()
    clock_skew.add(0.01, 0.0, 1, 0.009, 0.0095, 0.0)  # calls timed longer than the whole step
    assert clock_skew.fit.per_request == 0.0
    assert clock_skew.fit.draft_scale == 1.0  # nothing drafted yet: no evidence either way


def test_rounds_that_catch_up_idle_steps_stay_out_of_the_step_time_fit() -> None:
    # Regression: a probe's round first takes in every row its request missed while idle (over
    # Ray, a whole prompt's hidden states), several times the profiled round; learned as
    # "drafting is 4x dearer" it kept the budget at 0 for good.
    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    catch_ups, drafted_before = 0, False
    for _ in range(128):
        lengths = policy.draft_lengths([3], ids)
        d = drafts_of([[0.05] * 3], ids) if any(lengths) else skipped_drafts(ids)
        planned = policy.plan_verification(d, policy.choose_budget(d))
        verify = cost.verify_time(1 + sum(planned))
        # A round after an idle step catches up: 20x the profile; a steady one takes 0.5 s.
        drafting = (0.5 if drafted_before else 10.0) if any(lengths) else 0.0
        catch_ups += any(lengths) and not drafted_before
        drafted_before = any(lengths)
        policy.observe_time(verify + drafting, 1 + sum(planned), drafting, verify)
    assert catch_ups >= 5  # probes happened (at 4, 12, 28, 60 and 124: the gap doubles) ...
    fit = policy.time_fit(1, sampled=False)
    assert fit.draft_scale == pytest.approx(1.0)  # ... and none of them entered the fit
    assert fit.per_request == pytest.approx(0.0)  # nor as unexplained time


def test_one_outlier_cannot_set_a_scale() -> None:
    # Regression: a remote draft actor's first real round took seconds (78x its profile); as
    # the only drafting step measured it set the draft scale, and K stayed 0 for good.
    fit = StepTimeFit()
    fit.add(0.01, 0.03, 4, 0.01 + 78 * 0.03, 0.01, 78 * 0.03)
    assert fit.fit.draft_scale == pytest.approx(4.0)  # capped at MAX_RATIO
    for _ in range(5):  # a few ordinary rounds outweigh it
        fit.add(0.01, 0.03, 4, 0.04, 0.01, 0.03)
    assert fit.fit.draft_scale < 2.0


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


def test_a_cold_round_after_idle_steps_costs_its_measured_resume_scale() -> None:
    from dspark.coordinator.step_time_fit import MAX_RATIO

    fit = StepTimeFit()
    assert fit.fit.resume_scale == 1.0  # nothing measured: the profile
    fit.add_resume(0.5, 1.5)
    assert fit.fit.resume_scale == pytest.approx(3.0)
    assert fit.fit.apply(1.0, 0.5, 1, cold=True) == pytest.approx(2.5)
    assert fit.fit.apply(1.0, 0.5, 1) == pytest.approx(1.5)  # a steady round keeps its scale
    outlier = StepTimeFit()
    outlier.add_resume(0.5, 100.0)
    assert outlier.fit.resume_scale == pytest.approx(MAX_RATIO)
    # Verify 1 s, a round 0.5 s: at the prior rates (survivals .6, .36, .216) speculating pays
    # when the drafter is warm (Θ = 2.18 / 1.5), not when its round runs 3x dearer after
    # idle steps (2.18 / 2.5 < 1).
    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    assert policy.draft_lengths([3], ids) == [3]  # warm: nothing measured yet
    d = drafts_of([[0.6] * 3], ids)
    planned = policy.plan_verification(d, policy.choose_budget(d))
    from dspark.coordinator.scheduler import RoundInFlight

    # As if this round had followed idle steps:
    policy._in_flight = RoundInFlight(1, 3, steady=False, cold=True, rows=0,
                                      decode_tokens=1 + sum(planned))
    policy.observe_time(1.0 + 1.5, 1 + sum(planned), draft_seconds=1.5, verify_seconds=1.0)
    assert policy.time_fit(1).resume_scale == pytest.approx(3.0)
    surv = survivals_of(torch.full((1, 3), 0.6, dtype=torch.float64))
    policy._cold = True
    assert policy.best_budget(surv, [3]) == 0
    policy._cold = False
    assert policy.best_budget(surv, [3]) == 3


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
    from dspark.coordinator.scheduler import PROBE_EVERY, ConfidencePolicy

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
    gaps = [b - a for a, b in zip(idle, idle[1:])]
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


def test_only_steady_rounds_set_the_drafting_scale_and_other_sizes_borrow_it() -> None:
    fit = StepTimeFit()
    for _ in range(20):  # rounds that caught up first: 3x their profile, a bound only
        fit.add(0.01, 0.02, 1, 0.07, 0.01, 0.06, steady=False)
    assert not fit.knows_drafting and fit.fit.draft_scale == 1.0
    for _ in range(20):  # steady rounds at half their profile
        fit.add(0.01, 0.02, 1, 0.02, 0.01, 0.01)
    assert fit.knows_drafting and fit.fit.draft_scale == pytest.approx(0.5)
    # A catching-up round that still beats its profile bounds a steady one: it counts.
    faster = StepTimeFit()
    faster.add(0.01, 0.02, 1, 0.015, 0.01, 0.005, steady=False)
    assert faster.knows_drafting and faster.fit.draft_scale == pytest.approx(0.25)
    # Through the policy: a batch size without a steady round reads the nearest size's scale.
    cost = CostModel("t", verify=(1.0,) * 64, draft=(0.0,) * 8, draft_first=(0.5,) * 8)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    policy._fits[(False, (4).bit_length())] = fit
    assert policy.time_fit(1, sampled=False).draft_scale == pytest.approx(0.5)
    assert policy.time_fit(1, sampled=True).draft_scale == 1.0  # another kind of batch
    own = StepTimeFit()
    for _ in range(5):
        own.add(0.01, 0.02, 1, 0.026, 0.01, 0.016)
    policy._fits[(False, 1)] = own
    assert policy.time_fit(1, sampled=False).draft_scale == pytest.approx(0.8)
    # A round's cost that grows with the batch: what carries over is the excess in seconds.
    # One request's rounds take 1 s where profiled at 0.5; a round of 8, profiled at 4 s,
    # is priced 4.5 s (scale 1.125), not 8 s (the ratio 2.0).
    growing = CostModel("t", verify=(1.0,) * 64, draft=(0.0,) * 8,
                        draft_first=tuple(0.5 * n for n in range(1, 9)))
    policy = make_policy("confidence", 3, growing, AcceptanceTracker(3), a_priori=False)
    alone = StepTimeFit()
    for _ in range(5):
        alone.add(0.01, 0.5, 1, 1.01, 0.01, 1.0)
    policy._fits[(False, 1)] = alone
    assert policy.time_fit(1, sampled=False).draft_scale == pytest.approx(2.0)
    assert policy.time_fit(8, sampled=False).draft_scale == pytest.approx(1.125)


def test_drafting_fit_prices_a_rounds_first_and_further_positions_apart() -> None:
    # Rounds of depths 1..7, profiled at 7 ms for the first position and 0.5 ms for each
    # further one, measured at 1.1x the first and 2x the further ones (a deep round's
    # positions dearer live than profiled): the split comes back, and a deep round is priced
    # as measured where the whole round's scale alone under-prices it.
    first, each = 0.007, 0.0005
    fit = StepTimeFit()
    for i in range(300):
        d = 1 + i % 7
        f, e = first, (d - 1) * each
        fit.add(0.01, f + e, 4, 0.01 + 1.1 * f + 2.0 * e, 0.01, 1.1 * f + 2.0 * e, further=e)
    assert fit.fit.first_scale == pytest.approx(1.1, rel=0.03)
    assert fit.fit.further_scale == pytest.approx(2.0, rel=0.05)
    deep = fit.fit.apply(0.0, first + 6 * each, 1, further=6 * each)
    assert deep == pytest.approx(1.1 * first + 12 * each, rel=0.01)
    assert fit.fit.draft_scale * (first + 6 * each) < 0.95 * deep  # one scale: too cheap
    # One depth throughout: nothing tells the two apart, and both take the common scale.
    same = StepTimeFit()
    for _ in range(100):
        same.add(0.01, first + 4 * each, 4, 0.02, 0.01, 1.3 * (first + 4 * each),
                 further=4 * each)
    assert same.fit.first_scale == pytest.approx(1.3)
    assert same.fit.further_scale == pytest.approx(1.3)
    # Through the policy: verify passes 1 s flat, a round 0.5 s + 0.1 s a further position,
    # conditional confidences 0.8. At the profile Θ peaks at the whole block (K = 7); with
    # further positions measured at 3x their profile it peaks at K = 3 or 4, and the round
    # drafts no deeper.
    cost = CostModel("t", verify=(1.0,) * 16, draft=(0.1,), draft_first=(0.5,))
    policy = make_policy("confidence", 7, cost, AcceptanceTracker(7), a_priori=False)
    assert isinstance(policy, BudgetedPolicy)
    policy._cold = False
    surv = survivals_of(torch.full((1, 7), 0.8, dtype=torch.float64))
    assert policy.best_plan(surv, [7]) == (7, 7)
    learned = StepTimeFit()
    for i in range(300):
        d = 1 + i % 7
        e = (d - 1) * 0.1
        learned.add(1.0, 0.5 + e, 1, 1.5 + 4 * e, 1.0, 0.5 + 3 * e, further=e)
    policy._fits[(False, 1)] = learned
    assert policy.best_plan(surv, [7])[1] in (3, 4)


def test_verify_fit_reads_a_fixed_cost_and_a_cost_of_drafts_apart_from_the_slope() -> None:
    # Profiled passes of B tokens: 5 ms + 0.35 ms a token. Live: 1.5 ms more a pass, 0.8 ms
    # more when it verifies drafts, and each token as profiled. Fitted as one scale through
    # idle passes (B = 1) and passes of ~5 tokens, a token looked 0.47 ms and deep plans dear.
    def profiled(b: int) -> float:
        return 0.005 + 0.00035 * b

    fit = StepTimeFit()
    for i in range(300):
        b = 1 if i % 3 == 0 else 2 + i % 7  # idle passes and passes of 1..7 drafts
        live = profiled(b) + 0.0015 + 0.0008 * (b > 1)
        fit.add(profiled(b), 0.0, 1, live, live, 0.0, after_round=b > 1)
    assert fit.fit.verify_scale == pytest.approx(1.0, rel=0.03)
    assert fit.fit.verify_fixed == pytest.approx(0.0015, rel=0.05)
    assert fit.fit.verify_after_round == pytest.approx(0.0008, rel=0.05)
    marginal = fit.fit.verify_time(profiled(8), 1, True) - fit.fit.verify_time(profiled(5), 1, True)
    assert marginal == pytest.approx(3 * 0.00035, rel=0.05)


def test_passes_after_a_catch_up_round_stay_out_of_the_verify_fit() -> None:
    # Steady steps: verify as profiled. A pass after a round that caught up runs 3x (the round
    # evicted the target's weights), a pass that also prefilled a prompt at half its profile:
    # neither moves the verify fit.
    fit = StepTimeFit()
    for i in range(200):
        fit.add(0.01, 0.004, 2, 0.014, 0.01, 0.004)
        if i % 4 == 0:
            fit.add(0.01, 0.004, 2, 0.034, 0.03, 0.0035, steady=False)  # beat its profile
        if i % 5 == 0:
            fit.add(0.05, 0.004, 2, 0.029, 0.025, 0.004, prefill=True)
    assert fit.fit.verify_time(0.01, 2) == pytest.approx(0.01, rel=0.02)
    # Through the policy: a cold round's verify excess joins the resume premium.
    from dspark.coordinator.scheduler import RoundInFlight

    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    assert isinstance(policy, BudgetedPolicy)
    policy._sampled = False
    policy._in_flight = RoundInFlight(1, 3, steady=False, cold=True, rows=0, decode_tokens=4)
    # The round took its profile (0.5 s) and the pass 1 s more than a steady pass (1 s).
    policy.observe_time(2.5, 4, draft_seconds=0.5, verify_seconds=2.0)
    fit1 = policy.time_fit(1)
    assert fit1.resume_scale == pytest.approx(3.0)  # (0.5 + 1.0) / 0.5
    assert fit1.verify_time(1.0, 1, True) == pytest.approx(1.0)  # the steady fit: untouched


def test_a_verify_pass_costs_per_sequence_beyond_its_profiled_tokens() -> None:
    # The profile times one sequence of B tokens; a live pass of R sequences also pays per
    # sequence. Passes at 0.9x the profile plus 0.6 ms a sequence beyond the first, over
    # varied batch and pass sizes: both parts come back, and a token costs 0.9x its profile.
    def profiled(b: int) -> float:
        return 0.0035 + 0.00016 * b

    fit = StepTimeFit()
    for i in range(400):
        r, k = 1 + i % 16, (i * 7) % 40
        fit.add(profiled(r + k), 0.0, r, 0.0, 0.9 * profiled(r + k) + 0.0006 * (r - 1), 0.0)
    assert fit.fit.verify_scale == pytest.approx(0.9, rel=0.03)
    assert fit.fit.verify_per_sequence == pytest.approx(0.0006, rel=0.05)
    marginal = fit.fit.apply(profiled(16 + 64), 0.0, 16) - fit.fit.apply(profiled(16), 0.0, 16)
    assert marginal == pytest.approx(0.9 * 64 * 0.00016, rel=0.05)
    # One batch size and pass size throughout: the two cannot be told apart, and the ridge
    # gives the scale its prior (single requests' speed) and the rest to the sequences.
    same = StepTimeFit()
    for _ in range(200):
        same.add(profiled(16), 0.0, 16, 0.0, 0.8 * profiled(16) + 0.0006 * 15, 0.0,
                 prior_scale=0.8)
    assert same.fit.verify_scale == pytest.approx(0.8, rel=0.02)
    assert same.fit.verify_per_sequence == pytest.approx(0.0006, rel=0.05)


def test_the_cost_per_sequence_does_not_price_speculation_out_of_a_large_batch() -> None:
    # Regression: one verify scale read a per-sequence cost as a dearer token. Profile: a pass
    # of B tokens of one sequence 1 + 0.1 B, a drafting round 2 at any depth; live passes of 8
    # requests cost 1 more per sequence beyond the first (8.8 for 8 tokens). Read as a scale
    # (8.8 / 1.8 = 4.9: 0.49 a token), no K beats plain decoding at 0.6 a position; per
    # sequence, a token costs its profiled 0.1 and 8 slots give Θ 12.8 / 11.6 against 8 / 8.8.
    cost = CostModel("t", verify=tuple(1.0 + 0.1 * b for b in range(1, 65)), draft=(0.0,),
                     draft_first=(2.0,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = tuple(f"r{i}" for i in range(8))
    for _ in range(100):  # idle steps: K = 0 passes only
        policy.draft_lengths([3] * 8, ids)
        d = skipped_drafts(ids)
        planned = policy.plan_verification(d, policy.choose_budget(d))
        verify = cost.verify_time(8 + sum(planned)) + 1.0 * 7
        policy.observe_time(verify, 8 + sum(planned), 0.0, verify)
    fit = policy.time_fit(8)
    assert fit.verify_scale == pytest.approx(1.0, rel=0.02)
    assert fit.verify_per_sequence == pytest.approx(1.0, rel=0.02)
    surv = survivals_of(torch.full((8, 3), 0.6, dtype=torch.float64))
    assert policy.best_budget(surv, [3] * 8) > 0
    policy._fits[(False, 4)]._fit = Fit(verify_scale=8.8 / 1.8)  # the scale alone, as before
    assert policy.best_budget(surv, [3] * 8) == 0


@pytest.mark.parametrize("name", ["confidence", "equal"])
def test_a_step_that_prefills_prices_its_drafts_against_its_whole_pass(name: str) -> None:
    # Verify 1 + 0.01 B (B the pass's tokens), a drafting round 2. Four requests at 0.6 a
    # position: in a decode step Θ(0) = 4 / 1.04 beats every K (the round costs twice the
    # pass). A step whose pass also prefills 600 prompt tokens pays 7.04 whatever it drafts,
    # and there 4 slots give (4 + 2.4) / 9.08 against 4 / 7.04.
    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 1025)), draft=(0.0,),
                     draft_first=(2.0,))
    ids = ("a", "b", "c", "d")
    conf = [[0.6] * 3] * 4
    budgets = {}
    for prompt_tokens in (0, 600):
        policy = make_policy(name, 3, cost, AcceptanceTracker(3), a_priori=False)
        policy.draft_lengths([3] * 4, ids, prompt_tokens=prompt_tokens)
        budgets[prompt_tokens] = policy.choose_budget(drafts_of(conf, ids))
    assert budgets[0] == 0 and budgets[600] > 0
    # After a step without a round, a prompt resumes speculation only when that step alone
    # repays the switching costs, here the rows each drafter must take in first: 400 a request
    # at 5 ms a row (8 s) do not pay beside a 7 s pass, though spread over the ~46 steps each
    # request has left they would. Without a backlog, the same step resumes.
    cost = replace(cost, catch_up=0.005)
    for backlog, resumes in ((400, False), (0, True)):
        policy = make_policy(name, 3, cost, AcceptanceTracker(3), a_priori=False)
        assert policy.draft_lengths([100] * 4, ids) == [0] * 4  # a decode step: no round
        policy.plan_verification(skipped_drafts(ids), policy.choose_budget(skipped_drafts(ids)))
        lengths = policy.draft_lengths([100] * 4, ids, backlog=[backlog] * 4, prompt_tokens=600)
        assert (sum(lengths) > 0) == resumes, (backlog, lengths)
        assert (policy.choose_budget(drafts_of(conf, ids)) > 0) == resumes
    # Algorithm 1 drafts before it decides (the round is in every Θ alike); its Θ too divides
    # by the whole pass.
    sync = make_policy("confidence-sync", 3, cost, AcceptanceTracker(3), a_priori=False)
    sync.draft_lengths([3] * 4, ids, prompt_tokens=600)
    assert sync.step_time(4, [1, 0, 0, 0], depth=3) == pytest.approx(cost.verify_time(605) + 2.0)


def test_time_is_priced_at_the_runs_own_rate_once_steps_were_timed() -> None:
    # Regression: a step with a prompt in its pass has a long base and a low ratio of its own,
    # and maximising that ratio took drafts whose tokens came slower than the run's rate (draft
    # model, 4 in flight, T = 1: 0.86x `off`). Verify 1 + 0.01 B, a round 2 s; four requests
    # at 0.6 a position. Beside 600 prompt tokens, 4 slots give (4 + 2.4) / 9.08 against
    # 4 / 7.04 of the step alone, but 2.4 tokens for 2.04 s is under the run's 3.8 a second.
    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 1025)), draft=(0.0,),
                     draft_first=(2.0,))
    ids = ("a", "b", "c", "d")
    conf = [[0.6] * 3] * 4
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    assert policy.price_of_time(4) is None  # nothing timed yet: the step's own ratio
    policy.draft_lengths([3] * 4, ids, prompt_tokens=600)
    assert policy.choose_budget(drafts_of(conf, ids)) > 0
    # Steps of this batch size committed 4 tokens in 1.04 s (the engine reports each step's
    # commit to `observe` before timing it).
    for _ in range(3):
        policy.draft_lengths([3] * 4, ids)
        d = skipped_drafts(ids)
        planned = policy.plan_verification(d, policy.choose_budget(d))
        policy.observe(step_of(ids, planned, [0] * 4))
        policy.observe_time(1.04, 4, 0.0, 1.04)
    assert policy.price_of_time(4) == pytest.approx(4 / 1.04)
    assert policy.price_of_time(16) is None  # another size's steps are another rate
    policy.draft_lengths([3] * 4, ids, prompt_tokens=600)
    assert policy.choose_budget(drafts_of(conf, ids)) == 0
    # Where the round pays at that rate, the budget still takes it: 0.9 a position, every
    # slot: 4 + 9.76 tokens in 3.16 s, 1.6 more than 3.16 s at 3.8 a second are worth.
    easy = survivals_of(torch.full((4, 3), 0.9, dtype=torch.float64))
    assert policy.best_plan(easy, [3] * 4, cold=0.0, prompt_tokens=0) == (12, 3)


def test_prefill_passes_stay_out_of_the_verify_scale() -> None:
    fit = StepTimeFit()
    for i in range(60):  # decode passes as profiled; every 6th step prefills at half its profile
        if i % 6 == 0:
            fit.add(0.2, 0.0, 1, 0.1, 0.1, 0.0, prefill=True)
        else:
            fit.add(0.01, 0.0, 1, 0.01, 0.01, 0.0)
    assert fit.fit.verify_scale == pytest.approx(1.0)
    # Through the policy: a pass with more tokens than R + Σ ℓ carried a prompt.
    cost = CostModel.linear(0.01, 0.001)
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    ids = ("a",)
    policy.draft_lengths([3], ids)
    d = skipped_drafts(ids)
    policy.plan_verification(d, policy.choose_budget(d))
    profiled = cost.verify_time(200)
    policy.observe_time(0.5 * profiled, 200, 0.0, 0.5 * profiled)  # a 200-token prompt
    assert policy.time_fit(1, sampled=False).verify_scale == 1.0


def test_other_work_of_steps_with_a_round_is_learned_apart() -> None:
    fit = StepTimeFit()
    for i in range(40):  # 1 ms a request without a round, 3 ms with one
        if i % 2:
            fit.add(0.01, 0.0, 2, 0.01 + 0.002, 0.01, 0.0)
        else:
            fit.add(0.01, 0.02, 2, 0.03 + 0.006, 0.01, 0.02)
    assert fit.fit.per_request == pytest.approx(0.001)
    assert fit.fit.round_per_request == pytest.approx(0.003)
    assert fit.fit.apply(0.01, 0.0, 2) == pytest.approx(0.012)
    assert fit.fit.apply(0.01, 0.02, 2) == pytest.approx(0.036)
    many = fit.fit.apply(np.array([0.01, 0.01]), np.array([0.0, 0.02]), 2)
    np.testing.assert_allclose(many, [0.012, 0.036])
    only_rounds = StepTimeFit()
    only_rounds.add(0.01, 0.02, 2, 0.036, 0.01, 0.02)
    assert only_rounds.fit.per_request == pytest.approx(0.003)  # one rate serves both kinds


def test_a_cold_rounds_premium_is_spread_over_the_steps_left() -> None:
    from dspark.coordinator.scheduler import RoundInFlight

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
        policy._in_flight = RoundInFlight(1, 3, steady=False, cold=True, rows=0,
                                          decode_tokens=1 + sum(planned))
        policy.observe_time(2.5, 1 + sum(planned), draft_seconds=1.5, verify_seconds=1.0)
        policy._budget, policy._last_round = 0, 0  # no round in step 1: step 2 runs cold
        return policy

    assert cold_policy().time_fit(1).resume_scale == pytest.approx(3.0)
    assert cold_policy().draft_lengths([100], ("a",)) == [3]
    assert cold_policy().draft_lengths([3], ("a",)) == [0]


def run_batch(policy, cost, ids, conf, steps, evict=1.0, budgets=None, round_seconds=0.5):  # noqa: ANN001, ANN201, E501
    """`steps` steps of `policy` over `ids`, the drafts' confidences `conf` for each position:
    verify as profiled, plus `evict` seconds for a pass after a round in this or the previous
    step (the drafter evicted the target's weights), a round `round_seconds`; a request verifying ℓ
    drafts accepts Σ_{j<=ℓ} a_j of them on average (alternating the integers around it).
    Appends (K, depth drafted) per step to `budgets`."""
    budgets = [] if budgets is None else budgets
    drafted_before = False
    survival = np.cumprod(conf)
    for t in range(len(budgets), len(budgets) + steps):
        lengths = policy.draft_lengths([len(conf)] * len(ids), ids)
        d = drafts_of([conf] * len(ids), ids) if any(lengths) else skipped_drafts(ids)
        k = policy.choose_budget(d)
        planned = policy.plan_verification(d, k)
        mean = [float(survival[:p].sum()) for p in planned]
        accepted = [int((t + 1) * m) - int(t * m) for m in mean]
        policy.observe(step_of(ids, planned, accepted))
        tokens = len(ids) + sum(planned)
        drafted = any(lengths)
        verify = cost.verify_time(tokens) + (evict if drafted or drafted_before else 0.0)
        policy.observe_time(verify + round_seconds * drafted, tokens, round_seconds * drafted,
                            verify)
        budgets.append((k, max(lengths)))
        drafted_before = drafted
    return budgets


def test_a_budget_that_keeps_speculating_measures_what_not_speculating_costs(monkeypatch) -> None:  # noqa: ANN001
    # Regression: the price of K = 0 came from a verify fit that a budget which kept
    # speculating learned from passes with drafts only, each 1 s dearer than its profile (the
    # round evicted the target's weights): K = 0 priced 2.04 s for 4 tokens, against 2.66 s for
    # 8 with drafts, so it speculated for good while a step without drafts took 1.04 s (4
    # in flight, T = 1: 0.87x `off`). A few steps with K = 0 measure it, and the budget idles.
    from dspark.coordinator import scheduler
    from dspark.coordinator.scheduler import EXPLORE_STEPS

    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 65)), draft=(0.0,),
                     draft_first=(0.5,))
    ids = ("a", "b", "c", "d")
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    budgets = run_batch(policy, cost, ids, [0.6] * 3, 1)
    while budgets[-1][0] > 0:
        run_batch(policy, cost, ids, [0.6] * 3, 1, budgets=budgets)
    assert 1 < len(budgets) <= 5 and all(k == 12 for k, _ in budgets[:-1])
    run_batch(policy, cost, ids, [0.6] * 3, EXPLORE_STEPS - 1, budgets=budgets)
    # The first pass after the round (1 s dearer) stayed out: K = 0 is priced as measured after.
    assert policy.step_time(4, [0] * 4) == pytest.approx(cost.verify_time(4), rel=0.02)
    budgets = run_batch(policy, cost, ids, [0.6] * 3, 100, budgets=budgets)
    # It idles: only probes draft (backing off), verifying what their paid rounds drafted, and
    # one stretch of EXPLORE_STEPS measures what a round costs now (`_explores_rounds`).
    assert sum(depth > 0 for _, depth in budgets[-100:]) <= 3 + EXPLORE_STEPS
    # Those stretches come ever rarer while they keep finding that speculation does not pay:
    # gaps of 64, 128, 256, ... steps (at most 4 in 1,000 steps; 12 without the backoff).
    budgets = run_batch(policy, cost, ids, [0.6] * 3, 1000, budgets=budgets)
    late = [k > 0 for k, _ in budgets[-1000:]]
    stretches = sum(all(late[i: i + EXPLORE_STEPS]) and (i == 0 or not late[i - 1])
                    for i in range(len(late) - EXPLORE_STEPS + 1))
    assert 1 <= stretches <= 4
    # Without exploring, the same batch speculates throughout.
    monkeypatch.setattr(scheduler, "IDLE_EVIDENCE", 0.0)
    blind = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    assert all(k == 12 for k, _ in run_batch(blind, cost, ids, [0.6] * 3, 100))


def test_a_budget_idled_by_a_load_spike_measures_rounds_again_and_speculates(monkeypatch) -> None:  # noqa: ANN001, E501
    # Regression: six slow rounds while speculating (a load spike) priced rounds ~3 ms too
    # dear and the budget stopped; a stopped budget runs no steady round, the only kind that
    # teaches the drafting scales (its probes' rounds, cold, enter only where they beat the
    # profile), so it idled for good where speculation paid (1 in flight, T = 1: ~1,000 steps
    # at 0.23 tokens a ms where fixed k = 3 made 0.27). Here a round is profiled at 0.25 s and
    # runs 0.3 s, 1 s during the spike: at 0.4 a position a step with drafts makes 1.62
    # tokens in 1.33 s against 1 in 1.01 s without, but 0.80 tokens a second at 1 s a round.
    from dspark.coordinator import scheduler
    from dspark.coordinator.scheduler import EXPLORE_STEPS

    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 65)), draft=(0.0,),
                     draft_first=(0.25,))
    conf = [0.4] * 3

    def spiked() -> list:
        policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
        budgets = run_batch(policy, cost, ("a",), conf, 40, evict=0.0, round_seconds=0.3)
        # Speculating, as it pays (three steps measure K = 0: `_explores_idle`)
        assert sum(k == 3 for k, _ in budgets) >= len(budgets) - 6
        run_batch(policy, cost, ("a",), conf, 40, evict=0.0, budgets=budgets, round_seconds=1.0)
        assert sum(k > 0 for k, _ in budgets[-12:]) <= 3  # the spike stopped it (probes aside)
        return run_batch(policy, cost, ("a",), conf, 400, evict=0.0, budgets=budgets,
                         round_seconds=0.3)[80:]

    after = spiked()
    # Once the spike's rounds weigh little (~230 steps), it explores EXPLORE_STEPS steps in a
    # row, learns the round is cheap again, and speculates from then on (but for the few steps
    # that measure K = 0).
    explored = next(i for i in range(len(after))
                    if all(k > 0 for k, _ in after[i: i + EXPLORE_STEPS]))
    assert explored < 300
    resumed = after[explored:]
    assert sum(k == 3 for k, _ in resumed) >= 0.9 * len(resumed)
    # Without exploring rounds it stays idle: only probes draft.
    monkeypatch.setattr(scheduler, "ROUND_EVIDENCE", 0.0)
    assert sum(k > 0 for k, _ in spiked()) < 0.1 * 400


@pytest.mark.parametrize(("conf", "explored"), [(0.95, 0), (0.7, 2)])
def test_speculation_is_interrupted_to_measure_k0_only_where_the_choice_is_close(
        conf: float, explored: int) -> None:
    # At 0.95 a position (14.8 tokens in 1.86 s against 4 in 1.24 s) K = 0 would win only
    # were its time priced 2x too dear: once the budget reads the drafter's rows (from step 3
    # on; the prior's before) no step is given up to measure it. At 0.7 (10.1 tokens) K = 0
    # would win at ~1.4x: EXPLORE_STEPS steps every ~100, with speculation between.
    from dspark.coordinator.scheduler import EXPLORE_STEPS

    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 65)), draft=(0.0,),
                     draft_first=(0.5,))
    ids = ("a", "b", "c", "d")
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    budgets = run_batch(policy, cost, ids, [conf] * 3, 300, evict=0.2)
    idle = [i for i, (k, _) in enumerate(budgets) if k == 0 and i >= 10]
    assert len(idle) == explored * EXPLORE_STEPS
    assert all(k > 0 for k, _ in budgets[-50:])


def test_time_is_priced_at_the_rate_of_decoding_with_prompts_passes_left_out() -> None:
    # Regression: priced at the rate of every step, prompts' passes included (4 in flight,
    # T = 1: 30% of the time at a fifth of the decode steps' rate), each decode step bought
    # drafts at 0.53 tokens a ms where not speculating made 0.62 (0.86x `off`); and where most
    # steps carry a prompt (16 in flight, T = 0) the budget verified as deep as fixed k = 7 at
    # 0.67 tokens a ms where fixed k = 3 made 0.71.
    fit = StepTimeFit()
    for _ in range(100):
        fit.add_tokens(4, 0.006)
    assert fit.throughput == pytest.approx(4 / 0.006)
    # Through the policy: four requests at 0.6 a position, verify 1 + 0.01 B, a round 2 s.
    # Decode steps make 4 tokens in 1.04 s; steps that also prefill a prompt of 300 tokens take
    # 10 s, 8.96 of them for the prompt. At every step's rate 12 slots (8.7 tokens in 3.16 s)
    # were worth taking; at the rate of decoding (3.85 a second) they are not. That holds
    # whatever share of the steps prefill, most of them included (64 in flight).
    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 1025)), draft=(0.0,),
                     draft_first=(2.0,))
    ids = ("a", "b", "c", "d")
    surv = survivals_of(torch.full((4, 3), 0.6, dtype=torch.float64))
    for every in (11, 10 / 9):
        policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
        for i in range(40):
            prompt = 300 if (i + 1) % every < 1 else 0
            policy.draft_lengths([3] * 4, ids, prompt_tokens=prompt)
            d = skipped_drafts(ids)
            policy.plan_verification(d, policy.choose_budget(d))
            policy.observe(step_of(ids, [0] * 4, [0] * 4))
            policy.observe_time(10.0 if prompt else 1.04, 4 + prompt, 0.0, 10.0 if prompt else 1.04)
        assert policy.price_of_time(4) == pytest.approx(4 / 1.04, rel=1e-3), every
        assert policy.best_plan(surv, [3] * 4, cold=0.0, prompt_tokens=0) == (0, 0)


def test_an_idle_batch_with_tracked_rates_plans_again_only_when_they_move() -> None:
    # Planning every idle step cost ~0.4 ms, 7% of a step at 4 in flight (draft model, T = 1).
    from dspark.coordinator.scheduler import PROBE_EVERY, ConfidencePolicy

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
    assert max(b - a for a, b in zip(idle, idle[1:])) <= PROBE_EVERY  # ... at least this often
    assert joins in cached.planned_at and easy in cached.planned_at  # ... and when inputs move
