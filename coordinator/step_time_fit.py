"""Online correction of the profiled step time: measured ≈ scale · profiled + R · per_request.

The profile is taken once; measured steps then differ from it in two ways, and the engine
times both parts of each step, so each is read off directly (no regression to split them):
- scale = Σ worker seconds / Σ profiled seconds: the time of the profiled verbs themselves
  (drafting round, verify pass) against the profile's estimate for them. A shared machine (or
  a GPU at another clock) runs everything faster or slower than when it was profiled. By
  itself a scale never changes the budget (the argmax of tokens / time is the same), but read
  as an additive error it would;
- per_request = Σ (seconds − worker seconds) / Σ R: the step's other work (the engine's
  bookkeeping, planning, commit and rollback), about linear in the batch size R. It is a fixed
  cost of every step, so it makes speculation (fewer, longer steps) worth more.

Sums are exponentially weighted (FORGET^age), so the fit follows a machine whose speed drifts.
"""

from __future__ import annotations

from dataclasses import dataclass

FORGET = 0.98  # weight kept by each older step: the fit follows ~50 recent steps


@dataclass(frozen=True)
class Fit:
    scale: float = 1.0
    per_request: float = 0.0  # seconds per request per step

    def apply(self, profiled: float, num_reqs: int) -> float:
        return self.scale * profiled + num_reqs * self.per_request


class StepTimeFit:
    """Running weighted sums of one kind of step's profiled and measured times."""

    def __init__(self) -> None:
        self._profiled = self._worker = self._other = self._reqs = 0.0
        self.fit = Fit()

    def add(self, profiled: float, num_reqs: int, seconds: float, worker_seconds: float) -> Fit:
        """One step: `profiled` its estimate from the profile, `seconds` its measured end-to-end
        time, `worker_seconds` the part spent in the profiled verbs."""
        f = FORGET
        self._profiled = f * self._profiled + profiled
        self._worker = f * self._worker + worker_seconds
        self._other = f * self._other + max(0.0, seconds - worker_seconds)
        self._reqs = f * self._reqs + num_reqs
        if self._profiled > 0 and self._reqs > 0:
            self.fit = Fit(self._worker / self._profiled, self._other / self._reqs)
        return self.fit
