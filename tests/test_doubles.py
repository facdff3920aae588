"""Test doubles shared by several test files (fakes over mocks: they run the real interfaces)."""

from __future__ import annotations

import random

from dspark.coordinator.policy import Policy
from dspark.messages import Drafts


class RandomPolicy(Policy):
    """Random draft lengths and a random verified prefix per request."""

    name = "random"

    def __init__(self, rng: random.Random, k: int) -> None:
        self.rng, self.k = rng, k

    def draft_lengths(
        self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
        backlog: list[int] | None = None, prompt_tokens: int = 0, queued: int | None = None,
    ) -> list[int]:
        return [self.rng.randint(0, min(self.k, c)) for c in caps]

    def choose_budget(self, drafts: Drafts) -> int:
        return int(drafts.num_drafts.sum())

    def plan_verification(self, drafts: Drafts, budget: int) -> list[int]:
        return [self.rng.randint(0, n) for n in drafts.num_drafts.tolist()]
