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
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.policy import FixedPolicy, OffPolicy, Policy
from dspark.coordinator.stale_history import STALE_STEPS, StaleRow
from dspark.coordinator.step_time_fit import Fit, StepTimeFit
from dspark.kernels.budget import allocate_survivals, rank_slots
from dspark.messages import Drafts, StepState

PROBE_EVERY = 16  # a parallel drafter idled by K = 0 still drafts every this many steps ...
PROBE_REQUESTS = 2  # ... for this many requests of the batch (a round costs ~R) ...
PROBE_EVERY_ALONE = 4  # ... and every this many steps for a lone request (`probe_interval`);
PROBE_MAX_GAP = 128  # each probe that finds speculation still not worth it doubles the gap to this
RESUME_MARGIN = 0.05  # after a step with K = 0, speculation resumes only for this much more Θ
# Where a kind of batch's step-time fit holds less than this weight of decode passes without
# drafts (`StepTimeFit.idle_weight`: ~100 steps since the last ones) ...
IDLE_EVIDENCE = 0.25
EXPLORE_STEPS = 3  # ... its next steps verify nothing, this many in a row (`_explores_idle`),
# ... where K = 0 would have won the last plan had its time been priced less than this much
# (a fraction) too dear (`BudgetedPolicy._flip`)
EXPLORE_ERROR = 1.0
# The same the other way (`_explores_rounds`): where the fit holds less than this weight of
# steady drafting rounds (~230 steps after a long stretch of them, ~70 after an exploration's
# two) and the last plan's K = 0 would have lost to its best K > 0 had that been priced less
# than this much (a fraction) cheaper, the next EXPLORE_STEPS steps verify that best K > 0.
ROUND_EVIDENCE = 0.5
EXPLORE_ROUND_ERROR = 0.25
# ... and at least this many steps after the last such stretch, doubled by each one since the
# budget last chose K > 0 itself, up to PROBE_MAX_GAP << 3
EXPLORE_ROUND_GAP = 64


class RoundInFlight(NamedTuple):
    """What `observe_time` needs of the step it times."""

    num_reqs: int
    depth: int  # positions drafted
    steady: bool  # every drafting request drafted in the previous step too (no catch-up)
    cold: bool  # the drafter ran no round in the previous step
    rows: int  # committed rows the round caught up on
    decode_tokens: int  # R + Σ ℓ: the pass's tokens that are not a prompt's (prefill)


@dataclass(frozen=True)
class Slot:
    survival: float
    req: int  # row in the batch
    pos: int  # draft position j, 1-based


def sorted_slots(survivals: np.ndarray, limits: list[int]) -> list[Slot]:
    """Every admissible (r, j), best first: key (−a, j, r). survivals: [num_reqs, max_draft]."""
    a, j, r = rank_slots(np.asarray(survivals, dtype=np.float64), limits)
    return [Slot(float(x), int(req), int(pos)) for x, pos, req in zip(a, j, r, strict=True)]


def probe_interval(num_reqs: int, idle_probes: int = 0) -> int:
    """Steps between probes of an idle parallel drafter, after `idle_probes` probes in a row
    that found speculation not worth it: PROBE_EVERY_ALONE for a lone request, growing with
    the batch to PROBE_EVERY, and doubled by each such probe up to PROBE_MAX_GAP.

    A lone request idled by a few hard blocks learns within a few steps that the text turned
    easy again (its probe costs part of one step); in a large batch the probed rows feed the
    batch-wide history that every request's budget falls back on. A probe is a drafting round
    plus its catch-up (the drafter takes in the rows it missed, a whole prompt for a request
    never drafted) with no token in return, often dearer than a whole step without drafting;
    where speculation keeps not paying, the backoff keeps those rounds to a few per hundred
    steps instead of one every 4–16 (measured: 7% of a run at 4 in flight, T = 1)."""
    base = min(PROBE_EVERY, PROBE_EVERY_ALONE * max(num_reqs, 1))
    return min(PROBE_MAX_GAP, base << min(idle_probes, 8))


def survivals_of(confidences: torch.Tensor | np.ndarray) -> np.ndarray:  # [num_reqs, max_draft]
    """Survivals a_j = c_1···c_j (float64) of conditional confidences [num_reqs, max_draft].
    numpy, as everything the budget reads: the policy runs every step on a few dozen floats a
    request, where torch's per-op dispatch (and torch-numpy conversions) cost more than the
    arithmetic, worse right after a forward pass has flushed the caches."""
    if isinstance(confidences, torch.Tensor):
        confidences = confidences.detach().cpu().numpy()
    # ufuncs, not np.clip / np.cumprod: their Python wrappers cost more than the work here
    clipped = np.minimum(np.maximum(confidences.astype(np.float64, copy=False), 0.0), 1.0)
    return np.multiply.accumulate(clipped, axis=1)


