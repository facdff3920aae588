"""Confidence-scheduled verification (DESIGN.md §3; the DSpark paper's §5.2 and Algorithm 1).

Notation: request r has drafts x_1..x_γ with conditional confidences c_{r,j}; survival
a_{r,j} = c_{r,1}···c_{r,j}; verifying a prefix of ℓ_r drafts commits 1 + Σ_{j≤ℓ_r} a_{r,j} tokens
in expectation; a pass of B = Σ_r (1 + ℓ_r) tokens costs `step_time(B)` from the profiled cost model
(plus the drafting round: its first position and each further one, as profiled).

Policies (one interface, `coordinator.policy.Policy`):
- `equal`: the production budget K, split evenly across requests;
- `confidence-sync`: Algorithm 1: walk the slots in order of live survival (ties: smaller j,
  then earlier request) adding one at a time; stop at the first slot that does not raise
  Θ = E[tokens] / step_time. The early stop decides about slot (r, j) from slots ranked above
  it only, so it never looks at x_j or at later candidates: lossless with live confidences;
- `confidence`: production: K = argmax_K (R + Σ top-K stale a) / step_time(R + K) over survivals
  from two steps back and earlier (an average in time per request, `StaleRow`, and the batch
  means' long-run one for requests that are younger), then the K slots go to the largest
  *current* survivals. Stale inputs cannot leak the current tokens, so the global argmax is
  safe. A step's time counts the drafting round (cold after idle steps) and the rows an idle
  drafter must catch up on first.
  Once steps of the batch's kind were timed, the argmax is of E[tokens] − Θ* · step_time at the
  rate Θ* those steps decoded (`price_of_time`: tokens per second of their time less what
  prompts in their passes added): the run's tokens per second, a ratio of sums, is what is
  maximised, and a step with a prompt in its pass has a ratio of its own far below it.

Confidence only prioritises: whatever is admitted is still verified by the target.
When confidences do not depend on the drafts (tracked acceptance rates), the whole plan is made
before drafting, so an autoregressive draft model drafts exactly what will be verified.

This module holds the plan (`BudgetedPolicy`: budget, depth, allocation, the step's
bookkeeping) and the policies. What it reads lives beside it: step prices in
`coordinator.step_pricing`, stale survival rows in `coordinator.stale_history`, the probes and
exploration stretches in `coordinator.exploration`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.exploration import (
    PROBE_EVERY,
    PROBE_REQUESTS,
    Exploration,
    flip_error,
    probe_interval,
    round_flip_error,
)
from dspark.coordinator.policy import FixedPolicy, OffPolicy, Policy
from dspark.coordinator.stale_history import STALE_STEPS, SurvivalHistory, survivals_of
from dspark.coordinator.step_pricing import RoundInFlight, StepPricer
from dspark.kernels.budget import (
    SMALL_BATCH_SLOTS,
    allocate_survivals,
    candidate_plans,
    prefix_plans,
    rank_slots,
    small_candidate_plans,
)
from dspark.messages import Drafts, StepState

RESUME_MARGIN = 0.05  # after a step with K = 0, speculation resumes only for this much more Θ


@dataclass(frozen=True)
class Slot:
    survival: float
    req: int  # row in the batch
    pos: int  # draft position j, 1-based


def sorted_slots(survivals: np.ndarray, limits: list[int]) -> list[Slot]:
    """Every admissible (r, j), best first: key (−a, j, r). survivals: [num_reqs, max_draft]."""
    a, j, r = rank_slots(np.asarray(survivals, dtype=np.float64), limits)
    return [Slot(float(x), int(req), int(pos)) for x, pos, req in zip(a, j, r, strict=True)]


class BudgetedPolicy(Policy):
    """Shared machinery of the budgeted policies: each step's plan (K, the round's depth, the
    allocation) from the step prices (`pricer`), the stale survivals (`history`) and the
    exploration state (`exploration`), and the step's log (drafted, cold, backlog)."""

    def __init__(self, gamma: int, cost: CostModel, tracker: AcceptanceTracker,
                 a_priori: bool, sequential_drafts: bool) -> None:
        if gamma < 1:
            raise ValueError(f"k={gamma}: the block size γ must be >= 1")
        self.gamma = gamma
        self.cost = cost
        self.tracker = tracker
        self.a_priori = a_priori  # confidences known before drafting (tracked rates)
        self.sequential_drafts = sequential_drafts  # drafting cost grows with positions
        self.pricer = StepPricer(cost, gamma)  # step times: profile, fits, price of time
        self.history = SurvivalHistory(gamma, tracker)  # stale survival rows
        self.exploration = Exploration()  # probes' backoff, exploration stretches
        self._budget = 0
        self._idle = True  # the last step's budget before drafting was K = 0 (probes included)
        self._queued: int | None = None  # requests waiting for a place (`draft_lengths`)
        self._planned: list[int] | None = None
        self._steps = 0  # steps planned so far (the stale rows' clock and the probe cadence)
        self._last_drafted: dict[str, int] = {}  # request -> the last step it drafted
        self._last_round = 0  # the last step whose round drafted anything (speculation or a probe)
        # Tracked rates (a-priori confidences) moved since their rows were last pushed: the
        # previous step verified drafts, or the batch changed (`draft_lengths`)
        self._rates_moved = True
        self._pushed_batch: tuple[str, ...] = ()
        # This step's rows to catch up on, per request that did not draft in the previous step,
        # and every request's cap (the tokens it may still generate).
        self._backlog: dict[str, int] = {}
        self._caps: dict[str, int] = {}
        self._cold = True  # this step's round follows a step without one (`Fit.resume_scale`)
        # (batch, step, limits) of a K = 0 plan (`_idle_plan_holds`)
        self._idle_plan: tuple[tuple[str, ...], int, list[int]] | None = None
        # (confidences, their survivals) of this step's drafts (`live_survivals`)
        self._live: tuple[torch.Tensor | np.ndarray, np.ndarray] | None = None

    # --- the budget ------------------------------------------------------------------------
    def best_budget(self, survivals: np.ndarray, limits: list[int],
                    catch_up: float = 0.0, margin: float = 0.0) -> int:
        """K maximising (R + Σ top-K a) / step_time, or (R + Σ top-K a) − Θ* · step_time once
        the run's rate Θ* is known (`price_of_time`): a global argmax over K (the smallest K on
        ties). Vectorised over K: it runs every step over up to R·γ slots."""
        return self.best_plan(survivals, limits, catch_up, margin)[0]

    def best_plan(self, survivals: np.ndarray, limits: list[int], catch_up: float = 0.0,
                  margin: float = 0.0, cold: float | None = None,
                  prompt_tokens: int | None = None, drafted: int | None = None
                  ) -> tuple[int, int]:
        """(K, depth): `best_budget`'s K and how many positions the round must draft. A round
        of d positions costs draft_first + (d − 1)·draft, plus `catch_up` seconds (the rows the
        drafter must take in first), and K = 0 skips the round. The candidates are
        `candidate_plans`' (in plain floats up to SMALL_BATCH_SLOTS slots, a lone request's
        included: `small_candidate_plans`'; a probe's: `prefix_plans`'): for each depth
        cap d, the best K slots a round of d positions drafts (without the cap, at 4 in flight,
        T = 1, steps with every slot busy: 19.8 drafts verified for 11.4 tokens in 28.6 ms,
        0.40 tokens a ms, where fixed k = 3 ran at 0.45; with it 19.3 drafts for 12.5 tokens in
        26.9 ms, 0.46).
        A K > 0 must beat K = 0's Θ by `margin` (a fraction) to be chosen. The pass also carries
        `prompt_tokens` (default: this step's). A round that drafts `drafted` positions whatever
        K is (a probe's) has that round and `catch_up` in every K's time, K = 0's too."""
        num_reqs = len(limits)
        cold = float(self._cold) if cold is None else cold
        prompt_tokens = self.pricer.prompt_tokens if prompt_tokens is None else prompt_tokens
        fit = self.pricer.time_fit(num_reqs)
        first, each = self.cost.draft_costs(num_reqs, self.pricer.sampled)
        base, sampled = num_reqs + prompt_tokens, self.pricer.sampled
        counts: list[int] | np.ndarray
        depths: list[int] | np.ndarray
        if drafted is not None or sum(limits) <= SMALL_BATCH_SLOTS:  # a few candidates, in floats
            if drafted is not None:  # a probe's round: the prefixes of the slots' order
                counts, accepted = prefix_plans(rank_slots(survivals, limits)[0].tolist())
                depths = [drafted] * len(counts)
            else:  # a lone request's (its prefixes) or a small batch's
                counts, accepted, depths = small_candidate_plans(survivals.tolist(), limits)
            verify = self.cost.verify_times(base, counts[-1] + 1, sampled).tolist()
            tokens = np.array([num_reqs + x for x in accepted])  # [n] expected tokens committed
            times = np.array(fit.candidate_times([verify[k] for k in counts], depths, first,
                                                 each, num_reqs, cold))
        else:
            a, pos, _ = rank_slots(survivals, limits)  # [num_slots] best first
            counts, accepted, depths = candidate_plans(a, pos)
            tokens = num_reqs + accepted
            verify = self.cost.verify_times(base, a.size + 1, sampled)
            times = fit.candidate_times(verify[counts], depths, first, each, num_reqs, cold)
        if catch_up:
            times[0 if drafted else 1:] += catch_up
        price = self.pricer.price_of_time(num_reqs) if self._time_is_wanted(prompt_tokens) else None
        # What the run commits is Σ tokens / Σ seconds over its steps, maximised by each step's
        # argmax of tokens − Θ* · seconds at the run's own rate Θ* (Dinkelbach; with the work
        # fixed, prompts' passes are paid whatever is chosen, so Θ* is the rate of decoding),
        # not of its own ratio; where Θ* equals the step's best ratio the two agree. A step
        # whose base is long (a prompt in its pass) has a low ratio of its own, and its argmax
        # took drafts whose tokens came slower than the run's rate (draft model, 4 in flight,
        # T = 1: 5.9 positions beside each prompt at 0.31 tokens a ms against 0.41 in decode
        # steps); a decode step whose own ratio is above the run's declined drafts that paid
        # at the run's rate (16 in flight, T = 1: 11.5 drafts verified a step against 37
        # priced at Θ*, 1.015x against 1.035x `off` side by side).
        # (Before steps of this kind were timed, price is None: each step's own ratio.)
        if price is not None and not prompt_tokens:
            # A decode step none of whose plans reaches Θ* (its requests in harder text than
            # the steps Θ* was read from) is priced at its own best ratio: the tokens it would
            # decline are its requests' next ones, made later at no better rate, not other
            # work's. At Θ* it took its shortest plan, K = 0: a lone request (T = 0, 128
            # tokens) idled so through 11% of its time until its idle steps pulled Θ* down.
            price = min(price, float((tokens / times).max()))
        value = tokens / times if price is None else tokens - price * times
        best = int(value.argmax())  # the first maximum: the shallowest, smallest K on ties
        if drafted is None:
            rival = self._note_margins(tokens, times, value, best, price, num_reqs,
                                       prompt_tokens)
            if rival is not None and self.exploration.exploring_rounds:
                return int(counts[rival]), int(depths[rival])
        if best == 0:
            return 0, 0
        # The gain over K = 0, in the ratio test's terms where Θ* = Θ(0)
        gain = (float(value[best] / value[0]) - 1.0 if price is None
                else float((value[best] - value[0]) / (price * times[best])))
        if gain < margin:
            return 0, 0
        return int(counts[best]), int(depths[best])

    def _time_is_wanted(self, prompt_tokens: int) -> bool:
        """Whether a second saved here goes to other work at the run's rate Θ*, which is then
        the price of this step's time: while requests wait for a place in the batch, one that
        finishes sooner lets the next start sooner. With none waiting (`queued` = 0), a freed
        place stays empty, and the run ends when the requests present finish: each step then
        takes the plan with the best tokens a second of its own, as the paper's budget does.
        At Θ* those steps idled where drafting paid: a closed batch's last 2 requests at 4 in
        flight (T = 0), with 9 tokens to go, priced at the 2–3-request steps' 0.75 tokens a
        ms, idled at 0.41 where a round of 3 made 0.44 (and fixed k = 3's such steps 0.52).
        A step that prefills keeps Θ*: its own ratio is low (the prompt's pass), and measured
        against it drafts looked cheap. An unknown queue (None) counts as waiting."""
        return self._queued is None or self._queued > 0 or prompt_tokens > 0

    def _note_margins(self, tokens: np.ndarray, times: np.ndarray, value: np.ndarray, best: int,
                      price: float | None, num_reqs: int, prompt_tokens: int) -> int | None:
        """Record how close this plan came to the other choice (`Exploration.flip`: K = 0
        winning; `round_flip`: the best plan that drafts winning), read by the exploration in the
        next steps. Returns that best plan that drafts (the index of its candidate), None if no
        plan drafts. candidates [n]: tokens, times and values, K = 0 first.

        K = 0's margin is read from decode steps' plans only. Beside a prompt the pass's time
        dominates both sides and the margin shrinks: at 16 in flight on a simulated H200, plans
        beside 141–196 prompt tokens had K = 0 win if priced 16–20% too dear, where decode
        steps' plans put that at 78–99%, and each time the next decode steps idled three in a
        row to measure it (9,380 tok/s; 9,734 without those two stretches). (The rounds'
        margin keeps reading every plan: on the CPU, with the draft model at 4 in flight,
        T = 1, reading decode steps only cut the drafts it verified 4x.)"""
        if not prompt_tokens:
            self.exploration.note_flip(flip_error(
                float(times[0]), float(tokens[best] / times[best]), float(value[best]),
                num_reqs, price))
        if value.size == 1:  # no plan drafts (no request may draft): none to explore
            self.exploration.round_flip = float("inf")
            return None
        rival = 1 + int(value[1:].argmax())
        self.exploration.round_flip = 0.0 if best else round_flip_error(
            float(tokens[0] / times[0]), float(value[0]), float(tokens[rival]),
            float(times[rival]), price)
        return rival

    def stale_survivals(self, req_ids: tuple[str, ...]) -> np.ndarray:  # [num_reqs, γ]
        """This step's stale survivals (`SurvivalHistory.stale`): what the budget reads."""
        return self.history.stale(req_ids, self._steps)

    def live_survivals(self, confidences: torch.Tensor | np.ndarray) -> np.ndarray:
        """`survivals_of` this step's live confidences, computed once a step: the allocation
        and the history both read them (at 16 in flight a conversion and cumprod cost ~0.1 ms
        of the policy's ~1.3 ms a step)."""
        cached = self._live
        if cached is None or cached[0] is not confidences:
            cached = self._live = (confidences, survivals_of(confidences))
        return cached[1]

    # --- the Policy interface ------------------------------------------------------------------
    def draft_lengths(
        self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
        backlog: list[int] | None = None, prompt_tokens: int = 0, queued: int | None = None,
    ) -> list[int]:
        limits = [min(self.gamma, c) for c in caps]
        self._queued = queued
        self._planned = None
        self._live = None
        self.pricer.sampled = sampled
        self._steps += 1
        # A request that drafted in the previous step has a steady round's backlog (the
        # profile's); any other first takes in all it missed.
        self._backlog = {r: b for r, b in zip(req_ids, backlog or [0] * len(req_ids), strict=True)
                         if self._last_drafted.get(r) != self._steps - 1}
        self._caps = dict(zip(req_ids, caps, strict=True))
        self._cold = self._last_round != self._steps - 1
        self.pricer.prompt_tokens = prompt_tokens
        fit, prefills = self.pricer.fit_of(len(req_ids)), prompt_tokens > 0
        explore = self.exploration.explores_idle(self._idle, fit, prefills)
        # Read by every plan this step makes before drafting (`best_plan`), and by no other
        self.exploration.exploring_rounds = not explore and self.exploration.explores_rounds(
            self._idle, fit, self._steps, prefills)
        try:
            if self.a_priori:
                lengths = self._plan_a_priori(req_ids, limits, explore)
            else:
                lengths = self._plan_before_drafting(req_ids, limits, explore)
            if not self._idle and not self.exploration.exploring_rounds:
                self.exploration.round_explorations = 0
            return lengths
        finally:
            self.exploration.exploring_rounds = False

    def _plan_before_drafting(self, req_ids: tuple[str, ...], limits: list[int], explore: bool
                              ) -> list[int]:
        """The budget and depth before a parallel drafter drafts (`draft_lengths`): from stale
        survivals, or K = 0 where it explores or its idle plan holds; the lengths to draft."""
        if explore:
            self._budget, depth = 0, 0
            self._idle_plan = None
        elif not self.exploration.exploring_rounds and self._idle_plan_holds(req_ids, limits):
            self._budget, depth = 0, 0
        else:
            self._budget, depth = self.budget_before_drafting(req_ids, limits)
            # Kept only when made as every later idle step's would be: cold, with the margin.
            idle = self._budget == 0 and self._cold
            self._idle_plan = (req_ids, self._steps, limits) if idle else None
        self._idle = self._budget == 0
        if not self._idle or self.sequential_drafts:
            if not self.exploration.exploring_rounds:
                # A stretch that explores rounds is no decision to speculate (nor is a probe's
                # verifying): its rounds refresh the history as probes would, and the probes'
                # backoff stands.
                self.exploration.idle_probes = 0
            # Draft no deeper than the budget's slots reach: a deeper position costs its share of
            # the round and would not be admitted.
            return [min(n, depth) for n in limits]
        # A parallel drafter (DSpark) with nothing to verify skips its round, except after
        # `probe_interval` steps for PROBE_REQUESTS requests (whole blocks), which keeps the
        # history (and so the budget) following the drafter.
        gap = probe_interval(len(limits), self.exploration.idle_probes)
        if self._steps - self._last_round < gap:
            return [0] * len(limits)
        self.exploration.idle_probes += 1
        probed = self._probed(req_ids)
        drafts = [n if i in probed else 0 for i, n in enumerate(limits)]
        self._budget = self.probe_budget(req_ids, drafts)
        return drafts

    def _plan_a_priori(self, req_ids: tuple[str, ...], limits: list[int], explore: bool
                       ) -> list[int]:
        """The whole plan before drafting, from tracked rates (`draft_lengths`). The rates move
        only with verified drafts, so an idle batch's plan holds as a parallel drafter's does
        (`_idle_plan_holds`), and its rows are pushed again only once they moved: planning
        every idle step cost ~0.4 ms, 7% of a step at 4 in flight (draft model, T = 1)."""
        if (not explore and not self.exploration.exploring_rounds and not self._rates_moved
                and self._idle_plan_holds(req_ids, limits)):
            self._budget, self._planned = 0, [0] * len(limits)
            return list(self._planned)
        conf = self.tracker.rates(req_ids)[:, : self.gamma]
        self._budget, self._planned = (0, [0] * len(limits)) if explore else self.plan_from(
            req_ids, conf, limits)
        self._idle = self._budget == 0
        held = self._idle and self._cold and not explore
        self._idle_plan = (req_ids, self._steps, limits) if held else None
        if self._rates_moved or req_ids != self._pushed_batch:
            # The whole γ-long rows, not only what gets drafted: a step that verifies nothing
            # must not leave zero survivals behind (K = 0 would then be absorbing). Rows that
            # did not move are not pushed again: a row pushed g steps after the last weighs
            # as g pushes of it (`StaleRow`).
            self.history.remember(req_ids, self.live_survivals(conf), self._steps)
            self._rates_moved, self._pushed_batch = False, req_ids
        return list(self._planned)

    def probe_budget(self, req_ids: tuple[str, ...], drafts: list[int]) -> int:
        """K for a probe's round (`drafts` positions per request, 0 for those not probed). Its
        drafting is paid whatever gets verified, so K is chosen as for any step (stale survivals,
        the argmax of Θ) with the round's cost, catch-up included, in every K's time, K = 0's
        too; the slots then go to the current survivals as in any step, so the probe stays
        lossless. Probes used to verify nothing: at 1 in flight, T = 1, ~16 ms for the one token
        an idle step makes in 5. The step still counts as idle (`_idle`): verifying a probe's
        drafts is not a decision to speculate."""
        rows = sum(self._backlog.get(r, 0) for r, n in zip(req_ids, drafts, strict=True) if n)
        catch_up = self.pricer.time_fit(len(req_ids)).draft_scale * self.cost.catch_up_time(rows)
        return self.best_plan(self.stale_survivals(req_ids), drafts, catch_up,
                              drafted=max(drafts, default=0))[0]

    def _idle_plan_holds(self, req_ids: tuple[str, ...], limits: list[int]) -> bool:
        """Whether the last plan's K = 0 still stands without planning again: the same batch,
        no request allowed more drafts than then, no stale row readable since (they change
        only after a probe or a round), and fewer than PROBE_EVERY steps ago. Of the other
        inputs, the backlogs only grow while nothing drafts, which can only lower a K > 0's Θ;
        the step-time fit drifts, and is read again at least every PROBE_EVERY steps. Planning
        is ~30 small array operations, 0.1–0.2 ms a step on a CPU: 2–3% of an idle step here.

        The limits must be compared: a request whose prompt is in the pass may draft nothing
        (`Engine._draft_cap`), so the step that prefills a batch plans K = 0 for want of slots,
        and without the check that plan held through the next PROBE_EVERY decode steps (4
        prompts started together: 14 idle steps of ~30, speculation 1.03x the target alone
        where fixed k = 3 ran at 1.2x)."""
        if self._idle_plan is None or not self._idle:
            return False
        batch, planned_at, planned_limits = self._idle_plan
        return (batch == req_ids and self.history.last_push <= planned_at - STALE_STEPS
                and self._steps - planned_at < PROBE_EVERY
                and all(n <= p for n, p in zip(limits, planned_limits, strict=True)))

    def _probed(self, req_ids: tuple[str, ...]) -> set[int]:
        """The PROBE_REQUESTS rows a probe drafts: those drafted most recently (their drafter
        context lacks the fewest rows, so the probe's catch-up is short: a request never drafted
        would first take in its whole prompt), ties in turn from a rotating start."""
        num = len(req_ids)
        start = self._steps // PROBE_EVERY * PROBE_REQUESTS
        order = sorted(range(num), key=lambda i: (-self._last_drafted.get(req_ids[i], -1),
                                                   (i - start) % num))
        return set(order[:PROBE_REQUESTS])

    def choose_budget(self, drafts: Drafts) -> int:
        if self._planned is None:
            assert drafts.confidences is not None, "AcceptanceTracker.fill supplies confidences"
            limits = drafts.num_drafts.tolist()
            if not any(limits):  # nothing drafted (an idle step): nothing to allocate
                self._planned = limits
            else:
                self._budget, self._planned = self.plan_from(
                    drafts.req_ids, drafts.confidences, limits, self._budget)
        return self._budget

    def plan_verification(self, drafts: Drafts, budget: int) -> list[int]:
        assert self._planned is not None, "choose_budget first"
        drafted = drafts.num_drafts.tolist()
        planned = [min(p, n) for p, n in zip(self._planned, drafted, strict=True)]
        # A round in which a request drafts for the first time in more than a step first takes
        # in every row it missed (a whole prompt, or the steps it idled): not the steady round
        # the profile timed, only an upper bound on it, which the drafting scale takes only
        # when it beat its profile (`StepTimeFit.add`); a cold one teaches the resume scale.
        # `_backlog` holds exactly the requests that did not draft in the previous step.
        caught_up = [
            r for r, n in zip(drafts.req_ids, drafted, strict=True) if n and r in self._backlog
        ]
        self.pricer.in_flight = RoundInFlight(
            len(planned), max(drafted, default=0), not caught_up, self._cold,
            sum(self._backlog[r] for r in caught_up), len(planned) + sum(planned))
        for r, n in zip(drafts.req_ids, drafted, strict=True):
            if n:
                self._last_drafted[r] = self._steps
        # A round counts when it drafted: a budget for a request whose drafter cannot draft yet
        # (its prompt's rows are still in the target's pass) ran none, and the next is cold.
        if any(drafted):
            self._last_round = self._steps
        if not self.a_priori and drafts.confidences is not None and any(drafted):
            self.history.remember(drafts.req_ids, self.live_survivals(drafts.confidences),
                                  self._steps, drafted)
        return planned

    def observe_time(self, seconds: float, num_tokens: int, draft_seconds: float,
                     verify_seconds: float) -> None:
        self.pricer.observe_time(seconds, num_tokens, draft_seconds, verify_seconds)

    def observe(self, step: StepState) -> None:
        self.pricer.committed = sum(len(s.committed) for s in step.requests)
        if any(s.num_planned for s in step.requests):
            self._rates_moved = True  # the tracker learned from verified drafts
        for s in step.requests:
            if s.finish_reason is not None:
                self.history.forget(s.req_id)
                self._last_drafted.pop(s.req_id, None)

    # --- what differs between policies -----------------------------------------------------------
    def budget_before_drafting(self, req_ids: tuple[str, ...], limits: list[int]
                               ) -> tuple[int, int]:
        """(K, depth to draft) before the drafts exist: from stale survivals only. A round
        that drafts for requests which did not draft in the previous step first catches up on
        their backlog: a cost of resuming (or starting) speculation, which a marginal gain does
        not repay. After a step that verified nothing, resuming must gain RESUME_MARGIN: near
        break-even the estimates' errors (a few percent of Θ) would flip the budget between 0
        and a full round. A cold round's premium (`Fit.resume_scale`) is a switching cost like
        the catch-up, spread over the batch's mean steps left: charged whole to the resuming
        step, it kept a lone request idle (K = 0 at 1 in flight, T = 1) where steady
        speculation paid 16%, since a cold round there costs 1.7x a steady one.

        Those switching costs are spread over decode steps, so a resuming step is judged as one
        without its prompt (priced against a prompt, a step that prefilled resumed, the next
        went idle again, and the costs were paid over and over: 4 in flight, T = 1, 0.84x
        `off`). But a step whose own pass repays the whole switching costs, charged to it
        alone, speculates whatever follows: beside a prompt a round is cheap (4 in flight,
        T = 1: a prefill pass took 40 ms for 4 tokens, 50 ms with drafts for 7.7)."""
        stale = self.stale_survivals(req_ids)
        margin = RESUME_MARGIN if self._idle else 0.0
        # Steps left matter only to a switching cost; a steady round has none.
        steps = self._steps_left(req_ids, stale) if self._cold or self._backlog else []
        if not self._cold:
            return self.best_plan(stale, limits, self._catch_up_seconds(req_ids, steps), margin,
                                  0.0)
        cold = 1.0 / max(1.0, sum(steps) / len(steps)) if steps else 0.0
        plan = self.best_plan(stale, limits, self._catch_up_seconds(req_ids, steps), margin, cold,
                              prompt_tokens=0)
        if plan[0] or not self.pricer.prompt_tokens:
            return plan
        alone = [float(left > 0) for left in steps]
        return self.best_plan(stale, limits, self._catch_up_seconds(req_ids, alone), margin, 1.0)

    def _steps_left(self, req_ids: tuple[str, ...], survivals: np.ndarray) -> list[float]:
        """Each request's steps left to speculate: its cap over the 1 + Σ a tokens a step
        commits. survivals: [num_reqs, γ] the stale survivals the budget reads."""
        tokens = [1 + sum(row) for row in survivals.tolist()]  # [num_reqs] tokens a step
        return [
            self._caps.get(r, 0) / per_step for r, per_step in zip(req_ids, tokens, strict=True)
        ]

    def _catch_up_seconds(self, req_ids: tuple[str, ...], steps: list[float]) -> float:
        """What catching up adds to a drafting round's time, each request's share spread over
        the `steps` it has left to speculate (`_steps_left`): the rows are taken in once and
        serve the rest of the generation, so a long one barely notices its prompt while a
        request a few tokens from its end does not start a round for them."""
        if not self._backlog or self.cost.catch_up == 0:
            return 0.0
        rows = 0.0
        for r, left in zip(req_ids, steps, strict=True):
            backlog = self._backlog.get(r, 0)
            if backlog and left > 0:
                rows += backlog / max(1.0, left)
        return self.pricer.time_fit(len(req_ids)).draft_scale * self.cost.catch_up_time(rows)

    def plan_from(self, req_ids: tuple[str, ...], confidences: torch.Tensor, limits: list[int],
                  budget: int | None = None) -> tuple[int, list[int]]:
        """(K, ℓ per request) from current conditional confidences [num_reqs, max_draft]."""
        raise NotImplementedError

    def budget_within(self, req_ids: tuple[str, ...], limits: list[int], budget: int | None
                      ) -> tuple[int, list[int]]:
        """(K, each request's admissible drafts): `budget` within `limits` (the drafts there
        are), or, with none given (confidences known before drafting), the budget's K within
        its depth: the round then drafts the plan, and a plan deeper than the budget priced
        would draft deeper too (draft model, 4 in flight, T = 1: 0.89x `off` where the capped
        plan ran at 1.00x, paired)."""
        if budget is not None:
            return budget, limits
        k, depth = self.budget_before_drafting(req_ids, limits)
        return k, [min(n, depth) for n in limits]


