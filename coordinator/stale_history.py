"""Stale survival history: what the production budget reads (DESIGN.md §3).

The `confidence` policy chooses K from survivals two steps back and earlier, never from the
current step's drafts, so the budget cannot leak the tokens it decides about.
"""

from __future__ import annotations

from collections import deque

import numpy as np

STALE_STEPS = 2  # the paper's production scheduler reads confidences from two steps back
SMOOTHING = 0.3  # weight of a stale row one step newer than the rest of its running average


class StaleRow:
    """Survival rows of one request (or batch means), read once they are STALE_STEPS steps old.

    `value_at(step)` is an exponential average in time of every row pushed at step
    `step − STALE_STEPS` or earlier (None before there is one): a row pushed g steps after the
    one before it has weight 1 − (1 − SMOOTHING)^g, SMOOTHING for consecutive steps. One
    step's survivals are a noisy guess of the next step's: a budget read from a single row
    follows each unlucky block, and for a lone request an idle drafter then freezes it at K = 0.
    The average follows the text's difficulty instead; and after an idle stretch (no drafts for
    g steps) the rows from before it count for little, so a probe that finds the text easy again
    resumes speculation at once instead of after several more probes. Nothing in it can depend
    on the current step's drafts.
    """

    def __init__(self) -> None:
        self._recent: deque[tuple[int, np.ndarray]] = deque()  # (step, row [γ]), not yet read
        self.value: np.ndarray | None = None  # [γ]
        self._step = 0  # the step of the newest row in `value`

    def push(self, step: int, row: np.ndarray) -> None:
        self._recent.append((step, row))

    def value_at(self, step: int) -> np.ndarray | None:
        while self._recent and self._recent[0][0] <= step - STALE_STEPS:
            pushed, old = self._recent.popleft()
            keep = 0.0 if self.value is None else (1 - SMOOTHING) ** max(1, pushed - self._step)
            self.value = old if self.value is None else (1 - keep) * old + keep * self.value
            self._step = pushed
        return self.value


CALIBRATION_FORGET = 0.99  # weight kept a step by the budget's calibration: ~100 recent steps
CALIBRATION_PRIOR = 4.0  # pseudo-drafts at ratio 1: a new engine trusts the stale rows


class BudgetCalibration:
    """How many drafts the target accepted against what the budget's stale survivals predicted
    for them, over recent steps that verified drafts, per kind of batch (greedy, sampled):
        ρ = (Σ f^age · accepted + w) / (Σ f^age · predicted + w),
    w = CALIBRATION_PRIOR, f = CALIBRATION_FORGET, age in steps; a step's prediction is the sum
    of its n best stale survivals, n the drafts it verified. The budget reads its gain as
    ρ · Σ top-K stale a.

    The stale rows are unbiased on average, but the budget acts on them: it speculates, and
    speculates deep, when they happen to be high, and on those steps the text regresses toward
    its mean (the winner's curse); and the head's high confidences are overconfident on live
    text. Measured before this correction, realised / stale prediction on the steps that
    verified drafts: 0.90 at 1 in flight, T = 1; 0.94 at 4, T = 1; 0.88 at 16, T = 0. The
    ratio is measured on exactly the steps the budget chose, so it absorbs that selection, as
    `DriftCorrection` does the allocation's. It depends on past steps only, never on the
    current drafts: the budget stays stale (DESIGN.md §3). It scales the gain, not the
    survivals, so the order of slots and the prefix rule are untouched.

    The evidence fades by age in steps, not by count: while the budget verifies nothing no new
    evidence comes, and a ratio learned in a bad stretch must not keep speculation off for good
    once the stale rows (which probes keep fresh) say the text turned easy.
    """

    def __init__(self) -> None:
        self._sums = {kind: [0.0, 0.0] for kind in (False, True)}  # [predicted, accepted]
        self._step = {kind: 0 for kind in (False, True)}  # the step the sums are aged to

    def ratio(self, sampled: bool, step: int) -> float:
        """ρ at `step` (no earlier than the last `add`) for greedy (False) or sampled batches."""
        fade = CALIBRATION_FORGET ** (step - self._step[sampled])
        predicted, accepted = self._sums[sampled]
        return (fade * accepted + CALIBRATION_PRIOR) / (fade * predicted + CALIBRATION_PRIOR)

    def add(self, sampled: bool, step: int, predicted: float, accepted: int) -> None:
        """A step that verified drafts: the stale prediction for them and how many were
        accepted."""
        fade = CALIBRATION_FORGET ** (step - self._step[sampled])
        sums = self._sums[sampled]
        sums[0] = fade * sums[0] + predicted
        sums[1] = fade * sums[1] + accepted
        self._step[sampled] = step
