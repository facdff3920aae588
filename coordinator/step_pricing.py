"""What a step costs: the profiled cost model (`CostModel`) corrected online by measured steps
(`StepTimeFit`, one fit per kind of batch), and the run's price of time.

The budget (`coordinator.scheduler`) prices every candidate plan here: the verify pass of its
tokens, its drafting round (first position and each further one), the step's own work per
request, and a cold round's premium; each step then comes back measured (`observe_time`) and
joins the fit of its kind of batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.step_time_fit import Fit, StepTimeFit

NO_FIT = Fit()  # the profile as it is (frozen): what a kind of batch not yet timed reads


class RoundInFlight(NamedTuple):
    """What `observe_time` needs of the step it times."""

    num_reqs: int
    depth: int  # positions drafted
    steady: bool  # every drafting request drafted in the previous step too (no catch-up)
    cold: bool  # the drafter ran no round in the previous step
    rows: int  # committed rows the round caught up on
    decode_tokens: int  # R + Σ ℓ: the pass's tokens that are not a prompt's (prefill)


class StepPricer:
    """Step times for the budget: the cost model, the fits learned from measured steps, and
    this step's kind of batch (whether it samples, the prompt tokens its pass carries)."""

    def __init__(self, cost: CostModel, gamma: int) -> None:
        self.cost = cost
        self.gamma = gamma  # block size γ: a borrowed fit's drafting scale is read at γ/2 deep
        self.sampled = False  # this step's batch samples: drafting costs the sampled tables
        # This step's pass carries these tokens beyond one a request (prompts being prefilled):
        # its base, paid whatever is drafted. Left out, a step that prefills looked as cheap
        # as a decode step, and speculation as dear beside it as there (measured at 64 in
        # flight: most steps admit a request, passes of ~650 prompt tokens took 390 ms, the
        # budget saw 52 ms and verified 15 drafts a step where fixed k = 3 ran at 1.30x).
        self.prompt_tokens = 0
        # Measured against profiled step times (`StepTimeFit`), one fit per kind of batch; see
        # `time_fit` for the key.
        self.fits: dict[tuple[bool, int], StepTimeFit] = {}
        self.in_flight: RoundInFlight | None = None  # the step planned, not yet timed
        self.committed: int | None = None  # tokens the step committed (`observe`), not timed yet

    def step_time(self, num_reqs: int, counts: list[int], depth: int | None = None) -> float:
        """Estimated seconds of a step verifying `counts` drafts per request, drafting `depth`
        positions (default: as deep as the longest count)."""
        depth = max(counts, default=0) if depth is None else depth
        verify, drafting, further = self.profiled_parts(
            num_reqs + self.prompt_tokens + sum(counts), num_reqs, depth)
        return self.time_fit(num_reqs).apply(verify, drafting, num_reqs, further=further,
                                             after_round=depth > 0)

    def profiled_parts(self, num_tokens: int, num_reqs: int, depth: int
                       ) -> tuple[float, float, float]:
        """(verify, drafting, further) seconds the profile gives a step of this batch's kind;
        `further` is the part of `drafting` for the positions beyond the round's first."""
        verify = self.cost.verify_time(num_tokens, self.sampled)
        if depth <= 0:  # no round (most steps where speculation does not pay)
            return verify, 0.0, 0.0
        first, each = self.cost.draft_costs(num_reqs, self.sampled)
        return verify, first + (depth - 1) * each, (depth - 1) * each

    def fit_of(self, num_reqs: int) -> StepTimeFit | None:
        """The running fit of this step's kind of batch (`time_fit`'s key); None before a step
        of that kind was timed."""
        return self.fits.get((self.sampled, num_reqs.bit_length()))

    def time_fit(self, num_reqs: int, sampled: bool | None = None) -> Fit:
        """How measured steps relate to the profile (`StepTimeFit`: scales of the verify and the
        drafting parts, of a cold round, and seconds per request), for batches that sample or
        not (default: this step's) and batch sizes in powers of two (1, 2–3, 4–7, ...): what is
        learned at one size is not scaled to another. The identity until steps of that kind
        were measured."""
        sampled = self.sampled if sampled is None else sampled
        size = num_reqs.bit_length()
        fit = self.fits.get((sampled, size))
        if fit is not None and fit.knows_drafting:
            return fit.fit
        # No steady round measured at this size yet: borrow from the nearest size that has one
        # (a guess closer than the profile's, which may be off by 2x), until this size
        # measures its own. What carries over is the seconds a round takes beyond its
        # profile, not the ratio: on a CPU that excess is a round's fixed cost (cold caches,
        # the call), ~1.5 ms at 1–7 in flight, so a ratio of 1.3 there priced a round at 16
        # in flight, profiled 3x longer, 25% too dear and kept that size idle.
        known = [k[1] for k, f in self.fits.items() if k[0] == sampled and f.knows_drafting]
        own = fit.fit if fit is not None else NO_FIT
        if not known:
            return own
        near = min(known, key=lambda k: (abs(k - size), k))
        scale = self.fits[(sampled, near)].fit.draft_scale
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
        if self.in_flight is None:
            return
        num_reqs, depth, steady, cold, rows, decode_tokens = self.in_flight
        # The round is priced for the whole batch, as the budget prices it, though fewer may
        # have drafted (a probe's few, requests whose prompt is in the pass): priced for those
        # that drafted, a cold round beside prompts at 64 in flight (23 of 64 drafted, with
        # the others' rows to catch up on) read as 4x its profile, and the budget never
        # resumed (1.02x `off` where it had run at 1.27x).
        verify, drafting, further = self.profiled_parts(num_tokens, num_reqs, depth)
        key = (self.sampled, num_reqs.bit_length())
        fit = self.fits.get(key)
        if fit is None:
            fit = self.fits[key] = StepTimeFit()
        if self.committed is not None:  # `observe` saw this step's commit
            # The price of time is the rate of decoding (`StepTimeFit.throughput`): a prompt's
            # share of the pass, what it took beyond the decode pass the fit predicts, is left out.
            prompt = 0.0
            if num_tokens > decode_tokens:
                alone = self.cost.verify_time(decode_tokens, self.sampled)
                prompt = max(0.0, verify_seconds - fit.fit.verify_time(alone, num_reqs, depth > 0))
            fit.add_tokens(self.committed, seconds - prompt)
            self.committed = None
        if cold and depth > 0:
            # The pass's excess over a steady one, read only from a decode pass: the verify fit
            # knows nothing of prompts (at 64 in flight most cold rounds ran beside one, and
            # their "excess" set the premium to its cap and the budget idled for good).
            steady_pass = fit.fit.verify_time(verify, num_reqs, True)
            excess = 0.0 if num_tokens > decode_tokens else max(0.0, verify_seconds - steady_pass)
            fit.add_resume(drafting, draft_seconds - self.cost.catch_up_time(rows) + excess)
        # Single-request passes tell the machine's speed apart from the cost per sequence
        # (`StepTimeFit`): their scale and fixed cost are the priors of larger batches'.
        alone = self.fits.get((self.sampled, 1))
        prior = alone.fit if alone is not None and alone.knows_verify and num_reqs > 1 else NO_FIT
        # The first pass after the drafter stopped runs as the one after a round (the target's
        # weights evicted: 7.5 ms against 6.6 three steps on, 4 in flight): not what a step
        # without drafts costs while not speculating, the K = 0 the budget prices.
        stopped = depth == 0 and not cold
        fit.add(
            verify, drafting, num_reqs, seconds, verify_seconds, draft_seconds,
            steady and not stopped,
            prefill=num_tokens > decode_tokens, prior_scale=prior.verify_scale, further=further,
            prior_fixed=prior.verify_fixed, after_round=depth > 0)
        self.in_flight = None

    def price_of_time(self, num_reqs: int) -> float | None:
        """Θ*, tokens per second that steps of this kind of batch (`time_fit`'s key) decoded
        lately (`StepTimeFit.throughput`): the budget's price of a step's time; None before one
        was timed (then each step maximises its own ratio)."""
        fit = self.fit_of(num_reqs)
        return None if fit is None else fit.throughput