class ConfidencePolicy(BudgetedPolicy):
    """Production: K from stale survivals, slots by current survivals (top-K, key (−a, j))."""

    name = "confidence"

    def plan_from(self, req_ids, confidences, limits, budget=None):  # noqa: ANN001, ANN201
        k, limits = self.budget_within(req_ids, limits, budget)
        if k == 0:  # no slot to allocate (most steps where speculation does not pay)
            return 0, [0] * len(limits)
        return k, allocate_survivals(self.live_survivals(confidences), limits, k).tolist()


class ConfidenceSyncPolicy(BudgetedPolicy):
    """Algorithm 1: greedy over live survivals with the early stop."""

    name = "confidence-sync"

    def budget_before_drafting(self, req_ids: tuple[str, ...], limits: list[int]
                               ) -> tuple[int, int]:
        return sum(limits), max(limits, default=0)  # live confidences decide after drafting

    def plan_from(self, req_ids, confidences, limits, budget=None):  # noqa: ANN001, ANN201
        survivals = survivals_of(confidences)
        num_reqs = len(limits)
        counts = [0] * num_reqs
        # Live confidences come after drafting: that round's cost is in every Θ alike. With
        # a-priori (tracked) confidences the plan comes first and drafting stops at its depth.
        depth = None if self.a_priori else max(limits, default=0)
        tokens = float(num_reqs)
        theta = tokens / self.pricer.step_time(num_reqs, counts, depth)
        for slot in sorted_slots(survivals, limits):
            counts[slot.req] += 1
            new_theta = (tokens + slot.survival) / self.pricer.step_time(num_reqs, counts, depth)
            if new_theta <= theta:
                counts[slot.req] -= 1
                break
            tokens, theta = tokens + slot.survival, new_theta
        return sum(counts), counts


