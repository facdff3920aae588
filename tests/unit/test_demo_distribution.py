"""Invariant 4 of DESIGN.md §4 on the real demo pair: sampled output has the target's distribution.

The joint law of the first two generated tokens (T = 1, top_k = 5, so at most 25 outcomes) is
computed exactly from the target; the speculative engine (draft model, k = 3, whose first step
verifies up to two drafts: accepted, residual and bonus paths all occur) is sampled N = 4000
times with distinct seeds. χ² goodness of fit at significance level α = 1e-3 (cells with an
expected count below 5 merged).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dspark.coordinator.engine import Engine
from dspark.kernels.sampling import warp_probs
from dspark.sampling_params import SamplingParams

ALPHA = 1e-3
N = 4000
TOP_K = 5
PROMPT = "    def __init__(self, name):\n        self."


def warped(engine: Engine, ids: list[int]) -> torch.Tensor:
    model = engine.target.model
    with torch.no_grad():
        h, _ = model.forward_dense(torch.tensor([ids]))
        logits = model.compute_logits(h[0, -1:])
    return warp_probs(logits, torch.tensor([1.0], dtype=torch.float64),
                      torch.tensor([TOP_K]), torch.tensor([1.0], dtype=torch.float64))[0]


def exact_pair_law(engine: Engine, prompt_ids: list[int]) -> dict[tuple[int, int], float]:
    p1 = warped(engine, prompt_ids)
    law = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = warped(engine, prompt_ids + [t1])
        for t2 in torch.nonzero(p2).flatten().tolist():
            law[(t1, t2)] = float(p1[t1] * p2[t2])
    return law


def chi2_pvalue(counts: dict, law: dict, n: int) -> float:
    assert set(counts) <= set(law), f"impossible outcomes sampled: {set(counts) - set(law)}"
    cells = sorted(law, key=law.get, reverse=True)
    obs: list[float] = []
    exp: list[float] = []
    pending_obs, pending_exp = 0.0, 0.0
    for c in cells:  # consecutive cells pooled until the pool expects >= 5
        pending_obs += counts.get(c, 0)
        pending_exp += n * law[c]
        if pending_exp >= 5:
            obs.append(pending_obs)
            exp.append(pending_exp)
            pending_obs, pending_exp = 0.0, 0.0
    if pending_exp > 0:  # a small remainder joins the last pool
        obs[-1] += pending_obs
        exp[-1] += pending_exp
    exp_arr = np.array(exp) * (sum(obs) / sum(exp))
    return float(chisquare(obs, exp_arr).pvalue)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(proposer="draft-model", policy="fixed", k=3, max_num_seqs=64)


def test_two_token_joint_matches_target(engine: Engine) -> None:
    prompt_ids = engine.tokenizer.encode(PROMPT)
    law = exact_pair_law(engine, prompt_ids)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(N)]
    outs = engine.generate([prompt_ids] * N, params)
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        pair = tuple(o.token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    # Speculation really ran: drafts were verified and some (not all) accepted.
    accepted = sum(o.stats["accepted_tokens"] for o in outs)
    verified = sum(o.stats["verified_tokens"] for o in outs)
    assert 0 < accepted < verified
    assert chi2_pvalue(counts, law, N) > ALPHA


def test_seeded_runs_are_deterministic(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    a = engine.generate([PROMPT], params)[0]
    b = engine.generate([PROMPT, "import os\n"], [params, SamplingParams(seed=5)])[0]
    assert a.token_ids == b.token_ids
