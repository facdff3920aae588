"""How the budget keeps learning what steps cost while its own plans would not show it: probes
of an idle parallel drafter (`probe_interval`), and short stretches of steps that verify
nothing, or the best plan that drafts, where the fit lacks evidence of that kind of step and
the last plan came close to choosing it (`Exploration`). `coordinator.scheduler` decides when
to ask; the stretches are a few steps in a hundred.
"""

from __future__ import annotations

from collections import deque
from statistics import median

from dspark.coordinator.step_time_fit import StepTimeFit

PROBE_EVERY = 16  # a parallel drafter idled by K = 0 still drafts every this many steps ...
PROBE_REQUESTS = 2  # ... for this many requests of the batch (a round costs ~R) ...
PROBE_EVERY_ALONE = 4  # ... and every this many steps for a lone request (`probe_interval`);
PROBE_MAX_GAP = 128  # each probe that finds speculation still not worth it doubles the gap to this
# Where a kind of batch's step-time fit holds less than this weight of decode passes without
# drafts (`StepTimeFit.idle_weight`: ~100 steps since the last ones) ...
IDLE_EVIDENCE = 0.25
EXPLORE_STEPS = 3  # ... its next steps verify nothing, this many in a row (`explores_idle`),
# ... where K = 0 would have won the median of the last FLIP_WINDOW decode steps' plans had
# its time been priced less than this much (a fraction) too dear (`Exploration.flip`)
EXPLORE_ERROR = 1.0
FLIP_WINDOW = 16
# The same the other way (`explores_rounds`): where the fit holds less than this weight of
# steady drafting rounds (~230 steps after a long stretch of them, ~70 after an exploration's
# two) and the last plan's K = 0 would have lost to its best K > 0 had that been priced less
# than this much (a fraction) cheaper, the next EXPLORE_STEPS steps verify that best K > 0.
ROUND_EVIDENCE = 0.5
EXPLORE_ROUND_ERROR = 0.25
# ... and at least this many steps after the last such stretch, doubled by each one since the
# budget last chose K > 0 itself, up to PROBE_MAX_GAP << 3
EXPLORE_ROUND_GAP = 64


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


def flip_error(idle_time: float, best_rate: float, best_value: float, num_reqs: int,
                price: float | None) -> float:
    """By how much (a fraction) K = 0's `idle_time` must overstate its cost for K = 0 to
    beat the best plan (its `best_rate` tokens a second, its `best_value` at `price`); 0
    where K = 0 is the best plan, inf where it cannot win at any cost."""
    if price is None:  # ratios: K = 0 wins once R / t0 reaches the best rate
        return max(0.0, idle_time * best_rate / num_reqs - 1.0)
    room = num_reqs - best_value  # K = 0 wins once R − price · t0 reaches the best value
    return max(0.0, price * idle_time / room - 1.0) if room > 0 else float("inf")

def round_flip_error(idle_rate: float, idle_value: float, tokens: float, seconds: float,
                      price: float | None) -> float:
    """By how much (a fraction of its time) a plan that drafts (its `tokens` in `seconds`)
    must be priced too dear for K = 0 (its `idle_rate` tokens a second, its `idle_value` at
    `price`) to have beaten it: 0 where it would win as priced."""
    if price is None:
        return max(0.0, 1.0 - tokens / seconds / idle_rate)
    return max(0.0, (idle_value - (tokens - price * seconds)) / (price * seconds))


class Exploration:
    """The probes' backoff and the exploration stretches' state: how close the last plan came
    to flipping either way (`flip`, `round_flip`, set by `BudgetedPolicy.best_plan`), the steps
    left of a stretch, and when the last stretch of rounds began."""

    def __init__(self) -> None:
        self.idle_probes = 0  # probes since the last step with K > 0 (`probe_interval`)
        self.explore_left = 0  # further steps of a stretch with K = 0 (`explores_idle`)
        # K = 0's overpricing that would have flipped each of the last decode steps' plans
        self.flips: deque[float] = deque(maxlen=FLIP_WINDOW)
        self.round_flip = 0.0  # the same of the best K > 0, where K = 0 won it
        self.explore_rounds_left = 0  # further steps of a stretch with K > 0 (`explores_rounds`)
        self.exploring_rounds = False  # this step's plan is the best with K > 0
        self.round_explorations = 0  # stretches since the budget last chose K > 0 itself
        self.explored_at = -(PROBE_MAX_GAP << 3)  # the step the last such stretch began

    @property
    def flip(self) -> float:
        """The median of the last FLIP_WINDOW decode steps' margins (`note_flip`); 0 before
        the first."""
        return median(self.flips) if self.flips else 0.0

    def note_flip(self, margin: float) -> None:
        """A decode step's plan would have been K = 0 had that been priced `margin` (a
        fraction) too dear (`flip_error`)."""
        self.flips.append(margin)

    def explores_idle(self, idle: bool, fit: StepTimeFit | None, prefills: bool) -> bool:
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
        speculation pays 30%), unless K = 0 would have lost most recent plans even priced
        EXPLORE_ERROR too dear, far beyond any such error.

        The margin is the median over recent decode steps (`flip`), not the last step's: one
        step's plan follows its stale row, and a few hard blocks bring any plan near K = 0 (a
        lone request, T = 0: per-step margins 0.3 / 2.0 / 36 at the 5th / 50th / 95th
        percentile), so whether K = 0 was measured hung on the one step at which the evidence
        faded. Where the median itself sits below EXPLORE_ERROR the stretches stay: at 1 in
        flight, T = 0, on a host where a step with drafts made ~1.7x the tokens a ms of one
        without, 18 stretches of 3 in 1,753 steps, 0.8% of the run (docs/scheduler.md)."""
        if prefills:
            return False
        if self.explore_left > 0:
            self.explore_left -= 1
            return True
        if (idle or self.flip >= EXPLORE_ERROR or fit is None or not fit.knows_verify
                or fit.idle_weight >= IDLE_EVIDENCE):
            return False
        self.explore_left = EXPLORE_STEPS - 1
        return True

    def explores_rounds(self, idle: bool, fit: StepTimeFit | None, step: int, prefills: bool
                        ) -> bool:
        """Whether this step verifies the best plan that drafts, K = 0 aside, to learn what such
        a step costs now: EXPLORE_STEPS steps in a row, after a step with K = 0, once the fit of
        this kind of batch holds less than ROUND_EVIDENCE of steady drafting rounds
        (`StepTimeFit.round_weight`), where that plan came within EXPLORE_ROUND_ERROR of
        winning, outside steps that prefill.

        `explores_idle` the other way. What a step with a round costs beyond one without (the
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
        if prefills:
            return False
        if self.explore_rounds_left > 0:
            self.explore_rounds_left -= 1
            return True
        gap = min(EXPLORE_ROUND_GAP << self.round_explorations, PROBE_MAX_GAP << 3)
        if (not idle or self.round_flip >= EXPLORE_ROUND_ERROR or fit is None
                or fit.round_weight >= ROUND_EVIDENCE or step - self.explored_at < gap):
            return False
        self.explore_rounds_left = EXPLORE_STEPS - 1
        self.explored_at = step
        self.round_explorations = min(self.round_explorations + 1, 8)
        return True
