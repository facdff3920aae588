"""Online correction of the profiled step time:
measured ≈ verify_scale · profiled verify + (R − 1) · verify_per_sequence
         + draft_scale · profiled drafting + R · per_request.

The profile is taken once; measured steps then differ from it in two ways, and the engine
times each part of a step, so each is read off that part's calls:
- scales of the verify calls (fitted with a cost per sequence, below) and, apart, of the
  drafting calls (Σ measured seconds / Σ profiled seconds). A shared machine (or a GPU at
  another clock) runs faster or slower than when it was profiled, and not alike for both:
  the profile's drafting rounds and verify passes cannot match every live batch (contexts,
  catch-up lengths). A common scale never changes the budget (the argmax of tokens / time is
  the same), but read as an additive error it would, and a drafting round dearer or cheaper
  than profiled changes what speculation costs;
- per_request = Σ (seconds − worker seconds) / Σ R: the step's other work (the engine's
  bookkeeping, planning, commit and rollback), about linear in the batch size R, learned apart
  for steps with a drafting round (`round_per_request`: confidences, allocation, more tokens to
  commit; measured 0.4–0.9 ms a step against 0.1–0.2 without one). It is a cost of every step,
  so it makes speculation (fewer, longer steps) worth more, and the part only speculating steps
  pay makes it worth less.

The verify profile times passes of one sequence (B tokens of one request). A live pass of R
requests also reads R contexts and runs R sequences' bookkeeping: a cost per sequence, not per
token (measured at 16 in flight, contexts of ~600 rows: 12.0 ms for passes of 11 requests' one
token each, 21.7 ms for 11 requests' 78 tokens, against 5.0 and 13.2 ms profiled: ~0.6 ms a
sequence beyond the profile, and the profile's own slope per token). A scale alone read that
as a 2.4x dearer token and priced speculation out where fixed k = 7 ran at 1.23x plain
decoding. So the verify part is fitted as s · profiled + v · (R − 1) (least squares, v >= 0;
one sequence is what the profile timed): the scale is pulled toward a prior (the single-request
batches' scale, the machine's speed, else 1) by a small ridge, which also decides between the
two where the passes do not tell them apart (one pass size throughout).

Only decode passes enter the verify fit: a pass that also prefills a prompt relates to the
profile (of decode passes) by another ratio (measured 0.49 for ~200-token prompts against 0.76
for decode passes on the same run), and weighing as much as a dozen decode steps it pulled the
scale down: a step's base looked cheaper, drafting dearer beside it, and a lone request idled
where speculation paid.

Sums are exponentially weighted (FORGET^age), so the fit follows a machine whose speed drifts.
One step counts for at most MAX_RATIO times its prediction (for drafting, its profile): a
single outlier (an actor's first call, a collector pause) cannot set a scale beyond that. No
prior pulls the drafting scale toward 1, and the verify scale's (RIDGE) weighs a twentieth of
the passes: a profile that is far off (a drafting round profiled at 100x its live cost) must be
left behind within a few steps, or the budget never speculates and never learns otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORGET = 0.98  # weight kept by each older step: the fit follows ~50 recent steps
MAX_RATIO = 4.0  # a step's measured part counts for at most this many times its prediction
RIDGE = 0.05  # weight of the verify scale's prior, as a share of the passes' own weight


@dataclass(frozen=True)
class Fit:
    verify_scale: float = 1.0
    verify_per_sequence: float = 0.0  # seconds a pass takes per sequence beyond its first
    draft_scale: float = 1.0
    per_request: float = 0.0  # seconds per request per step (of a step without a round)
    resume_scale: float = 1.0  # `draft_scale` of a round after a step without one (cold)
    round_per_request: float | None = None  # `per_request` of a step with a round (None: same)

    def apply(self, verify: Any, drafting: Any, num_reqs: int, cold: float = 0.0) -> Any:
        """Estimated seconds of a step whose profiled parts are `verify` and `drafting` (floats,
        or arrays of many candidate steps). `cold`: the share of a cold round's premium over a
        steady one (`resume_scale` − `draft_scale`) this step is charged, 1.0 for all of it;
        the drafter ran no round in the step before."""
        scale = self.draft_scale + cold * (self.resume_scale - self.draft_scale)
        verify = self.verify_scale * verify + max(num_reqs - 1, 0) * self.verify_per_sequence
        other = num_reqs * self.per_request
        if self.round_per_request is not None:  # (drafting > 0): 0 or 1, or an array of them
            other = other + num_reqs * (self.round_per_request - self.per_request) * (drafting > 0)
        return verify + scale * drafting + other


class StepTimeFit:
    """Running weighted sums of one kind of step's profiled and measured times."""

    def __init__(self) -> None:
        # [profiled drafting, measured drafting,
        #  other of steps without a round, their R, other of steps with one, their R]
        self._sums = [0.0] * 6
        self._resume = [0.0, 0.0]  # [profiled, measured] drafting of rounds after idle steps
        # Decode passes' weighted moments for verify ≈ s · x + v · r (x profiled, y measured,
        # r = R − 1 sequences beyond one): [Σ x², Σ x·r, Σ r², Σ x·y, Σ r·y]
        self._verify = [0.0] * 5
        self._prior_scale = 1.0  # the verify scale's prior (`add`)
        self.fit = Fit()

    @property
    def knows_verify(self) -> bool:
        """Whether a decode pass entered the verify fit."""
        return self._verify[0] > 0

    @property
    def knows_drafting(self) -> bool:
        """Whether a drafting round entered the drafting scale (a steady one, or one that beat
        its profile while catching up); else `draft_scale` is the profile's guess."""
        return self._sums[0] > 0

    def add(self, verify: float, drafting: float, num_reqs: int, seconds: float,
            verify_seconds: float, draft_seconds: float, steady: bool = True,
            prefill: bool = False, prior_scale: float = 1.0) -> Fit:
        """One step: `verify`, `drafting` its profiled parts; `seconds` its measured end-to-end
        time, `verify_seconds` and `draft_seconds` the parts spent in those calls. A round that
        is not `steady` (it first caught up on rows it missed, often cold too) only bounds a
        steady round's time from above: it enters the drafting scale when it ran faster than
        profiled (a steady round would have been faster still; an idle drafter has no other
        way to learn that its profile is too dear), and otherwise stays out. Counted at its
        profile, as before, it held the scale near 1 where steady rounds ran at 0.52 of the
        profile (1 in flight, T = 1), so a mostly idle budget never found out that speculating
        steadily paid. `prefill`: the pass also took in prompt tokens, and stays out
        of the verify fit (see the module's docstring). `prior_scale`: the verify scale's
        prior."""
        other = max(0.0, seconds - verify_seconds - draft_seconds)
        with_round = drafting > 0
        if not steady and draft_seconds >= drafting:
            drafting = draft_seconds = 0.0
        if prefill:
            verify = verify_seconds = 0.0
        others = float(max(num_reqs - 1, 0)) if verify > 0 else 0.0  # sequences beyond one
        bound = MAX_RATIO * max(verify, self.fit.verify_scale * verify
                                + self.fit.verify_per_sequence * others)
        verify_seconds = min(verify_seconds, bound)
        idle = (0.0, 0.0) if with_round else (other, float(num_reqs))
        busy = (other, float(num_reqs)) if with_round else (0.0, 0.0)
        new = (drafting, min(draft_seconds, MAX_RATIO * drafting), *idle, *busy)
        self._sums = [FORGET * old + x for old, x in zip(self._sums, new)]
        moments = (verify * verify, verify * others, others * others, verify * verify_seconds,
                   others * verify_seconds)
        self._verify = [FORGET * old + x for old, x in zip(self._verify, moments)]
        self._prior_scale = prior_scale
        return self._refit()

    def _verify_fit(self) -> tuple[float, float]:
        """(s, v) of verify ≈ s · profiled + v · (R − 1): least squares over the decode
        passes, s pulled toward the prior by RIDGE, v >= 0 (a negative cost per sequence would
        be the scale's share)."""
        xx, xr, rr, xy, ry = self._verify
        if xx <= 0:
            return 1.0, 0.0
        if rr <= 0:  # one sequence a pass throughout: nothing to tell apart
            return xy / xx, 0.0
        a = xx * (1 + RIDGE)
        b = xy + RIDGE * xx * self._prior_scale
        det = a * rr - xr * xr
        if det > 1e-12 * a * rr:
            s, v = (b * rr - xr * ry) / det, (a * ry - xr * b) / det
            if v >= 0:
                return s, v
        return b / a, 0.0

    def add_resume(self, drafting: float, draft_seconds: float) -> Fit:
        """A drafting round after a step without one: `drafting` its profiled time (catch-up
        rows left out), `draft_seconds` what it took. On a CPU such a round runs cold (the
        drafter's weights left the caches while the target ran alone), measured at ~1.5x a
        steady one: a switching cost that resuming speculation must repay."""
        if drafting <= 0:
            return self.fit
        new = (drafting, min(max(0.0, draft_seconds), MAX_RATIO * drafting))
        self._resume = [FORGET * old + x for old, x in zip(self._resume, new)]
        return self._refit()

    def _refit(self) -> Fit:
        pd, md, idle_other, idle_reqs, busy_other, busy_reqs = self._sums
        rp, rm = self._resume
        idle = idle_other / idle_reqs if idle_reqs > 0 else None
        busy = busy_other / busy_reqs if busy_reqs > 0 else None
        # One kind of step not measured yet: the other's rate serves both.
        per_request = idle if idle is not None else (busy or 0.0)
        scale, per_sequence = self._verify_fit()
        self.fit = Fit(scale, per_sequence, md / pd if pd > 0 else 1.0, per_request,
                       rm / rp if rp > 0 else 1.0, busy)
        return self.fit

