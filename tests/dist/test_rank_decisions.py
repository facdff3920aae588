"""Invariant 6: rank 0 decides acceptance and broadcasts it; every rank returns the decision it
applied and the group compares them, so a sampled workload (where acceptance draws random
numbers) leaves every rank with the same decision log."""

from __future__ import annotations

import pytest

from dspark.coordinator.engine import Engine
from dspark.coordinator.ray_workers import build_draft_pool, shutdown
from dspark.demo import demo_path
from dspark.sampling_params import SamplingParams

NUM_BLOCKS = 512  # as the session's target group (conftest.py)


# ngram drafts are deterministic (q one-hot, sent as None); the draft model's are sampled, and
# their q goes to rank 0 alone (`TargetGroup.verify`): rank 1 must decide without it.
@pytest.mark.parametrize("proposer", ["ngram", "draft-model"])
def test_sampled_run_leaves_identical_decisions_on_every_rank(target_tp2, heldout_prompts,
                                                              proposer: str) -> None:
    prompts = heldout_prompts[100:108]
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=s) for s in range(8)]
    pool = build_draft_pool(proposer, target_dir=demo_path("target"), num_actors=2,
                            num_blocks=NUM_BLOCKS)
    try:
        before = target_tp2.decision_digests()
        engine = Engine(proposer=proposer, policy="fixed", k=3, max_num_seqs=8,
                        num_blocks=NUM_BLOCKS, workers=(target_tp2, pool))
        ray_out = engine.generate(prompts, params)
        after = target_tp2.decision_digests()
    finally:
        shutdown((None, pool))
    assert after[0] == after[1], "ranks hold different decision logs"
    assert after[0][0] - before[0][0] == engine.stats.steps > 0
    assert after[0][1] != before[0][1]
    # Rank 0 draws from each request's own generator, as the in-process runner does: the same
    # seeds give the same tokens (logits differ only in the last bits under TP).
    local = Engine(proposer=proposer, policy="fixed", k=3, max_num_seqs=8, num_blocks=NUM_BLOCKS)
    assert [o.token_ids for o in ray_out] == [o.token_ids for o in local.generate(prompts, params)]
