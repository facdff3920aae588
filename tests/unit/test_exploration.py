"""Probes of an idle drafter and exploration stretches (`coordinator.exploration`), driven through
the budgeted policies on fabricated drafts and step times (no model)."""

from __future__ import annotations

import pytest
import torch
from budget_cases import drafts_of, run_batch, skipped_drafts, step_of

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.exploration import EXPLORE_STEPS
from dspark.coordinator.scheduler import make_policy
from dspark.messages import Drafts


def test_parallel_drafter_skips_its_round_when_the_budget_is_zero_but_probes() -> None:
    from dspark.coordinator.exploration import PROBE_EVERY, probe_interval

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
    from dspark.coordinator.exploration import probe_interval

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
    from dspark.coordinator.exploration import PROBE_EVERY, PROBE_REQUESTS

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


def test_a_lone_request_idled_by_bad_blocks_speculates_again_after_a_good_probe() -> None:
    # Regression: the history read rows two *pushes* back, so for a lone request whose budget
    # fell to 0 a probe's row waited for the next probe. Rows are now read two *steps* after
    # they were drafted, and a lone request is probed every probe_interval(1) steps.
    from dspark.coordinator.exploration import PROBE_EVERY, probe_interval

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
    assert policy.exploration.idle_probes == 0


def test_a_budget_that_keeps_speculating_measures_what_not_speculating_costs(monkeypatch) -> None:  # noqa: ANN001
    # Regression: the price of K = 0 came from a verify fit that a budget which kept
    # speculating learned from passes with drafts only, each 1 s dearer than its profile (the
    # round evicted the target's weights): K = 0 priced 2.04 s for 4 tokens, against 2.66 s for
    # 8 with drafts, so it speculated for good while a step without drafts took 1.04 s (4
    # in flight, T = 1: 0.87x `off`). A few steps with K = 0 measure it, and the budget idles.
    from dspark.coordinator import exploration
    from dspark.coordinator.exploration import EXPLORE_STEPS

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
    assert policy.pricer.step_time(4, [0] * 4) == pytest.approx(cost.verify_time(4), rel=0.02)
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
    monkeypatch.setattr(exploration, "IDLE_EVIDENCE", 0.0)
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
    from dspark.coordinator import exploration
    from dspark.coordinator.exploration import EXPLORE_STEPS

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
    monkeypatch.setattr(exploration, "ROUND_EVIDENCE", 0.0)
    assert sum(k > 0 for k, _ in spiked()) < 0.1 * 400


@pytest.mark.parametrize(("conf", "explored"), [(0.95, 0), (0.7, 2)])
def test_speculation_is_interrupted_to_measure_k0_only_where_the_choice_is_close(
        conf: float, explored: int) -> None:
    # At 0.95 a position (14.8 tokens in 1.86 s against 4 in 1.24 s) K = 0 would win only
    # were its time priced 2x too dear: once the budget reads the drafter's rows (from step 3
    # on; the prior's before) no step is given up to measure it. At 0.7 (10.1 tokens) K = 0
    # would win at ~1.4x: EXPLORE_STEPS steps every ~100, with speculation between.
    from dspark.coordinator.exploration import EXPLORE_STEPS

    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 65)), draft=(0.0,),
                     draft_first=(0.5,))
    ids = ("a", "b", "c", "d")
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    budgets = run_batch(policy, cost, ids, [conf] * 3, 300, evict=0.2)
    idle = [i for i, (k, _) in enumerate(budgets) if k == 0 and i >= 10]
    assert len(idle) == explored * EXPLORE_STEPS
    assert all(k > 0 for k, _ in budgets[-50:])


def test_an_exploration_of_rounds_keeps_the_probes_backoff() -> None:
    # Four requests at 0.3 a position, rounds of 0.5 s beside passes of ~1 s: a step with
    # drafts makes ~5.7 tokens in ~1.7 s against 4 in 1.04 s, ~12% short of paying, so the
    # budget idles, probes with a growing gap, and now and then explores rounds (the plan that
    # drafts came within EXPLORE_ROUND_ERROR). An exploration is no decision to speculate, as
    # a probe is none: the backoff stands, else every stretch brought probes back at the base
    # interval (16 in flight, T = 1: probes and explorations together 7% of the time, their
    # steps ~25% slower than idle ones).
    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 129)), draft=(0.0,),
                     draft_first=(0.5,))
    ids = ("a", "b", "c", "d")
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    backoff, stretches, budgets = [], 0, []
    for _ in range(700):
        explored_at = policy.exploration.explored_at
        run_batch(policy, cost, ids, [0.3] * 3, 1, evict=0.0, budgets=budgets)
        stretches += policy.exploration.explored_at != explored_at
        backoff.append(policy.exploration.idle_probes)
    assert stretches >= 2  # the case explores rounds
    assert sum(d > 0 for _, d in budgets) > stretches * EXPLORE_STEPS  # and probes
    assert backoff == sorted(backoff)  # the backoff only grows: the budget never speculates


def test_one_hard_block_does_not_interrupt_speculation_that_pays_to_measure_k0() -> None:
    # Regression: K = 0 was measured whenever the last step's plan came within EXPLORE_ERROR of
    # it; a lone request's plans follow its stale row, so one hard block sufficed (T = 0, 128
    # tokens: 54 of 1,753 steps idle in 18 stretches where each step's margin had a median of
    # 2.0). The margin read is the median of the last FLIP_WINDOW decode steps'.
    from dspark.coordinator.exploration import (
        EXPLORE_ERROR,
        FLIP_WINDOW,
        IDLE_EVIDENCE,
        Exploration,
    )
    from dspark.coordinator.step_time_fit import StepTimeFit

    fit = StepTimeFit()  # one pass, after a round: nothing known of a pass without one
    fit.add(1.0, 0.5, 1, seconds=1.6, verify_seconds=1.0, draft_seconds=0.5, after_round=True)
    assert fit.knows_verify and fit.idle_weight < IDLE_EVIDENCE
    far, near = 3 * EXPLORE_ERROR, EXPLORE_ERROR / 5
    steady = Exploration()
    for margin in [far] * (FLIP_WINDOW - 1) + [near]:
        steady.note_flip(margin)
    assert not steady.explores_idle(False, fit, False)
    close = Exploration()
    for margin in [near] * (FLIP_WINDOW // 2 + 1) + [far] * (FLIP_WINDOW // 2 - 1):
        close.note_flip(margin)
    assert close.explores_idle(False, fit, False)
