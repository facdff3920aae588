"""One confidence interface for every proposer (DESIGN.md §2-3).

A confidence c_{r,j} estimates the probability that draft j of request r is accepted given that
drafts 1..j-1 were (a conditional rate). Proposers with a confidence head (DSpark) send them in
`Drafts.confidences`; for the others this tracker supplies them from realised acceptance:

- per position j, a global queue and a per-request queue of conditional outcomes: a draft at
  position j counts as *reached* when it was verified and drafts 1..j-1 were accepted, and as
  *accepted* when the target kept it;
- global rate g_j = (accepted_j + α·p0) / (reached_j + α), a Beta prior with mean p0 = 0.6 and
  weight α = 2 pseudo-observations (a new deployment starts optimistic but not certain);
- request rate c_{r,j} = (accepted_{r,j} + β·g_j) / (reached_{r,j} + β) with β = 4: a new request
  starts at the global rate and moves to its own as evidence arrives.
Only the last `window` outcomes per queue count (a request's text can change character).

Tracked confidences never depend on the current drafts' tokens, so they can be used before
drafting (the draft model then drafts no more than the scheduler can admit).

A head's confidences are calibrated offline (STS on held-out text); live traffic differs (at
T = 1 the context is the target's own samples, not the corpus), so `DriftCorrection` rescales
them online by how often the slots it predicted were really accepted, greedy and sampled
requests apart.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from dspark.messages import Drafts, StepState

PRIOR_MEAN = 0.6
GLOBAL_PRIOR_WEIGHT = 2.0
REQUEST_PRIOR_WEIGHT = 4.0


class _Queue:
    """Last `window` (reached, accepted) outcomes of one position."""

    def __init__(self, window: int) -> None:
        self.outcomes: deque[int] = deque(maxlen=window)
        self.accepted = 0  # sum of `outcomes`, kept as they enter and leave the window

    def add(self, accepted: bool) -> None:
        if len(self.outcomes) == self.outcomes.maxlen:
            self.accepted -= self.outcomes[0]
        self.outcomes.append(int(accepted))
        self.accepted += int(accepted)

    @property
    def reached(self) -> int:
        return len(self.outcomes)


DRIFT_WINDOW = 512  # reached slots per position the drift correction remembers
DRIFT_PRIOR = 4.0  # pseudo-slots at ratio 1: a new deployment trusts the offline calibration


class DriftCorrection:
    """Online correction of a confidence head for the drift between its calibration data and
    live traffic.

    Per position j and per kind of request (greedy, sampled), over the last DRIFT_WINDOW reached
    slots (verified, with drafts 1..j−1 accepted): the ratio of accepted drafts to the head's
    predicted conditional confidences,
        ρ_j = (Σ accepted + w) / (Σ c_j + w),   w = DRIFT_PRIOR,
    and the scheduler reads c'_j = min(1, ρ_j · c_j). ρ depends on past steps only, never on the
    current drafts, so the prefix rule (DESIGN.md §3) holds, and survivals of c' still never grow
    with j. The ratio is measured on the slots the scheduler chose, so it also absorbs the
    optimism of choosing the highest estimates.
    """

    def __init__(self, max_draft: int, window: int = DRIFT_WINDOW) -> None:
        self.max_draft = max_draft
        # kind (sampled?) -> position -> last `window` (c_j, accepted) pairs and their sums
        self._slots: dict[bool, list[deque[tuple[float, int]]]] = {
            kind: [deque(maxlen=window) for _ in range(max_draft)] for kind in (False, True)}
        self._sums = {kind: [[0.0, 0.0] for _ in range(max_draft)] for kind in (False, True)}

    def ratios(self, sampled: bool) -> list[float]:
        """ρ_1..ρ_γ for greedy (False) or sampled (True) requests."""
        return [(acc + DRIFT_PRIOR) / (pred + DRIFT_PRIOR) for pred, acc in self._sums[sampled]]

    def correct(self, confidences: torch.Tensor, sampled: Sequence[bool]) -> torch.Tensor:
        """c' = min(1, ρ·c) row by row. confidences: [num_reqs, max_draft]. In numpy (the
        result shares its memory): a handful of floats a request, where each torch op's
        dispatch costs more than the arithmetic."""
        width = confidences.shape[1]
        kinds = set(sampled)
        if len(kinds) == 1:  # one kind in the batch (the usual case): one row for all
            rho = np.array(self.ratios(kinds.pop())[:width])  # [width]
        else:
            both = np.array([self.ratios(False)[:width], self.ratios(True)[:width]])
            rho = both[np.asarray(sampled, dtype=np.intp)]  # [num_reqs, width]
        raw = confidences.detach().cpu().numpy().astype(np.float64, copy=False)
        return torch.from_numpy(np.minimum(raw * rho, 1.0))

    def add(self, sampled: bool, position: int, confidence: float, accepted: bool) -> None:
        """One reached slot at `position` (0-based) with the head's raw conditional confidence."""
        slots, sums = self._slots[sampled][position], self._sums[sampled][position]
        if len(slots) == slots.maxlen:
            old_c, old_a = slots[0]
            sums[0] -= old_c
            sums[1] -= old_a
        slots.append((confidence, int(accepted)))
        sums[0] += confidence
        sums[1] += int(accepted)


