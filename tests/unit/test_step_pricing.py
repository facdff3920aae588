"""Step prices (`coordinator.step_pricing`): the profile corrected by measured steps, per kind of
batch, and the price of time, as the budgeted policies read them (no model)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from budget_cases import drafts_of, skipped_drafts, step_of

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.policy import Policy
from dspark.coordinator.scheduler import BudgetedPolicy, make_policy
from dspark.coordinator.stale_history import survivals_of
from dspark.coordinator.step_time_fit import Fit, StepTimeFit


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
                        for v, d, f, n in zip(verify, drafting, further, depths, strict=False)]
            got = fit.candidate_times(verify, depths, first, each, num_reqs, cold)
            assert got.tolist() == pytest.approx(expected)
            # A few candidates come as lists (`prefix_plans`): the same sums, in plain floats.
            floats = fit.candidate_times(verify.tolist(), depths.tolist(), first, each,
                                         num_reqs, cold)
            assert isinstance(floats, list) and floats == got.tolist()


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
    fit = policy.pricer.time_fit(1, sampled=False)
    assert fit.per_request == pytest.approx(2.0)
    assert fit.verify_scale == pytest.approx(1.0) and fit.draft_scale == pytest.approx(1.0)
    assert policy.pricer.time_fit(1, sampled=True) == Fit()  # sampling batches: apart
    assert policy.pricer.time_fit(2, sampled=False) == Fit()  # other batch sizes: apart
    assert policy.best_budget(surv, [3]) == 3


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
    assert policy.pricer.time_fit(2, sampled=False).per_request == pytest.approx(1.5)  # 3 s / 2
    fits = policy.pricer
    assert fits.time_fit(3, sampled=False) == fits.time_fit(2, sampled=False)  # same bucket
    assert policy.pricer.time_fit(4, sampled=False) == Fit()
    # The machine now verifies twice as fast as when profiled, and drafts at 0.8 of the profile.
    run(0.5, 0.8, 0.02, 800)
    fit = policy.pricer.time_fit(2, sampled=False)
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
    fit = policy.pricer.time_fit(2, sampled=False)
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
    fit = policy.pricer.time_fit(1, sampled=False)
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
    from dspark.coordinator.step_pricing import RoundInFlight

    # As if this round had followed idle steps:
    policy.pricer.in_flight = RoundInFlight(1, 3, steady=False, cold=True, rows=0,
                                      decode_tokens=1 + sum(planned))
    policy.observe_time(1.0 + 1.5, 1 + sum(planned), draft_seconds=1.5, verify_seconds=1.0)
    assert policy.pricer.time_fit(1).resume_scale == pytest.approx(3.0)
    surv = survivals_of(torch.full((1, 3), 0.6, dtype=torch.float64))
    policy._cold = True
    assert policy.best_budget(surv, [3]) == 0
    policy._cold = False
    assert policy.best_budget(surv, [3]) == 3


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
    policy.pricer.fits[(False, (4).bit_length())] = fit
    assert policy.pricer.time_fit(1, sampled=False).draft_scale == pytest.approx(0.5)
    assert policy.pricer.time_fit(1, sampled=True).draft_scale == 1.0  # another kind of batch
    own = StepTimeFit()
    for _ in range(5):
        own.add(0.01, 0.02, 1, 0.026, 0.01, 0.016)
    policy.pricer.fits[(False, 1)] = own
    assert policy.pricer.time_fit(1, sampled=False).draft_scale == pytest.approx(0.8)
    # A round's cost that grows with the batch: what carries over is the excess in seconds.
    # One request's rounds take 1 s where profiled at 0.5; a round of 8, profiled at 4 s,
    # is priced 4.5 s (scale 1.125), not 8 s (the ratio 2.0).
    growing = CostModel("t", verify=(1.0,) * 64, draft=(0.0,) * 8,
                        draft_first=tuple(0.5 * n for n in range(1, 9)))
    policy = make_policy("confidence", 3, growing, AcceptanceTracker(3), a_priori=False)
    alone = StepTimeFit()
    for _ in range(5):
        alone.add(0.01, 0.5, 1, 1.01, 0.01, 1.0)
    policy.pricer.fits[(False, 1)] = alone
    assert policy.pricer.time_fit(1, sampled=False).draft_scale == pytest.approx(2.0)
    assert policy.pricer.time_fit(8, sampled=False).draft_scale == pytest.approx(1.125)


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
    policy.pricer.fits[(False, 1)] = learned
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
    from dspark.coordinator.step_pricing import RoundInFlight

    cost = CostModel("t", verify=(1.0,) * 8, draft=(0.0,), draft_first=(0.5,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    assert isinstance(policy, BudgetedPolicy)
    policy.pricer.sampled = False
    policy.pricer.in_flight = RoundInFlight(1, 3, steady=False, cold=True, rows=0, decode_tokens=4)
    # The round took its profile (0.5 s) and the pass 1 s more than a steady pass (1 s).
    policy.observe_time(2.5, 4, draft_seconds=0.5, verify_seconds=2.0)
    fit1 = policy.pricer.time_fit(1)
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
    fit = policy.pricer.time_fit(8)
    assert fit.verify_scale == pytest.approx(1.0, rel=0.02)
    assert fit.verify_per_sequence == pytest.approx(1.0, rel=0.02)
    surv = survivals_of(torch.full((8, 3), 0.6, dtype=torch.float64))
    assert policy.best_budget(surv, [3] * 8) > 0
    policy.pricer.fits[(False, 4)]._fit = Fit(verify_scale=8.8 / 1.8)  # the scale alone, as before
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
    expected = cost.verify_time(605) + 2.0
    assert sync.pricer.step_time(4, [1, 0, 0, 0], depth=3) == pytest.approx(expected)


def time_idle_steps(policy: Policy, ids: tuple[str, ...], seconds: float) -> None:
    """Three steps of `ids` that verify nothing, each committing a token a request in `seconds`
    (the engine reports each step's commit to `observe` before timing it)."""
    for _ in range(3):
        policy.draft_lengths([3] * len(ids), ids)
        d = skipped_drafts(ids)
        planned = policy.plan_verification(d, policy.choose_budget(d))
        policy.observe(step_of(ids, planned, [0] * len(ids)))
        policy.observe_time(seconds, len(ids), 0.0, seconds)


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
    assert policy.pricer.price_of_time(4) is None  # nothing timed yet: the step's own ratio
    policy.draft_lengths([3] * 4, ids, prompt_tokens=600)
    assert policy.choose_budget(drafts_of(conf, ids)) > 0
    time_idle_steps(policy, ids, 1.04)  # steps of this batch size: 4 tokens in 1.04 s
    assert policy.pricer.price_of_time(4) == pytest.approx(4 / 1.04)
    assert policy.pricer.price_of_time(16) is None  # another size's steps are another rate
    policy.draft_lengths([3] * 4, ids, prompt_tokens=600)
    assert policy.choose_budget(drafts_of(conf, ids)) == 0
    # Where the round pays at that rate, the budget still takes it: 0.9 a position, every
    # slot: 4 + 9.76 tokens in 3.16 s, 1.6 more than 3.16 s at 3.8 a second are worth.
    easy = survivals_of(torch.full((4, 3), 0.9, dtype=torch.float64))
    assert policy.best_plan(easy, [3] * 4, cold=0.0, prompt_tokens=0) == (12, 3)


def priced_by_idle_steps(draft_first: float, draft: float, seconds: float) -> BudgetedPolicy:
    """A `confidence` policy over a profile of verify 1 + 0.01 B and rounds of `draft_first`
    plus `draft` a further position, after `time_idle_steps` of 3 requests in `seconds`: its
    price of time for batches of 2–3 is then 3 / `seconds` tokens a second."""
    cost = CostModel("t", verify=tuple(1.0 + 0.01 * b for b in range(1, 1025)), draft=(draft,),
                     draft_first=(draft_first,))
    policy = make_policy("confidence", 3, cost, AcceptanceTracker(3), a_priori=False)
    assert isinstance(policy, BudgetedPolicy)
    time_idle_steps(policy, ("a", "b", "c"), seconds)
    assert policy.pricer.price_of_time(2) == pytest.approx(3 / seconds)
    return policy


def test_a_step_none_of_whose_plans_reaches_the_runs_rate_takes_its_own_best_ratio() -> None:
    # Regression: a decode step priced at the run's rate Θ* where every plan made fewer tokens a
    # second took its shortest plan, K = 0: time saved seemed to go to other work at Θ*. The
    # tokens it declines are its requests' next ones, made later at no better rate. A lone
    # request whose recent text had been easier idled so through 11% of its time (T = 0, 128
    # tokens: 241 of ~1,100 steps) until its idle steps pulled Θ* down. Verify 1 + 0.01 B, a
    # round 2 s. Steps of 3 requests (the same kind of batch as 2) committed 3 tokens in 1.03 s:
    # Θ* = 2.91 a second. Two requests at 0.9 a position: K = 0 makes 2 in 1.02 s (1.96 a
    # second), 6 slots 6.88 in 3.08 s (2.23): below Θ*, so the step's own best ratio decides,
    # whether requests wait or not.
    policy = priced_by_idle_steps(draft_first=2.0, draft=0.0, seconds=1.03)
    easy = survivals_of(torch.full((2, 3), 0.9, dtype=torch.float64))
    two = ("a", "b")
    for queued in (None, 1, 0):
        policy.draft_lengths([3, 3], two, queued=queued)
        assert policy.best_plan(easy, [3, 3], cold=0.0, prompt_tokens=0) == (6, 3), queued
    # A step that prefills keeps Θ*, none waiting or not (its prompt's pass is paid whatever it
    # plans): the 4.88 tokens more are worth 1.68 s at Θ*, less than the 2.06 s they take.
    policy.draft_lengths([3, 3], two, prompt_tokens=100, queued=0)
    assert policy.best_plan(easy, [3, 3], cold=0.0) == (0, 0)


def test_with_no_request_waiting_a_step_takes_its_own_best_ratio() -> None:
    # Regression: the run's rate Θ* prices a step's time because, while requests wait, a second
    # saved goes to other work at that rate. With none waiting it went nowhere, and at Θ* a
    # closed batch's last requests took plans their own ratio did not pay for (4 in flight,
    # T = 0: 2 requests priced at the 2-3-request steps' 0.75 tokens a ms idled at 0.41, where
    # a round made 0.44). Verify 1 + 0.01 B, a round 1 s and 0.5 s a further position; steps of
    # 3 requests committed 3 tokens in 3.5 s (the fit learns them), so Θ* = 0.86 a second. Two
    # requests with survivals (0.9, 0.6, 0.3): 2 positions each make 5.0 tokens in 3.80 s
    # (1.32 a second, the best ratio), the third 0.6 more in 0.52 s: 1.15 a second, above Θ*.
    policy = priced_by_idle_steps(draft_first=1.0, draft=0.5, seconds=3.5)
    rows = np.array([[0.9, 0.6, 0.3]] * 2)
    two = ("a", "b")
    for queued, plan in ((None, (6, 3)), (1, (6, 3)), (0, (4, 2))):
        policy.draft_lengths([3, 3], two, queued=queued)
        assert policy.best_plan(rows, [3, 3], cold=0.0, prompt_tokens=0) == plan, queued


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
    assert policy.pricer.time_fit(1, sampled=False).verify_scale == 1.0


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
        assert policy.pricer.price_of_time(4) == pytest.approx(4 / 1.04, rel=1e-3), every
        assert policy.best_plan(surv, [3] * 4, cold=0.0, prompt_tokens=0) == (0, 0)
