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
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

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


class AcceptanceTracker:
    def __init__(self, max_draft: int, window: int = 256, request_window: int = 32) -> None:
        self.max_draft = max_draft
        self._global = [_Queue(window) for _ in range(max_draft)]
        self._requests: dict[str, list[_Queue]] = {}
        self._request_window = request_window

    def _global_list(self) -> list[float]:
        return [
            (q.accepted + GLOBAL_PRIOR_WEIGHT * PRIOR_MEAN) / (q.reached + GLOBAL_PRIOR_WEIGHT)
            for q in self._global
        ]

    def global_rates(self) -> torch.Tensor:  # [max_draft]
        return torch.tensor(self._global_list(), dtype=torch.float64)

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
                for q, gj in zip(queues, g)
            ])
        if not rows:
            return torch.zeros(0, self.max_draft, dtype=torch.float64)
        return torch.tensor(rows, dtype=torch.float64)

    def fill(self, drafts: Drafts) -> Drafts:
        """Drafts with confidences: the proposer's own if it has a head, else tracked rates."""
        if drafts.confidences is not None:
            return drafts
        width = drafts.token_ids.shape[1]
        conf = self.rates(drafts.req_ids)[:, :width] if width else torch.zeros(len(drafts.req_ids), 0)
        return replace(drafts, confidences=conf.to(torch.float64))

    def observe(self, step: StepState) -> None:
        for s in step.requests:
            queues = self._requests.setdefault(
                s.req_id, [_Queue(self._request_window) for _ in range(self.max_draft)]
            )
            # Positions 1..A+1 were reached (A accepted, then the first rejection, if ℓ > A).
            for j in range(min(s.num_planned, s.num_accepted + 1)):
                accepted = j < s.num_accepted
                queues[j].add(accepted)
                self._global[j].add(accepted)
            if s.finish_reason is not None:
                self._requests.pop(s.req_id, None)

    def release(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
