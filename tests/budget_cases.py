"""Fabricated drafts and step results for the budgeted policies' tests (no model): the drafts a
proposer would return, the step a commit would report, and a loop that runs a policy over a
batch against a cost model as the engine would."""

from __future__ import annotations

import numpy as np
import torch

from dspark.messages import Drafts, RequestStep, StepState


def drafts_of(conf: list[list[float]], ids: tuple[str, ...] | None = None) -> Drafts:
    c = torch.tensor(conf, dtype=torch.float64)
    ids = ids or tuple(f"r{i}" for i in range(len(conf)))
    return Drafts(ids, torch.zeros(c.shape, dtype=torch.long), torch.full((len(conf),), c.shape[1]),
                  None, c)


def step_of(req_ids, planned, accepted, finished: bool = False) -> StepState:
    reason = "length" if finished else None
    return StepState(0, sum(planned), tuple(
        RequestStep(r, p, p, a, (1,) * (a + 1), 10, reason)
        for r, p, a in zip(req_ids, planned, accepted, strict=False)))


def skipped_drafts(ids: tuple[str, ...]) -> Drafts:
    """What a parallel drafter returns when asked for no drafts: width 0, zero counts."""
    n = len(ids)
    return Drafts(ids, torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                  None, torch.zeros(n, 0, dtype=torch.float64))


def run_batch(policy, cost, ids, conf, steps, evict=1.0, budgets=None, round_seconds=0.5):  # noqa: ANN001, ANN201, E501
    """`steps` steps of `policy` over `ids`, the drafts' confidences `conf` for each position:
    verify as profiled, plus `evict` seconds for a pass after a round in this or the previous
    step (the drafter evicted the target's weights), a round `round_seconds`; a request verifying ℓ
    drafts accepts Σ_{j<=ℓ} a_j of them on average (alternating the integers around it).
    Appends (K, depth drafted) per step to `budgets`."""
    budgets = [] if budgets is None else budgets
    drafted_before = False
    survival = np.cumprod(conf)
    for t in range(len(budgets), len(budgets) + steps):
        lengths = policy.draft_lengths([len(conf)] * len(ids), ids)
        d = drafts_of([conf] * len(ids), ids) if any(lengths) else skipped_drafts(ids)
        k = policy.choose_budget(d)
        planned = policy.plan_verification(d, k)
        mean = [float(survival[:p].sum()) for p in planned]
        accepted = [int((t + 1) * m) - int(t * m) for m in mean]
        policy.observe(step_of(ids, planned, accepted))
        tokens = len(ids) + sum(planned)
        drafted = any(lengths)
        verify = cost.verify_time(tokens) + (evict if drafted or drafted_before else 0.0)
        policy.observe_time(verify + round_seconds * drafted, tokens, round_seconds * drafted,
                            verify)
        budgets.append((k, max(lengths)))
        drafted_before = drafted
    return budgets
