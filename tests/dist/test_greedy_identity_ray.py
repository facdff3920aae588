"""Invariant 3 over Ray: the TP group and the draft pool behind the same coordinator produce the
in-process engine's greedy tokens (tp = 2 over gloo, 2 draft actors, held-out prompts, fp32).
Invariant 6: every rank took every decision identically."""

from __future__ import annotations

import pytest

from dspark.coordinator.engine import Engine
from dspark.coordinator.ray_workers import build_draft_pool, shutdown
from dspark.demo import demo_path
from dspark.sampling_params import SamplingParams

NUM_BLOCKS = 512  # as the session's target group (conftest.py)

NUM_PROMPTS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def prompts(heldout_prompts: list[str]) -> list[str]:
    return heldout_prompts[-NUM_PROMPTS:]  # the unit tier uses the first ones


@pytest.fixture(scope="module")
def reference(prompts: list[str]) -> list[tuple[int, ...]]:
    """The in-process engine, target alone."""
    engine = Engine(proposer="none", policy="off", max_num_seqs=8, num_blocks=NUM_BLOCKS)
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


# First in this module: it starts its own tp = 2 group under the same actor names as
# `target_tp2` (module-scoped), which the next test starts.
def test_dspark_over_ray_greedy_identical_to_in_process_engine(ray_instance, prompts,
                                                                reference) -> None:
    """The default deployment: DSpark draft actors fed the target's hidden rows by a tp = 2
    group that returns them (layers gathered across ranks)."""
    from dspark.coordinator.ray_workers import build_ray_workers

    target, pool = build_ray_workers(demo_path("target"), "dspark", tp=2, num_draft_actors=2,
                                     num_blocks=NUM_BLOCKS)
    try:
        assert pool.hidden_layers == (1, 3, 5)
        engine = Engine(proposer="dspark", policy="fixed", k=7, max_num_seqs=8,
                        num_blocks=NUM_BLOCKS, workers=(target, pool))
        outs = engine.generate(prompts, GREEDY)
        mismatches = [i for i, (o, r) in enumerate(zip(outs, reference, strict=True))
                      if o.token_ids != r]
        assert not mismatches, f"prompts {mismatches} differ from the in-process engine"
        assert engine.stats.accepted_tokens > engine.stats.steps  # more than one per pass
        digests = target.decision_digests()
        assert digests[0] == digests[1]
    finally:
        shutdown((target, pool))


@pytest.mark.parametrize("proposer", ["draft-model", "ngram"])
def test_tp2_greedy_identical_to_in_process_engine(target_tp2, prompts, reference,
                                                   proposer: str) -> None:
    pool = build_draft_pool(proposer, target_dir=demo_path("target"), num_actors=2,
                            num_blocks=NUM_BLOCKS)
    try:
        digests_before = target_tp2.decision_digests()
        engine = Engine(proposer=proposer, policy="fixed", k=4, max_num_seqs=8,
                        num_blocks=NUM_BLOCKS, workers=(target_tp2, pool))
        outs = engine.generate(prompts, GREEDY)
        mismatches = [i for i, (o, r) in enumerate(zip(outs, reference, strict=True))
                      if o.token_ids != r]
        assert not mismatches, f"prompts {mismatches} differ from the in-process engine"
        assert engine.stats.accepted_tokens > 0  # speculation really ran
        # M:N: both actors drafted, each request on one actor.
        accounts = pool.actor_requests()
        assert [a["held"] for a in accounts] == [[], []]  # every request was released
        assert all(a["served"] > 0 for a in accounts)
        assert sum(a["served"] for a in accounts) == NUM_PROMPTS
    finally:
        shutdown((None, pool))
    # One decision per verify step on every rank, and the same on every rank.
    digests = target_tp2.decision_digests()
    assert digests[0] == digests[1]
    assert digests[0][0] - digests_before[0][0] == engine.stats.steps
