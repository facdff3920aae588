"""q by reference (`dspark.target_worker.draft_probs`): the draft actors' q stays in Ray's object
store until the target's rank 0 fetches it. It arrives exact and in its rows; it outlives the
actor that made it; and a part that cannot be fetched costs its rows their drafts, never the
output (invariant 5)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from dspark.coordinator.engine import Engine
from dspark.coordinator.ray_workers import build_draft_pool, build_target_group, shutdown
from dspark.demo import demo_path
from dspark.draft_worker.draft_model import DraftModelProposer
from dspark.messages import DraftQuery, Drafts, NewRequest, RemoteDraftProbs
from dspark.sampling_params import SamplingParams
from dspark.target_worker.draft_probs import fetch_draft_probs

NUM_BLOCKS = 512


@pytest.fixture
def lost_ref(ray_instance: None) -> Iterator[Any]:
    """A reference whose owner is dead: fetching it raises OwnerDiedError."""
    import ray

    class Owner:  # defined here so that Ray ships it by value (tests are not importable there)
        """Owns the objects it puts: when it dies they are lost, as q would be with its node."""

        def put(self, value: Any) -> list[Any]:
            return [ray.put(value)]  # in a list: the caller gets the reference, not the value

    owner = ray.remote(num_cpus=0)(Owner).remote()
    # Large enough for the object store: a small object would travel inline with its reference.
    [ref] = ray.get(owner.put.remote(torch.ones(2, 3, 20_000, dtype=torch.float64)))
    ray.kill(owner)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until the object store has dropped it (~1 s)
        try:
            ray.get(ref, timeout=10)
        except ray.exceptions.OwnerDiedError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the object outlived its owner")
    yield ref


def test_fetch_assembles_parts_in_their_rows_and_one_hot_elsewhere(ray_instance: None) -> None:
    import ray

    vocab, g = 5, torch.Generator().manual_seed(0)
    q_b = torch.rand(1, 4, vocab, generator=g, dtype=torch.float64)  # row 1; drafted 4, plans 3
    q_cd = torch.rand(2, 2, vocab, generator=g, dtype=torch.float64)  # rows 2 and 3
    remote = RemoteDraftProbs(rows=((1,), (3, 2)), refs=(ray.put(q_b), ray.put(q_cd)))
    tokens = torch.tensor([[4, 0, -1], [1, 2, 3], [0, -1, -1], [2, 2, -1], [-1, -1, -1]])
    q, lost = fetch_draft_probs(remote, tokens, vocab)
    assert lost == frozenset() and q.shape == (5, 3, vocab) and q.dtype == torch.float64
    assert torch.equal(q[1], q_b[0, :3])  # cut to the plan's width
    assert torch.equal(q[3, :2], q_cd[0]) and torch.equal(q[2, :2], q_cd[1])  # in the part's order
    one_hot = torch.zeros(2, vocab, dtype=torch.float64)
    one_hot[0, 4] = one_hot[1, 0] = 1.0
    assert torch.equal(q[0, :2], one_hot)  # row 0 in no part: deterministic drafts
    assert q[0, 2].sum() == 0 and q[4].sum() == 0 and q[2:4, 2].sum() == 0  # no drafts: zeros


def test_a_lost_part_costs_only_its_rows(ray_instance: None, lost_ref: Any) -> None:
    import ray

    q_a = torch.full((1, 2, 5), 0.2, dtype=torch.float64)
    remote = RemoteDraftProbs(rows=((0,), (1, 2)), refs=(ray.put(q_a), lost_ref))
    tokens = torch.tensor([[1, 2], [3, 4], [0, -1]])
    start = time.monotonic()
    q, lost = fetch_draft_probs(remote, tokens, 5, timeout=20.0)
    assert lost == {1, 2} and time.monotonic() - start < 15.0  # the owner's death, not a timeout
    assert torch.equal(q[0], q_a[0])


def test_q_outlives_the_draft_actor_that_made_it(ray_instance: None) -> None:
    """The coordinator owns each actor's q (a return value stored on the actor's node), so a
    draft actor dying after it answered loses nothing of the step it drafted."""
    import ray

    pool = build_draft_pool("draft-model", num_actors=1, num_blocks=NUM_BLOCKS)
    local = DraftModelProposer(demo_path("draft-model"), num_blocks=NUM_BLOCKS)
    prompts = [(5, 9, 14, 3, 7), (2, 8, 8, 1)]
    try:
        queries = []
        for i, prompt in enumerate(prompts):
            new = NewRequest(f"r{i}", prompt, SamplingParams(temperature=0.8, seed=i), seed=i)
            pool.add_request(new)
            local.add_request(new)
            queries.append(DraftQuery(f"r{i}", prompt, 3))
        got, want = pool.propose(queries), local.propose(queries)
        assert isinstance(got.probs, RemoteDraftProbs) and isinstance(want.probs, torch.Tensor)
        ray.kill(pool.actors[0], no_restart=False)
        q, lost = fetch_draft_probs(got.probs, got.token_ids, want.probs.shape[2])
        assert lost == frozenset()
        assert torch.equal(got.token_ids, want.token_ids)
        torch.testing.assert_close(q, want.probs, atol=1e-6, rtol=0)  # the same model, thread
    finally:
        shutdown((None, pool))


def test_a_run_whose_q_is_always_lost_samples_as_plain_decoding(ray_instance: None,
                                                                heldout_prompts: list[str],
                                                                lost_ref: Any) -> None:
    """Every drafted row of every step loses its q (a dead owner stands for a lost draft node):
    rank 0 judges none of those drafts, so each step commits y ~ p_0, drawing one uniform from
    the request's generator, which is exactly what plain decoding does with the same seeds."""
    target = build_target_group(demo_path("target"), tp=1, num_blocks=NUM_BLOCKS)
    pool = build_draft_pool("draft-model", num_actors=1, num_blocks=NUM_BLOCKS)
    propose = pool.propose

    def propose_then_lose_q(queries: list[DraftQuery]) -> Drafts:
        d = propose(queries)
        if d.probs is None:
            return d
        assert isinstance(d.probs, RemoteDraftProbs)
        return replace(d, probs=replace(d.probs, refs=(lost_ref,) * len(d.probs.refs)))

    pool.propose = propose_then_lose_q  # type: ignore[method-assign]
    prompts = heldout_prompts[60:64]
    params = [SamplingParams(temperature=0.9, max_tokens=12, seed=s) for s in range(4)]
    try:
        engine = Engine(proposer="draft-model", policy="fixed", k=3, num_blocks=NUM_BLOCKS,
                        workers=(target, pool))
        got = engine.generate(prompts, params)
    finally:
        shutdown((target, pool))
    plain = Engine(proposer="none", policy="off", num_blocks=NUM_BLOCKS).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert engine.stats.verified_tokens > 0 and engine.stats.accepted_tokens == 0
    assert target.faults["unjudged_rows"] == sum(1 for r in engine.stats.recent for n in r.planned
                                                 if n > 0)
