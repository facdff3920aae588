"""Verification policies: how many drafts each request gets verified in a step (DESIGN.md §2-3).

One interface for every policy:
- `draft_lengths(caps, req_ids, sampled, backlog, prompt_tokens, queued)`: how many drafts to
  ask the proposer for, per request (never above its cap, which comes from max_tokens and the
  context length); `sampled` says whether any request samples (temperature > 0), which makes
  drafting dearer; `backlog` counts each request's committed tokens the drafter has not taken in
  yet (a round first catches up on them); `prompt_tokens` counts the tokens this step's verify
  pass carries beyond one a request (prompts being prefilled), which it pays for whatever is
  drafted; `queued` counts the requests waiting for a place in the batch (None: not known);
- `choose_budget(drafts)`: K, the total draft positions to verify this step;
- `plan_verification(drafts, K)`: ℓ_r per request, Σ ℓ_r <= K, a prefix of each request's drafts;
- `observe(step)`: feedback after commit (acceptance history for adaptive policies);
- `observe_time(seconds, num_tokens, draft_seconds, verify_seconds)`: the step's measured
  duration, and the parts of it spent in the drafting and the verify call (cost-aware policies).

The confidence-scheduled policies (`equal`, `confidence-sync`, `confidence`) implement the same
interface in `coordinator/scheduler.py`, which also holds the registry `make_policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from dspark.messages import Drafts, StepState


class Policy(ABC):
    name: str

    @abstractmethod
    def draft_lengths(
        self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
        backlog: list[int] | None = None, prompt_tokens: int = 0, queued: int | None = None,
    ) -> list[int]: ...

    @abstractmethod
    def choose_budget(self, drafts: Drafts) -> int: ...

    @abstractmethod
    def plan_verification(self, drafts: Drafts, budget: int) -> list[int]: ...

    def observe(self, step: StepState) -> None:  # noqa: B027 - optional hook
        """Called after every commit; adaptive policies learn from it."""

    def observe_time(  # noqa: B027 - optional hook
        self, seconds: float, num_tokens: int, draft_seconds: float, verify_seconds: float
    ) -> None:
        """Called after every step with its measured duration, the tokens it verified (prompt
        tokens included) and the seconds spent in the workers' `propose` and `verify` calls;
        cost-aware policies learn from it."""


class OffPolicy(Policy):
    """No speculation: ℓ = 0 for everyone. The baseline every other policy must beat."""

    name = "off"

    def draft_lengths(
        self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
        backlog: list[int] | None = None, prompt_tokens: int = 0, queued: int | None = None,
    ) -> list[int]:
        return [0] * len(caps)

    def choose_budget(self, drafts: Drafts) -> int:
        return 0

    def plan_verification(self, drafts: Drafts, budget: int) -> list[int]:
        return [0] * len(drafts.req_ids)


class FixedPolicy(Policy):
    """ℓ = k for every request (fewer only where the proposer or the cap gives fewer)."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k={k}: the fixed policy needs k >= 1")
        self.k = k

    def draft_lengths(
        self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
        backlog: list[int] | None = None, prompt_tokens: int = 0, queued: int | None = None,
    ) -> list[int]:
        return [min(self.k, c) for c in caps]

    def choose_budget(self, drafts: Drafts) -> int:
        return int(drafts.num_drafts.clamp(max=self.k).sum())

    def plan_verification(self, drafts: Drafts, budget: int) -> list[int]:
        return drafts.num_drafts.clamp(max=self.k).tolist()
