"""Scheduling must not change the output distribution (the DSpark paper's Appendix A).

One request, γ = 2, target p = (0.7, 0.3), draft q = (0.5, 0.5), conditional confidences
c_1 = 0.8 and c_2 = 0.9 if x_1 = 0 else 0.1 (so the second confidence depends on the first
draft), and a verify pass of B tokens running at SPS(1, 2, 3) = (1, 0.5, 0.45) steps per second.

A look-ahead budget (a global argmax over the *live* survivals, a test double) verifies both
drafts when x_1 = 0 and none when x_1 = 1, so token 0 comes out with probability
0.5·1 + 0.5·0.7 = 0.85. `confidence-sync` (Algorithm 1's early stop) and `confidence` (stale
survivals from two steps back) must keep 0.7. Binomial tests at significance level α = 1e-3
with N = 12,000 trials each (the look-ahead's 0.15 shift is > 30 standard errors).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.policy import Policy
from dspark.coordinator.scheduler import make_policy
from dspark.coordinator.stale_history import survivals_of
from dspark.kernels.acceptance import accept
from dspark.messages import Drafts, RequestStep, StepState

ALPHA = 1e-3
N = 12_000
P = torch.tensor([0.7, 0.3], dtype=torch.float64)
Q = torch.tensor([0.5, 0.5], dtype=torch.float64)
COST = CostModel("appendix-a", verify=(1.0, 1 / 0.5, 1 / 0.45))


class LookAheadPolicy(Policy):
    """Test double: K = argmax over live survivals (peeks at every drafted confidence)."""

    name = "look-ahead"

    def draft_lengths(
        self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
        backlog: list[int] | None = None, prompt_tokens: int = 0, queued: int | None = None,
    ) -> list[int]:
        return [min(2, c) for c in caps]

    def choose_budget(self, drafts: Drafts) -> int:
        a = survivals_of(drafts.confidences)[0]
        theta = [(1 + float(a[:k].sum())) / COST.verify_time(1 + k) for k in range(3)]
        return max(range(3), key=lambda k: theta[k])

    def plan_verification(self, drafts: Drafts, budget: int) -> list[int]:
        return [budget]


def first_token_frequency(policy: Policy, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    zeros = 0
    for trial in range(N):
        rid = f"t{trial}"
        n = policy.draft_lengths([2], (rid,))[0]
        x = torch.multinomial(Q, 2, replacement=True, generator=gen)
        conf = torch.tensor([[0.8, 0.9 if x[0] == 0 else 0.1]], dtype=torch.float64)
        drafts = Drafts((rid,), x[None, :n], torch.tensor([n]),
                        Q.expand(1, n, 2).clone(), conf[:, :n])
        ell = policy.plan_verification(drafts, policy.choose_budget(drafts))[0]
        u = torch.rand(ell + 1, dtype=torch.float64, generator=gen)
        out = accept(P.expand(ell + 1, 2).clone(), torch.tensor([0, ell + 1]),
                     x[None, :ell].clone(), Q.expand(1, ell, 2).clone(), u[None, :ell], u[ell:])
        a = int(out.num_accepted[0])
        first = int(out.output_tokens[0, 0])
        zeros += first == 0
        policy.observe(StepState(trial, ell, (RequestStep(rid, n, ell, a, (first,), 0, "stop"),)))
    return zeros / N


def test_look_ahead_budget_breaks_the_distribution() -> None:
    freq = first_token_frequency(LookAheadPolicy(), seed=1)
    assert binomtest(round(freq * N), N, 0.7).pvalue < ALPHA
    assert abs(freq - 0.85) < 0.02  # the paper's (0.85, 0.15)


@pytest.mark.parametrize("name", ["confidence-sync", "confidence"])
def test_scheduled_policies_keep_the_target_distribution(name: str) -> None:
    policy = make_policy(name, 2, COST, AcceptanceTracker(2), a_priori=False)
    freq = first_token_frequency(policy, seed=2)
    assert binomtest(round(freq * N), N, 0.7).pvalue > ALPHA
