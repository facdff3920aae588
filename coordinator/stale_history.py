"""Stale survival history: what the production budget reads (DESIGN.md §3).

The `confidence` policy chooses K from survivals two steps back and earlier, never from the
current step's drafts, so the budget cannot leak the tokens it decides about.
"""

from __future__ import annotations

from collections import deque

import numpy as np

STALE_STEPS = 2  # the paper's production scheduler reads confidences from two steps back
SMOOTHING = 0.3  # weight of a stale row one step newer than the rest of its running average
LONG_RUN = 0.02  # the same for the long-run average (`StaleRow.long_run`: ~50 rows)


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

    def __init__(self, long_run: bool = False) -> None:
        """`long_run`: also keep `long_run`, the same rows' average at LONG_RUN (~50 rows): the
        batch means' is the row of a request without rows of its own."""
        self._recent: deque[tuple[int, np.ndarray]] = deque()  # (step, row [γ]), not yet read
        self.value: np.ndarray | None = None  # [γ]
        self.long_run: np.ndarray | None = None  # [γ], kept only if asked for
        self._keeps_long_run = long_run
        self._step = 0  # the step of the newest row in `value`

    def push(self, step: int, row: np.ndarray) -> None:
        self._recent.append((step, row))

    def value_at(self, step: int) -> np.ndarray | None:
        while self._recent and self._recent[0][0] <= step - STALE_STEPS:
            pushed, old = self._recent.popleft()
            keep = 0.0 if self.value is None else (1 - SMOOTHING) ** max(1, pushed - self._step)
            self.value = old if self.value is None else (1 - keep) * old + keep * self.value
            if self._keeps_long_run:
                self.long_run = (old if self.long_run is None
                                 else LONG_RUN * old + (1 - LONG_RUN) * self.long_run)
            self._step = pushed
        return self.value
