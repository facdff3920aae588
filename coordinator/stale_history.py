"""Stale survival history: what the production budget reads (DESIGN.md §3).

The `confidence` policy chooses K from survivals two steps back and earlier, never from the
current step's drafts, so the budget cannot leak the tokens it decides about. `StaleRow` is one
request's (or the batch means') running average; `SurvivalHistory` keeps a batch's rows and
answers the budget's question: each request's stale row.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from dspark.coordinator.confidence import AcceptanceTracker

STALE_STEPS = 2  # the paper's production scheduler reads confidences from two steps back
SMOOTHING = 0.3  # weight of a stale row one step newer than the rest of its running average
LONG_RUN = 0.02  # the same for the long-run average (`StaleRow.long_run`: ~50 rows)
# The batch means' rows are read only for a request without rows of its own; between such
# reads they are taken in once this many wait, not every step.
BATCH_PENDING = 16


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
        self._recent: deque[tuple[int, list[float]]] = deque()  # (step, row [γ]), not yet read
        self.value: list[float] | None = None  # [γ]
        self.long_run: list[float] | None = None  # [γ], kept only if asked for
        self._keeps_long_run = long_run
        self._step = 0  # the step of the newest row in `value`

    def push(self, step: int, row: list[float]) -> None:
        self._recent.append((step, row))

    @property
    def pending(self) -> int:
        """Rows pushed and not yet taken into the averages."""
        return len(self._recent)

    def value_at(self, step: int) -> list[float] | None:
        # Plain floats: rows of γ numbers, read and pushed every step, where each numpy call
        # costs more than the arithmetic (~5 µs with the caches a forward pass left cold).
        while self._recent and self._recent[0][0] <= step - STALE_STEPS:
            pushed, old = self._recent.popleft()
            if self.value is None:
                self.value = old
            else:
                keep = (1 - SMOOTHING) ** max(1, pushed - self._step)
                self.value = [(1 - keep) * o + keep * v
                              for o, v in zip(old, self.value, strict=True)]
            if self._keeps_long_run:
                self.long_run = (old if self.long_run is None else
                                 [LONG_RUN * o + (1 - LONG_RUN) * v
                                  for o, v in zip(old, self.long_run, strict=True)])
            self._step = pushed
        return self.value


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


class SurvivalHistory:
    """Every request's `StaleRow` and the batch means' (with its long-run average), pushed by
    the steps that drafted, read by the budget at the current step."""

    def __init__(self, gamma: int, tracker: AcceptanceTracker) -> None:
        self.gamma = gamma
        self.tracker = tracker  # its global rates: the prior of a new deployment
        self.rows: dict[str, StaleRow] = {}
        self.batch = StaleRow(long_run=True)  # the batch means' rows
        self.last_push = -STALE_STEPS - 1  # the last step that pushed rows

    def stale(self, req_ids: tuple[str, ...], step: int) -> np.ndarray:  # [num_reqs, γ]
        """Survivals from two steps back and before: the request's own, else the batch means'
        long-run average, else the tracker's global rates (`fallback_row`). None of these can
        depend on the current step's drafts."""
        rows: list[list[float] | None] = [
            self.rows[r].value_at(step) if r in self.rows else None for r in req_ids]
        if not rows:
            return np.zeros((0, self.gamma))
        if None in rows:  # read only when needed: most steps every request has its own
            fallback = self.fallback_row(step)
            rows = [fallback if row is None else row for row in rows]
        return np.array(rows)

    def fallback_row(self, step: int) -> list[float]:  # [γ]
        """The row of a request without rows of its own: the batch means' long-run average,
        else the tracker's global rates (its documented prior for a new deployment).

        Not the batch means' recent average: with one request in flight that is the last
        request's last few blocks, and where they were hard the next request started idle,
        and with the probes' backoff inherited from the last one it stayed idle for its whole
        life (measured at 1 in flight, T = 0: 2 requests of 8 per round)."""
        self.batch.value_at(step)  # takes in the rows two steps old
        row = self.batch.long_run
        if row is None:
            row = survivals_of(self.tracker.global_rates()[None, : self.gamma])[0].tolist()
        return row

    def remember(self, req_ids: tuple[str, ...], survivals: np.ndarray, step: int,
                 counts: list[int] | None = None) -> None:
        """Push each request's survival row (`counts[i]` drafted positions; None: all γ) into
        its history (and the batch mean into the batch's) at `step`. A row drafted to depth
        d < γ is continued past d with the tracker's realised conditional rates, so a shallow
        step does not read as "never accepted deeper" (the depth would then only ever shrink).
        Rows with nothing drafted leave their history as it is: a missing draft is no evidence
        at all. survivals: [num_reqs, width]."""
        gamma = self.gamma
        width = min(gamma, survivals.shape[1])
        counts = [width] * len(req_ids) if counts is None else [min(c, width) for c in counts]
        if not any(counts):  # an idle step (most steps where speculation does not pay)
            return
        rates = None  # [γ] the tracker's conditional rates, read only for a shallow row
        total = [0.0] * gamma  # Σ of the pushed rows, for the batch mean
        pushed = 0
        for r, row, c in zip(req_ids, survivals.tolist(), counts, strict=True):
            if c == 0:
                continue
            row = row[:c]
            if c < gamma:
                if rates is None:
                    rates = self.tracker.global_rates()[:gamma].tolist()
                last, product = row[-1], 1.0
                for rate in rates[c:]:
                    product *= rate
                    row.append(last * product)
            history = self.rows.get(r)
            if history is None:
                history = self.rows[r] = StaleRow()
            history.push(step, row)
            total = [t + x for t, x in zip(total, row, strict=True)]
            pushed += 1
        self.last_push = step
        self.batch.push(step, [t / pushed for t in total])
        if self.batch.pending > BATCH_PENDING:
            self.batch.value_at(step)  # takes in the rows two steps old

    def forget(self, req_id: str) -> None:
        """Drop a finished request's rows."""
        self.rows.pop(req_id, None)