class BudgetedPolicy(Policy):
    """Shared machinery: the cost model, confidences, the stale history and the step log."""

    def __init__(self, gamma: int, cost: CostModel, tracker: AcceptanceTracker,
                 a_priori: bool, sequential_drafts: bool) -> None:
        if gamma < 1:
            raise ValueError(f"k={gamma}: the block size γ must be >= 1")
        self.gamma = gamma
        self.cost = cost
        self.tracker = tracker
        self.a_priori = a_priori  # confidences known before drafting (tracked rates)
        self.sequential_drafts = sequential_drafts  # drafting cost grows with positions
        self._history: dict[str, StaleRow] = {}
        self._global_history = StaleRow(long_run=True)
        self._budget = 0
        self._idle = True  # the last step's budget before drafting was K = 0 (probes included)
        self._planned: list[int] | None = None
        self._sampled = False  # this step's batch samples: drafting costs the sampled tables
        # This step's pass carries these tokens beyond one a request (prompts being prefilled):
        # its base, paid whatever is drafted. Left out, a step that prefills looked as cheap
        # as a decode step, and speculation as dear beside it as there (measured at 64 in
        # flight: most steps admit a request, passes of ~650 prompt tokens took 390 ms, the
        # budget saw 52 ms and verified 15 drafts a step where fixed k = 3 ran at 1.30x).
        self._prompt_tokens = 0
        self._steps = 0  # steps planned so far (the stale rows' clock and the probe cadence)
        self._last_drafted: dict[str, int] = {}  # request -> the last step it drafted
        self._last_round = 0  # the last step whose round drafted anything (speculation or a probe)
        self._idle_probes = 0  # probes since the last step with K > 0 (`probe_interval`)
        self._explore_left = 0  # further steps of a stretch with K = 0 (`_explores_idle`)
        self._flip = 0.0  # K = 0's overpricing that would have flipped the last plan (`best_plan`)
        self._round_flip = 0.0  # the same of the best K > 0, where K = 0 won it
        self._explore_rounds_left = 0  # further steps of a stretch with K > 0 (`_explores_rounds`)
        self._exploring_rounds = False  # this step's plan is the best with K > 0 (`best_plan`)
        self._round_explorations = 0  # stretches since the budget last chose K > 0 itself
        self._explored_at = -(PROBE_MAX_GAP << 3)  # the step the last such stretch began
        # Tracked rates (a-priori confidences) moved since their rows were last pushed: the
        # previous step verified drafts, or the batch changed (`draft_lengths`)
        self._rates_moved = True
        self._pushed_batch: tuple[str, ...] = ()
        # Measured against profiled step times (`StepTimeFit`), one fit per kind of batch; see
        # `time_fit` for the key.
        self._fits: dict[tuple[bool, int], StepTimeFit] = {}
        # This step's rows to catch up on, per request that did not draft in the previous step,
        # and every request's cap (the tokens it may still generate).
        self._backlog: dict[str, int] = {}
        self._caps: dict[str, int] = {}
        self._cold = True  # this step's round follows a step without one (`Fit.resume_scale`)
        self._in_flight: RoundInFlight | None = None  # the step planned, not yet timed
        self._committed: int | None = None  # tokens the step committed (`observe`), not timed yet
        # (batch, step, limits) of a K = 0 plan (`_idle_plan_holds`)
        self._idle_plan: tuple[tuple[str, ...], int, list[int]] | None = None
        self._last_push = -STALE_STEPS - 1  # the last step that pushed stale rows
        # (confidences, their survivals) of this step's drafts (`live_survivals`)
        self._live: tuple[torch.Tensor | np.ndarray, np.ndarray] | None = None

    # --- cost --------------------------------------------------------------------------------
    def step_time(self, num_reqs: int, counts: list[int], depth: int | None = None) -> float:
        """Estimated seconds of a step verifying `counts` drafts per request, drafting `depth`
        positions (default: as deep as the longest count)."""
        depth = max(counts, default=0) if depth is None else depth
        verify, drafting, further = self._profiled_parts(
            num_reqs + self._prompt_tokens + sum(counts), num_reqs, depth)
        return self.time_fit(num_reqs).apply(verify, drafting, num_reqs, further=further,
                                             after_round=depth > 0)

    def _profiled_parts(self, num_tokens: int, num_reqs: int, depth: int
                        ) -> tuple[float, float, float]:
        """(verify, drafting, further) seconds the profile gives a step of this batch's kind;
        `further` is the part of `drafting` for the positions beyond the round's first."""
        verify = self.cost.verify_time(num_tokens, self._sampled)
        if depth <= 0:  # no round (most steps where speculation does not pay)
            return verify, 0.0, 0.0
        first, each = self.cost.draft_costs(num_reqs, self._sampled)
        return verify, first + (depth - 1) * each, (depth - 1) * each

    def _fit_of(self, num_reqs: int) -> StepTimeFit | None:
        """The running fit of this step's kind of batch (`time_fit`'s key); None before a step
        of that kind was timed."""
        return self._fits.get((self._sampled, num_reqs.bit_length()))

    def time_fit(self, num_reqs: int, sampled: bool | None = None) -> Fit:
        """How measured steps relate to the profile (`StepTimeFit`: scales of the verify and the
        drafting parts, of a cold round, and seconds per request), for batches that sample or
        not (default: this step's) and batch sizes in powers of two (1, 2–3, 4–7, ...): what is
        learned at one size is not scaled to another. The identity until steps of that kind
        were measured."""
        sampled = self._sampled if sampled is None else sampled
        size = num_reqs.bit_length()
        fit = self._fits.get((sampled, size))
        if fit is not None and fit.knows_drafting:
            return fit.fit
        # No steady round measured at this size yet: borrow from the nearest size that has one
        # (a guess closer than the profile's, which may be off by 2x), until this size
        # measures its own. What carries over is the seconds a round takes beyond its
        # profile, not the ratio: on a CPU that excess is a round's fixed cost (cold caches,
        # the call), ~1.5 ms at 1–7 in flight, so a ratio of 1.3 there priced a round at 16
        # in flight, profiled 3x longer, 25% too dear and kept that size idle.
        known = [k[1] for k, f in self._fits.items() if k[0] == sampled and f.knows_drafting]
        own = fit.fit if fit is not None else Fit()
        if not known:
            return own
        near = min(known, key=lambda k: (abs(k - size), k))
        scale = self._fits[(sampled, near)].fit.draft_scale
        depth = (self.gamma + 1) // 2
        here = self.cost.draft_time(num_reqs, depth, sampled)
        # A size within the bucket it was measured at: ~1.5 · 2^(k−1) requests (1, 3, 6, 12, ...).
        there = self.cost.draft_time(max(1, (3 << (near - 1)) // 2), depth, sampled)
        if here > 0 and there > 0:
            scale = 1.0 + (scale - 1.0) * there / here
        return replace(own, draft_scale=scale, first_scale=None, further_scale=None)

    def observe_time(self, seconds: float, num_tokens: int, draft_seconds: float,
                     verify_seconds: float) -> None:
        """The step just committed took `seconds` end to end, of them `draft_seconds` in the
        drafting call and `verify_seconds` in the verify call, and verified `num_tokens` tokens
        (prompt tokens of new requests included); it joins the fit of its kind of batch
        (`StepTimeFit`). On a small model the engine's own work per request and step is a large
        share of a step, and leaving it out makes every step look cheaper than it is, so
        speculation (fewer, longer steps) looks worth less; a machine running faster than when
        profiled must not read as negative overhead. One fit serves steps that draft and steps
        that do not, with their other work learned apart (learning every part apart made
        whichever was less known look cheaper, and the budget swung); a pass that also took in
        a prompt stays out of the verify scale."""
        if self._in_flight is None:
            return
        num_reqs, depth, steady, cold, rows, decode_tokens = self._in_flight
        # The round is priced for the whole batch, as the budget prices it, though fewer may
        # have drafted (a probe's few, requests whose prompt is in the pass): priced for those
        # that drafted, a cold round beside prompts at 64 in flight (23 of 64 drafted, with
        # the others' rows to catch up on) read as 4x its profile, and the budget never
        # resumed (1.02x `off` where it had run at 1.27x).
        verify, drafting, further = self._profiled_parts(num_tokens, num_reqs, depth)
        key = (self._sampled, num_reqs.bit_length())
        fit = self._fits.get(key)
        if fit is None:
            fit = self._fits[key] = StepTimeFit()
        if self._committed is not None:  # `observe` saw this step's commit
            # The price of time is the rate of decoding (`StepTimeFit.throughput`): a prompt's
            # share of the pass, what it took beyond the decode pass the fit predicts, is left out.
            prompt = 0.0
            if num_tokens > decode_tokens:
                alone = self.cost.verify_time(decode_tokens, self._sampled)
                prompt = max(0.0, verify_seconds - fit.fit.verify_time(alone, num_reqs, depth > 0))
            fit.add_tokens(self._committed, seconds - prompt)
            self._committed = None
        if cold and depth > 0:
            # The pass's excess over a steady one, read only from a decode pass: the verify fit
            # knows nothing of prompts (at 64 in flight most cold rounds ran beside one, and
            # their "excess" set the premium to its cap and the budget idled for good).
            steady_pass = fit.fit.verify_time(verify, num_reqs, True)
            excess = 0.0 if num_tokens > decode_tokens else max(0.0, verify_seconds - steady_pass)
            fit.add_resume(drafting, draft_seconds - self.cost.catch_up_time(rows) + excess)
        # Single-request passes tell the machine's speed apart from the cost per sequence
        # (`StepTimeFit`): their scale and fixed cost are the priors of larger batches'.
        alone = self._fits.get((self._sampled, 1))
        prior = alone.fit if alone is not None and alone.knows_verify and num_reqs > 1 else Fit()
        # The first pass after the drafter stopped runs as the one after a round (the target's
        # weights evicted: 7.5 ms against 6.6 three steps on, 4 in flight): not what a step
        # without drafts costs while not speculating, the K = 0 the budget prices.
        stopped = depth == 0 and not cold
        fit.add(
            verify, drafting, num_reqs, seconds, verify_seconds, draft_seconds,
            steady and not stopped,
            prefill=num_tokens > decode_tokens, prior_scale=prior.verify_scale, further=further,
            prior_fixed=prior.verify_fixed, after_round=depth > 0)
        self._in_flight = None

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
        drafter must take in first), and K = 0 skips the round. The candidates are, for each
        depth cap d, the first K slots (in `rank_slots` order) among those at positions <= d:
        a plan verifies the best slots a round of d positions drafts. Without the cap (only
        prefixes of the whole order) a plan that wanted one request's 3rd slot took every slot
        ranked above it, another request's 5th included, and paid a round of 5 positions for
        every request (4 in flight, T = 1, steps with every slot busy: 19.8 drafts verified for
        11.4 tokens in 28.6 ms, 0.40 tokens a ms, where fixed k = 3 ran at 0.45; with the
        cap 19.3 drafts for 12.5 tokens in 26.9 ms, 0.46).
        A K > 0 must beat K = 0's Θ by `margin` (a fraction) to be chosen. The pass also carries
        `prompt_tokens` (default: this step's). A round that drafts `drafted` positions whatever
        K is (a probe's) has that round and `catch_up` in every K's time, K = 0's too."""
        num_reqs = len(limits)
        cold = float(self._cold) if cold is None else cold
        prompt_tokens = self._prompt_tokens if prompt_tokens is None else prompt_tokens
        a, pos, _ = rank_slots(survivals, limits)  # [num_slots] best first
        # Candidates [n]: K slots, their tokens and the round's depth; K = 0 first. A probe's
        # round is paid whatever its depth: its candidates are the prefixes of the whole order,
        # as are a lone request's (its K-th slot is its K-th position).
        if drafted is not None or num_reqs == 1:
            counts = np.arange(a.size + 1)
            tokens = num_reqs + np.concatenate(([0.0], a.cumsum()))
            depths = counts if drafted is None else np.full(counts.size, drafted)
            verify = self.cost.verify_times(num_reqs + prompt_tokens, a.size + 1, self._sampled)
        else:
            caps = np.arange(1, int(pos.max()) + 1) if pos.size else pos
            keep = pos[None, :] <= caps[:, None]  # [depth caps, num_slots]
            counts = np.concatenate(([0], keep.cumsum(axis=1)[keep]))
            tokens = num_reqs + np.concatenate(([0.0], np.where(keep, a, 0.0).cumsum(axis=1)[keep]))
            depths = np.concatenate(([0], np.maximum.accumulate(np.where(keep, pos, 0),
                                                                axis=1)[keep]))
            verify = self.cost.verify_times(num_reqs + prompt_tokens, a.size + 1,
                                            self._sampled)[counts]
        first, each = self.cost.draft_costs(num_reqs, self._sampled)
        times = self.time_fit(num_reqs).candidate_times(verify, depths, first, each, num_reqs,
                                                        cold)
        times[0 if drafted else 1:] += catch_up
        price = self.price_of_time(num_reqs)
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
        if price is None:  # before steps of this kind were timed: each step's own ratio
            value = tokens / times
            gain = value / value[0] - 1.0
        else:
            value = tokens - price * times
            gain = (value - value[0]) / (price * times)  # the ratio test's terms where Θ* = Θ(0)
        best = int(value.argmax())  # the first maximum: the shallowest, smallest K on ties
        if drafted is None:
            # How close K = 0 came to winning, read by `_explores_idle` in the next decode
            # steps: from decode steps' plans only. Beside a prompt the pass's time dominates
            # both sides and the margin shrinks: at 16 in flight on a simulated H200, plans
            # beside 141–196 prompt tokens had K = 0 win if priced 16–20% too dear, where decode
            # steps' plans put that at 78–99%, and each time the next decode steps idled three
            # in a row to measure it (9,380 tok/s; 9,734 without those two stretches). (The
            # rounds' exploration keeps reading every plan: on the CPU, with the draft model at
            # 4 in flight, T = 1, reading decode steps only cut the drafts it verified 4x.)
            if not prompt_tokens:
                self._flip = self._flip_error(float(times[0]), float(tokens[best] / times[best]),
                                              float(value[best]), num_reqs, price)
            if value.size > 1:
                rival = 1 + int(value[1:].argmax())  # the best plan that drafts
                self._round_flip = 0.0 if best else self._round_flip_error(
                    float(tokens[0] / times[0]), float(value[0]), float(tokens[rival]),
                    float(times[rival]), price)
                if self._exploring_rounds:
                    return int(counts[rival]), int(depths[rival])
            else:  # no plan drafts (no request may draft): none to explore
                self._round_flip = float("inf")
        if best == 0 or gain[best] < margin:
            return 0, 0
        return int(counts[best]), int(depths[best])

    @staticmethod
    def _flip_error(idle_time: float, best_rate: float, best_value: float, num_reqs: int,
                    price: float | None) -> float:
        """By how much (a fraction) K = 0's `idle_time` must overstate its cost for K = 0 to
        beat the best plan (its `best_rate` tokens a second, its `best_value` at `price`); 0
        where K = 0 is the best plan, inf where it cannot win at any cost."""
        if price is None:  # ratios: K = 0 wins once R / t0 reaches the best rate
            return max(0.0, idle_time * best_rate / num_reqs - 1.0)
        room = num_reqs - best_value  # K = 0 wins once R − price · t0 reaches the best value
        return max(0.0, price * idle_time / room - 1.0) if room > 0 else float("inf")

    @staticmethod
    def _round_flip_error(idle_rate: float, idle_value: float, tokens: float, seconds: float,
                          price: float | None) -> float:
        """By how much (a fraction of its time) a plan that drafts (its `tokens` in `seconds`)
        must be priced too dear for K = 0 (its `idle_rate` tokens a second, its `idle_value` at
        `price`) to have beaten it: 0 where it would win as priced."""
        if price is None:
            return max(0.0, 1.0 - tokens / seconds / idle_rate)
        return max(0.0, (idle_value - (tokens - price * seconds)) / (price * seconds))

    def price_of_time(self, num_reqs: int) -> float | None:
        """Θ*, tokens per second that steps of this kind of batch (`time_fit`'s key) decoded
        lately (`StepTimeFit.throughput`): the budget's price of a step's time; None before one
        was timed (then each step maximises its own ratio)."""
        fit = self._fit_of(num_reqs)
        return None if fit is None else fit.throughput

    def stale_survivals(self, req_ids: tuple[str, ...]) -> np.ndarray:  # [num_reqs, γ]
        """Survivals from two steps back and before (`StaleRow`): the request's own, else the
        batch means' long-run average, else the tracker's global rates (`_fallback_row`). None
        of these can depend on the current step's drafts."""
        fallback = self._fallback_row()
        rows = []
        for r in req_ids:
            own = self._history[r].value_at(self._steps) if r in self._history else None
            rows.append(own if own is not None else fallback)
        if not rows:
            return np.zeros((0, self.gamma))
        return np.array(rows)

    def _fallback_row(self) -> np.ndarray:  # [γ]
        """The row of a request without rows of its own: the batch means' long-run average,
        else the tracker's global rates (its documented prior for a new deployment).

        Not the batch means' recent average: with one request in flight that is the last
        request's last few blocks, and where they were hard the next request started idle,
        and with the probes' backoff inherited from the last one it stayed idle for its whole
        life (measured at 1 in flight, T = 0: 2 requests of 8 per round)."""
        self._global_history.value_at(self._steps)  # takes in the rows two steps old
        row = self._global_history.long_run
        if row is None:
            row = survivals_of(self.tracker.global_rates()[None, : self.gamma])[0]
        return row

    def live_survivals(self, confidences: torch.Tensor | np.ndarray) -> np.ndarray:
        """`survivals_of` this step's live confidences, computed once a step: the allocation
        and the history both read them (at 16 in flight a conversion and cumprod cost ~0.1 ms
        of the policy's ~1.3 ms a step)."""
        cached = self._live
        if cached is None or cached[0] is not confidences:
            cached = self._live = (confidences, survivals_of(confidences))
        return cached[1]

    def _remember(self, req_ids: tuple[str, ...], survivals: np.ndarray,
                  counts: list[int] | None = None) -> None:
        """Push each request's survival row (`counts[i]` drafted positions; None: all γ) into
        its history (and the batch mean into the global one). A row drafted to depth d < γ is
        continued past d with the tracker's realised conditional rates, so a shallow step does
        not read as "never accepted deeper" (the depth would then only ever shrink). Rows with
        nothing drafted leave their history as it is: a missing draft is no evidence at all."""
        width = min(self.gamma, survivals.shape[1])
        counts = [width] * len(req_ids) if counts is None else [min(c, width) for c in counts]
        if not any(counts):  # an idle step (most steps where speculation does not pay)
            return
        padded = np.zeros((len(req_ids), self.gamma))
        rates = None  # [γ] the tracker's conditional rates, read only for a shallow row
        for i, c in enumerate(counts):
            if c > 0:
                padded[i, :c] = survivals[i, :c]
            if 0 < c < self.gamma:
                if rates is None:
                    rates = self.tracker.global_rates()[: self.gamma]
                padded[i, c:] = survivals[i, c - 1] * np.cumprod(rates[c:])
        fresh = [c > 0 for c in counts]
        self._last_push = self._steps
        for r, row, ok in zip(req_ids, padded, fresh):
            if ok:
                history = self._history.get(r)
                if history is None:
                    history = self._history[r] = StaleRow()
                history.push(self._steps, row)
        self._global_history.push(self._steps, padded[fresh].sum(axis=0) / sum(fresh))

    # --- the Policy interface ------------------------------------------------------------------
    def draft_lengths(
        self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
        backlog: list[int] | None = None, prompt_tokens: int = 0,
    ) -> list[int]:
        limits = [min(self.gamma, c) for c in caps]
        self._planned = None
        self._live = None
        self._sampled = sampled
        self._steps += 1
        # A request that drafted in the previous step has a steady round's backlog (the
        # profile's); any other first takes in all it missed.
        self._backlog = {r: b for r, b in zip(req_ids, backlog or [0] * len(req_ids))
                         if self._last_drafted.get(r) != self._steps - 1}
        self._caps = dict(zip(req_ids, caps))
        self._cold = self._last_round != self._steps - 1
        self._prompt_tokens = prompt_tokens
        explore = self._explores_idle(len(req_ids))
        # Read by every plan this step makes before drafting (`best_plan`), and by no other
        self._exploring_rounds = not explore and self._explores_rounds(len(req_ids))
        try:
            if self.a_priori:
                lengths = self._plan_a_priori(req_ids, limits, explore)
            else:
                lengths = self._plan_before_drafting(req_ids, limits, explore)
            if not self._idle and not self._exploring_rounds:
                self._round_explorations = 0
            return lengths
        finally:
            self._exploring_rounds = False

    def _plan_before_drafting(self, req_ids: tuple[str, ...], limits: list[int], explore: bool
                              ) -> list[int]:
        """The budget and depth before a parallel drafter drafts (`draft_lengths`): from stale
        survivals, or K = 0 where it explores or its idle plan holds; the lengths to draft."""
        if explore:
            self._budget, depth = 0, 0
            self._idle_plan = None
        elif not self._exploring_rounds and self._idle_plan_holds(req_ids, limits):
            self._budget, depth = 0, 0
        else:
            self._budget, depth = self.budget_before_drafting(req_ids, limits)
            # Kept only when made as every later idle step's would be: cold, with the margin.
            idle = self._budget == 0 and self._cold
            self._idle_plan = (req_ids, self._steps, limits) if idle else None
        self._idle = self._budget == 0
        if not self._idle or self.sequential_drafts:
            self._idle_probes = 0
            # Draft no deeper than the budget's slots reach: a deeper position costs its share of
            # the round and would not be admitted.
            return [min(n, depth) for n in limits]
        # A parallel drafter (DSpark) with nothing to verify skips its round, except after
        # `probe_interval` steps for PROBE_REQUESTS requests (whole blocks), which keeps the
        # history (and so the budget) following the drafter.
        if self._steps - self._last_round < probe_interval(len(limits), self._idle_probes):
            return [0] * len(limits)
        self._idle_probes += 1
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
        if (not explore and not self._exploring_rounds and not self._rates_moved
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
            self._remember(req_ids, survivals_of(conf))
            self._rates_moved, self._pushed_batch = False, req_ids
        return list(self._planned)

    def _explores_idle(self, num_reqs: int) -> bool:
        """Whether this step verifies nothing (and drafts nothing but a probe) to learn what
        such a step costs: EXPLORE_STEPS steps in a row, once the fit of this kind of batch
        holds less than IDLE_EVIDENCE of passes without drafts, outside steps that prefill.

        The price of K = 0 comes from the verify fit, whose fixed cost, cost per sequence and
        scale a budget that keeps speculating learns from passes with drafts only: K = 0 is
        then an extrapolation, and it errs high (the pass after a drafting round runs with the
        target's weights evicted, and the profile's slope carries sequences a live batch does
        not add). Measured at 4 in flight, T = 1, where speculation did not pay: K = 0 priced
        at 7.9 ms a step, steps without drafts taking 6.4–6.7 ms, so `confidence` speculated
        in every full step at 0.53 tokens a ms where not speculating made 0.62 (0.87x `off`).
        The error keeps itself: a budget that never chooses K = 0 never measures it. So a few
        steps every ~100 measure it (3 idle steps and a cold round: ~0.4% of the time where
        speculation pays 30%), unless K = 0 would have lost the last plan even priced
        EXPLORE_ERROR too dear, far beyond any such error."""
        if self._prompt_tokens:
            return False
        if self._explore_left > 0:
            self._explore_left -= 1
            return True
        fit = self._fit_of(num_reqs)
        if (self._idle or self._flip >= EXPLORE_ERROR or fit is None or not fit.knows_verify
                or fit.idle_weight >= IDLE_EVIDENCE):
            return False
        self._explore_left = EXPLORE_STEPS - 1
        return True

    def _explores_rounds(self, num_reqs: int) -> bool:
        """Whether this step verifies the best plan that drafts, K = 0 aside, to learn what such
        a step costs now: EXPLORE_STEPS steps in a row, after a step with K = 0, once the fit of
        this kind of batch holds less than ROUND_EVIDENCE of steady drafting rounds
        (`StepTimeFit.round_weight`), where that plan came within EXPLORE_ROUND_ERROR of
        winning, outside steps that prefill.

        `_explores_idle` the other way. What a step with a round costs beyond one without (the
        drafting scales, the pass after a round, the work of a step with drafts) is learned
        from steady rounds only, and a budget that stopped speculating runs none: whatever
        those parts read when it stopped, it keeps. A load spike while speculating (1 in
        flight, T = 1: six slow steps took the further positions' scale from 0.20 to 1.43 and
        the pass after a round from 0.24 to 1.85 ms) priced a round ~3 ms dearer than it
        runs, and the budget idled for the next ~1,000 steps at 0.23 tokens a ms where fixed
        k = 3 made 0.27: its probes' rounds, cold and catching up, teach none of those parts.
        Where speculation is far from paying (a plan that drafts would have to cost a quarter
        less) nothing is explored; where it is close but does not pay, stretches that find so
        come ever rarer (EXPLORE_ROUND_GAP, doubled by each): at 16 in flight, T = 1, where no
        fixed k beat `off`, exploring whenever the evidence had faded (a stretch every ~40
        steps, each a cold round catching up on 16 requests' rows) ran at 0.965x the budget
        without it, paired."""
        if self._prompt_tokens:
            return False
        if self._explore_rounds_left > 0:
            self._explore_rounds_left -= 1
            return True
        fit = self._fit_of(num_reqs)
        gap = min(EXPLORE_ROUND_GAP << self._round_explorations, PROBE_MAX_GAP << 3)
        if (not self._idle or self._round_flip >= EXPLORE_ROUND_ERROR or fit is None
                or fit.round_weight >= ROUND_EVIDENCE or self._steps - self._explored_at < gap):
            return False
        self._explore_rounds_left = EXPLORE_STEPS - 1
        self._explored_at = self._steps
        self._round_explorations = min(self._round_explorations + 1, 8)
        return True

    def probe_budget(self, req_ids: tuple[str, ...], drafts: list[int]) -> int:
        """K for a probe's round (`drafts` positions per request, 0 for those not probed). Its
        drafting is paid whatever gets verified, so K is chosen as for any step (stale survivals,
        the argmax of Θ) with the round's cost, catch-up included, in every K's time, K = 0's
        too; the slots then go to the current survivals as in any step, so the probe stays
        lossless. Probes used to verify nothing: at 1 in flight, T = 1, ~16 ms for the one token
        an idle step makes in 5. The step still counts as idle (`_idle`): verifying a probe's
        drafts is not a decision to speculate."""
        rows = sum(self._backlog.get(r, 0) for r, n in zip(req_ids, drafts, strict=True) if n)
        catch_up = self.time_fit(len(req_ids)).draft_scale * self.cost.catch_up_time(rows)
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
        return (batch == req_ids and self._last_push <= planned_at - STALE_STEPS
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
        planned = [min(p, n) for p, n in zip(self._planned, drafted)]
        # A round in which a request drafts for the first time in more than a step first takes
        # in every row it missed (a whole prompt, or the steps it idled): not the steady round
        # the profile timed, only an upper bound on it, which the drafting scale takes only
        # when it beat its profile (`StepTimeFit.add`); a cold one teaches the resume scale.
        # `_backlog` holds exactly the requests that did not draft in the previous step.
        caught_up = [r for r, n in zip(drafts.req_ids, drafted) if n and r in self._backlog]
        self._in_flight = RoundInFlight(len(planned), max(drafted, default=0), not caught_up,
                                        self._cold, sum(self._backlog[r] for r in caught_up),
                                        len(planned) + sum(planned))
        for r, n in zip(drafts.req_ids, drafted):
            if n:
                self._last_drafted[r] = self._steps
        # A round counts when it drafted: a budget for a request whose drafter cannot draft yet
        # (its prompt's rows are still in the target's pass) ran none, and the next is cold.
        if any(drafted):
            self._last_round = self._steps
        if not self.a_priori and drafts.confidences is not None and any(drafted):
            self._remember(drafts.req_ids, self.live_survivals(drafts.confidences), drafted)
        return planned

    def observe(self, step: StepState) -> None:
        self._committed = sum(len(s.committed) for s in step.requests)
        if any(s.num_planned for s in step.requests):
            self._rates_moved = True  # the tracker learned from verified drafts
        for s in step.requests:
            if s.finish_reason is not None:
                self._history.pop(s.req_id, None)
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
        if plan[0] or not self._prompt_tokens:
            return plan
        alone = [float(left > 0) for left in steps]
        return self.best_plan(stale, limits, self._catch_up_seconds(req_ids, alone), margin, 1.0)

    def _steps_left(self, req_ids: tuple[str, ...], survivals: np.ndarray) -> list[float]:
        """Each request's steps left to speculate: its cap over the 1 + Σ a tokens a step
        commits. survivals: [num_reqs, γ] the stale survivals the budget reads."""
        tokens = (1 + np.asarray(survivals).sum(axis=1)).tolist()  # [num_reqs] tokens a step
        return [self._caps.get(r, 0) / per_step for r, per_step in zip(req_ids, tokens)]

    def _catch_up_seconds(self, req_ids: tuple[str, ...], steps: list[float]) -> float:
        """What catching up adds to a drafting round's time, each request's share spread over
        the `steps` it has left to speculate (`_steps_left`): the rows are taken in once and
        serve the rest of the generation, so a long one barely notices its prompt while a
        request a few tokens from its end does not start a round for them."""
        if not self._backlog or self.cost.catch_up == 0:
            return 0.0
        rows = 0.0
        for r, left in zip(req_ids, steps):
            backlog = self._backlog.get(r, 0)
            if backlog and left > 0:
                rows += backlog / max(1.0, left)
        return self.time_fit(len(req_ids)).draft_scale * self.cost.catch_up_time(rows)

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
        theta = tokens / self.step_time(num_reqs, counts, depth)
        for slot in sorted_slots(survivals, limits):
            counts[slot.req] += 1
            new_theta = (tokens + slot.survival) / self.step_time(num_reqs, counts, depth)
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