class EqualPolicy(BudgetedPolicy):
    """The production budget K split evenly (the remainder to the earliest requests with room)."""

    name = "equal"

    def plan_from(self, req_ids, confidences, limits, budget=None):  # noqa: ANN001, ANN201
        k, limits = self.budget_within(req_ids, limits, budget)
        counts = [0] * len(limits)
        left = min(k, sum(limits))
        while left > 0:
            room = [i for i, n in enumerate(limits) if counts[i] < n]
            share = max(1, left // len(room))
            for i in room:
                take = min(share, limits[i] - counts[i], left)
                counts[i] += take
                left -= take
                if left == 0:
                    break
        return k, counts


POLICY_NAMES = ("off", "fixed", "equal", "confidence-sync", "confidence")
_BUDGETED: dict[str, type[BudgetedPolicy]] = {
    "equal": EqualPolicy,
    "confidence-sync": ConfidenceSyncPolicy,
    "confidence": ConfidencePolicy,
}


def make_policy(name: str, k: int, cost: CostModel | None = None,
                tracker: AcceptanceTracker | None = None, a_priori: bool = True,
                sequential_drafts: bool = False) -> Policy:
    """Build a policy by name; `k` is ℓ for `fixed` and the block size γ for the others."""
    if name == "off":
        return OffPolicy()
    if name == "fixed":
        return FixedPolicy(k)
    if name not in _BUDGETED:
        raise ValueError(f"policy={name!r}: choose one of {list(POLICY_NAMES)}")
    if cost is None or tracker is None:
        raise ValueError(f"policy={name!r} needs a cost model and an acceptance tracker")
    return _BUDGETED[name](k, cost, tracker, a_priori, sequential_drafts)
