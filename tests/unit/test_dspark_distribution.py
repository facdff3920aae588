"""Invariant 4 of DESIGN.md §4 through the DSpark path on the demo pair: sampled output has the
target's distribution.

DSpark drafts nothing on a request's first step (no target hidden rows yet), so the first token
is a plain target sample and the next ones go through speculation: with max_tokens = 4 the second
step verifies up to two Markov-head drafts x_1, x_2 (x_2 sampled from q_2, which depends on x_1),
so accepted, residual and bonus paths all occur. The joint law of the first three tokens
(T = 1, top_k = 2: at most 8 outcomes) is computed exactly from the target; the engine is
sampled N = 3000 times with distinct seeds. χ² goodness of fit at α = 1e-3, cells with an
expected count below 5 pooled (the helper of the draft-model distribution test, restated).
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
N = 3000
TOP_K = 2
PROMPT = "        for i in range(len("  # drafts at positions 1 and 2 both accepted and rejected


def warped(engine: Engine, ids: list[int]) -> torch.Tensor:
    model = engine.target.model
    with torch.no_grad():
        h, _ = model.forward_dense(torch.tensor([ids]))
        logits = model.compute_logits(h[0, -1:])
    return warp_probs(
        logits,
        torch.tensor([1.0], dtype=torch.float64),
        torch.tensor([TOP_K]),
        torch.tensor([1.0], dtype=torch.float64),
    )[0]


def exact_law(engine: Engine, prompt_ids: list[int], length: int) -> dict[tuple[int, ...], float]:
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for seq, mass in law.items():
            p = warped(engine, prompt_ids + list(seq))
            for t in torch.nonzero(p).flatten().tolist():
                nxt[seq + (t,)] = mass * float(p[t])
        law = nxt
    return law


def chi2_pvalue(counts: dict, law: dict, n: int) -> float:
    assert set(counts) <= set(law), f"impossible outcomes sampled: {set(counts) - set(law)}"
    obs: list[float] = []
    exp: list[float] = []
    pending_obs, pending_exp = 0.0, 0.0
    for c in sorted(law, key=law.get, reverse=True):  # pool consecutive cells until >= 5 expected
        pending_obs += counts.get(c, 0)
        pending_exp += n * law[c]
        if pending_exp >= 5:
            obs.append(pending_obs)
            exp.append(pending_exp)
            pending_obs, pending_exp = 0.0, 0.0
    if pending_exp > 0:
        obs[-1] += pending_obs
        exp[-1] += pending_exp
    return float(chisquare(obs, np.array(exp) * (sum(obs) / sum(exp))).pvalue)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(proposer="dspark", policy="fixed", k=7, max_num_seqs=128)


def test_three_token_joint_matches_target(engine: Engine) -> None:
    prompt_ids = engine.tokenizer.encode(PROMPT)
    law = exact_law(engine, prompt_ids, 3)
    params = [
        SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, ignore_eos=True, seed=s)
        for s in range(N)
    ]
    outs = engine.generate([prompt_ids] * N, params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids[:3])] = counts.get(tuple(o.token_ids[:3]), 0) + 1
    accepted = sum(o.stats["accepted_tokens"] for o in outs)
    verified = sum(o.stats["verified_tokens"] for o in outs)
    second = [o.stats["accepted_per_position"] for o in outs]
    assert 0 < accepted < verified
    assert sum(a[1] for a in second if len(a) > 1) > 0  # x_2 (Markov-conditioned q_2) accepted too
    assert chi2_pvalue(counts, law, N) > ALPHA


def test_seeded_dspark_runs_are_deterministic(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    a = engine.generate([PROMPT], params)[0]
    b = engine.generate([PROMPT, "import os\n"], [params, SamplingParams(seed=5)])[0]
    assert a.token_ids == b.token_ids