class AcceptanceTracker:
    def __init__(self, max_draft: int, window: int = 256, request_window: int = 32,
                 correct_drift: bool = True) -> None:
        self.max_draft = max_draft
        self._global = [_Queue(window) for _ in range(max_draft)]
        self._requests: dict[str, list[_Queue]] = {}
        self._request_window = request_window
        self.drift = DriftCorrection(max_draft) if correct_drift else None
        # req_id -> (sampled?, the head's raw confidences) of the step in flight
        self._raw: dict[str, tuple[bool, list[float]]] = {}

    def _global_list(self) -> list[float]:
        return [
            (q.accepted + GLOBAL_PRIOR_WEIGHT * PRIOR_MEAN) / (q.reached + GLOBAL_PRIOR_WEIGHT)
            for q in self._global
        ]

    def global_rates(self) -> np.ndarray:  # [max_draft] float64
        return np.array(self._global_list())

    def rates(self, req_ids: tuple[str, ...] | list[str]) -> torch.Tensor:  # [num_reqs, max_draft]
        # Plain floats, one tensor at the end: this runs every step over every request.
        g = self._global_list()
        rows = []
        for r in req_ids:
            queues = self._requests.get(r)
            if queues is None:
                rows.append(g)
                continue
            rows.append([
                (q.accepted + REQUEST_PRIOR_WEIGHT * gj) / (q.reached + REQUEST_PRIOR_WEIGHT)
                for q, gj in zip(queues, g, strict=True)
            ])
        if not rows:
            return torch.zeros(0, self.max_draft, dtype=torch.float64)
        return torch.tensor(rows, dtype=torch.float64)

    def fill(self, drafts: Drafts, sampled: Sequence[bool] | None = None) -> Drafts:
        """Drafts with confidences: the proposer's head's (drift-corrected), else tracked rates.
        `sampled[i]` says whether request i samples (temperature > 0); None: all greedy."""
        if drafts.confidences is not None:
            if self.drift is None or drafts.confidences.shape[1] == 0:  # nothing drafted
                self._raw = {}
                return drafts
            kinds = [False] * len(drafts.req_ids) if sampled is None else list(sampled)
            assert len(kinds) == len(drafts.req_ids), (len(kinds), len(drafts.req_ids))
            raw = drafts.confidences.to(torch.float64)
            self._raw = {
                r: (k, row) for r, k, row in zip(drafts.req_ids, kinds, raw.tolist(), strict=True)
            }
            return replace(drafts, confidences=self.drift.correct(raw, kinds))
        width = drafts.token_ids.shape[1]
        conf = (
            self.rates(drafts.req_ids)[:, :width] if width else torch.zeros(len(drafts.req_ids), 0)
        )
        return replace(drafts, confidences=conf.to(torch.float64))

    def observe(self, step: StepState) -> None:
        for s in step.requests:
            queues = self._requests.get(s.req_id)
            if queues is None:  # not `setdefault`: its default would be built every step
                queues = self._requests[s.req_id] = [
                    _Queue(self._request_window) for _ in range(self.max_draft)]
            # Positions 1..A+1 were reached (A accepted, then the first rejection, if ℓ > A).
            head = self._raw.get(s.req_id)
            for j in range(min(s.num_planned, s.num_accepted + 1)):
                accepted = j < s.num_accepted
                queues[j].add(accepted)
                self._global[j].add(accepted)
                if head is not None and self.drift is not None:
                    self.drift.add(head[0], j, head[1][j], accepted)
            if s.finish_reason is not None:
                self._requests.pop(s.req_id, None)
        self._raw = {}

    def release(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
