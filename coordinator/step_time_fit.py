"""Online correction of the profiled step time:
measured ≈ verify_scale · profiled verify + draft_scale · profiled drafting + R · per_request.

The profile is taken once; measured steps then differ from it in two ways, and the engine
times each part of a step, so each is read off directly (no regression to split them):
- scales = Σ measured seconds / Σ profiled seconds of the verify calls and, apart, of the
  drafting calls. A shared machine (or a GPU at another clock) runs faster or slower than when
  it was profiled, and not alike for both: the profile's drafting rounds and verify passes
  cannot match every live batch (contexts, catch-up lengths). A common scale never changes the
  budget (the argmax of tokens / time is the same), but read as an additive error it would,
  and a drafting round dearer or cheaper than profiled changes what speculation costs;
- per_request = Σ (seconds − worker seconds) / Σ R: the step's other work (the engine's
  bookkeeping, planning, commit and rollback), about linear in the batch size R. It is a fixed
  cost of every step, so it makes speculation (fewer, longer steps) worth more.

Sums are exponentially weighted (FORGET^age), so the fit follows a machine whose speed drifts.
One step counts for at most MAX_RATIO times its profile: a single outlier (an actor's first
call, a collector pause) cannot set a scale beyond that. No prior pulls a scale toward 1: a
profile that is far off (a drafting round profiled at 100x its live cost) must be left behind
within a few steps, or the budget never speculates and never learns otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FORGET = 0.98  # weight kept by each older step: the fit follows ~50 recent steps
MAX_RATIO = 4.0  # a step's measured part counts for at most this many times its profile


@dataclass(frozen=True)
class Fit:
    verify_scale: float = 1.0
    draft_scale: float = 1.0
    per_request: float = 0.0  # seconds per request per step
    resume_scale: float = 1.0  # `draft_scale` of a round after a step without one (cold)

    def apply(self, verify: Any, drafting: Any, num_reqs: int, cold: bool = False) -> Any:
        """Estimated seconds of a step whose profiled parts are `verify` and `drafting` (floats,
        or tensors of many candidate steps); `cold`: the drafter ran no round in the step
        before."""
        scale = self.resume_scale if cold else self.draft_scale
        return self.verify_scale * verify + scale * drafting + num_reqs * self.per_request


class StepTimeFit:
    """Running weighted sums of one kind of step's profiled and measured times."""

    def __init__(self) -> None:
        # [profiled verify, measured verify, profiled drafting, measured drafting, other, R]
        self._sums = [0.0] * 6
        self._resume = [0.0, 0.0]  # [profiled, measured] drafting of rounds after idle steps
        self.fit = Fit()

    def add(self, verify: float, drafting: float, num_reqs: int, seconds: float,
            verify_seconds: float, draft_seconds: float) -> Fit:
        """One step: `verify`, `drafting` its profiled parts; `seconds` its measured end-to-end
        time, `verify_seconds` and `draft_seconds` the parts spent in those calls."""
        other = max(0.0, seconds - verify_seconds - draft_seconds)
        new = (verify, min(verify_seconds, MAX_RATIO * verify),
               drafting, min(draft_seconds, MAX_RATIO * drafting), other, float(num_reqs))
        self._sums = [FORGET * old + x for old, x in zip(self._sums, new)]
        return self._refit()

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
        pv, mv, pd, md, other_sum, reqs = self._sums
        rp, rm = self._resume
        self.fit = Fit(mv / pv if pv > 0 else 1.0, md / pd if pd > 0 else 1.0,
                       other_sum / reqs if reqs > 0 else 0.0, rm / rp if rp > 0 else 1.0)
        return self.fit

