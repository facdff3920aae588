"""Worker faults (issue 7; DESIGN.md §4 invariants 1 and 5): a killed draft actor or target rank
never changes greedy output and never fails a request, and no state leaks afterwards.

Faults are real: the worker's process gets SIGKILL between two engine steps, as a crash would.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from leak_checks import IDLE

from dspark.coordinator.engine import Engine
from dspark.coordinator.ray_workers import build_draft_pool, build_target_group, shutdown
from dspark.coordinator.request import Request
from dspark.demo import demo_path
from dspark.faults import WorkersUnavailable
from dspark.sampling_params import SamplingParams
from dspark.target_worker.runner import TargetRunner

NUM_BLOCKS = 256
GREEDY = SamplingParams(temperature=0, max_tokens=32)
STEPS_BEFORE_FAULT = 3


@pytest.fixture(scope="module")
def prompts(heldout_prompts: list[str]) -> list[str]:
    return heldout_prompts[:6]


@pytest.fixture(scope="module")
def reference(prompts: list[str]) -> list[tuple[int, ...]]:
    engine = Engine(proposer="none", policy="off", max_num_seqs=8, num_blocks=NUM_BLOCKS)
    return [o.token_ids for o in engine.generate(prompts, GREEDY)]


def _kill(actor) -> None:
    import ray

    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)


def _run_with_fault(engine: Engine, prompts: list[str], inject) -> list[Request]:
    """Generate greedily, calling `inject()` after a few steps; requests in prompt order."""
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    for _ in range(STEPS_BEFORE_FAULT):
        engine.step()
    assert all(i in engine._running for i in ids), "requests finished before the fault"
    inject()
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_finished(i) for i in ids]


def _wait_back(pool, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while pool.faults["actors_back"] < 1 and time.monotonic() < deadline:
        pool.take_rebuildable()
        time.sleep(0.2)
    assert pool.faults["actors_back"] == 1, "Ray did not restart the killed draft actor"


def _assert_nothing_held(engine: Engine) -> None:
    assert engine.accounting() == IDLE


def test_killed_draft_actor_changes_nothing_and_its_requests_speculate_again(
    ray_instance, prompts, reference
) -> None:
    pool = build_draft_pool("draft-model", num_actors=2, num_blocks=NUM_BLOCKS)
    try:
        target = TargetRunner(demo_path("target"), NUM_BLOCKS)
        engine = Engine(proposer="draft-model", policy="fixed", k=4, max_num_seqs=8,
                        num_blocks=NUM_BLOCKS, workers=(target, pool))
        victims: list[str] = []
        verified_before: dict[str, int] = {}

        def inject() -> None:
            victims.extend(pool.routes.requests_of(0))
            verified_before.update(
                {r: engine._running[r].stats.verified_tokens for r in victims})
            _kill(pool.actors[0])

        reqs = _run_with_fault(engine, prompts, inject)
        assert [tuple(r.output_ids) for r in reqs] == reference  # invariant 5: output unchanged
        assert victims and pool.faults["actor_failures"] == 1
        assert pool.faults["undrafted_rows"] >= len(victims)  # they decoded plainly meanwhile
        # Rebuilt on the surviving actor, then speculated again: more drafts were verified.
        by_id = {r.req_id: r for r in reqs}
        for r in victims:
            assert by_id[r].rebuilds == 1
            assert by_id[r].stats.verified_tokens > verified_before[r], r
        assert all(by_id[r].rebuilds == 0 for r in by_id if r not in victims)
        # The restarted actor comes back and takes new requests.
        _wait_back(pool)
        more = engine.generate(prompts[:2], GREEDY)
        assert [o.token_ids for o in more] == reference[:2]
        assert all(a["served"] > 0 for a in pool.actor_requests())
        _assert_nothing_held(engine)
    finally:
        shutdown((None, pool))


def test_lone_draft_actor_killed_requests_decode_plainly_until_it_returns(
    ray_instance, prompts, reference
) -> None:
    pool = build_draft_pool("ngram", num_actors=1)
    try:
        target = TargetRunner(demo_path("target"), NUM_BLOCKS)
        engine = Engine(proposer="ngram", policy="fixed", k=4, max_num_seqs=8,
                        num_blocks=NUM_BLOCKS, workers=(target, pool))
        reqs = _run_with_fault(engine, prompts, lambda: _kill(pool.actors[0]))
        assert [tuple(r.output_ids) for r in reqs] == reference
        assert pool.faults["actor_failures"] == 1
        assert pool.faults["undrafted_rows"] >= len(prompts)
        _wait_back(pool)
        accepted = engine.stats.accepted_tokens
        assert [o.token_ids for o in engine.generate(prompts[:3], GREEDY)] == reference[:3]
        assert engine.stats.accepted_tokens > accepted  # the restarted actor drafts again
        _assert_nothing_held(engine)
    finally:
        shutdown((None, pool))


@pytest.fixture()
def own_tp2_group(ray_instance):
    group = build_target_group(demo_path("target"), tp=2, num_blocks=NUM_BLOCKS)
    pool = build_draft_pool("ngram", num_actors=1)
    yield group, pool
    shutdown((group, pool))


def test_killed_target_rank_rebuilds_group_and_reprefills_without_changing_output(
    own_tp2_group, prompts, reference
) -> None:
    group, pool = own_tp2_group
    engine = Engine(proposer="ngram", policy="fixed", k=4, max_num_seqs=8,
                    num_blocks=NUM_BLOCKS, workers=(group, pool))
    old_actors = list(group.actors)
    reqs = _run_with_fault(engine, prompts, lambda: _kill(group.actors[1]))
    assert [tuple(r.output_ids) for r in reqs] == reference  # no lost or duplicated tokens
    assert group.recoveries == 1 and group.actors != old_actors
    assert all(r.rebuilds == 1 for r in reqs)  # every running request re-prefilled once
    digests = group.decision_digests()
    assert digests[0] == digests[1] and digests[0][0] > 0  # the new ranks agree (invariant 6)
    _assert_nothing_held(engine)


def test_target_group_that_cannot_be_rebuilt_fails_fast_with_workers_unavailable(
    own_tp2_group, prompts
) -> None:
    group, pool = own_tp2_group
    group.max_recoveries = 0
    engine = Engine(proposer="ngram", policy="fixed", k=4, max_num_seqs=8,
                    num_blocks=NUM_BLOCKS, workers=(group, pool))
    engine.add_request(prompts[0], GREEDY)
    engine.step()
    _kill(group.actors[1])
    start = time.monotonic()
    with pytest.raises(WorkersUnavailable, match="failed 1 times in a row"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 60  # a clear error, not a hang


def test_streams_survive_a_killed_target_rank_over_grpc(own_tp2_group, prompts, reference) -> None:
    """Through the real server: chunks streamed before and after the rebuild concatenate to the
    reference exactly (nothing lost, nothing sent twice)."""
    import dspark
    from dspark.coordinator.server import Server

    group, pool = own_tp2_group
    engine = Engine(proposer="ngram", policy="fixed", k=4, max_num_seqs=8,
                    num_blocks=NUM_BLOCKS, workers=(group, pool))
    with Server(engine) as server, dspark.Client(server.address, timeout=120) as client:
        stream = client.stream(prompts[1], GREEDY)
        tokens = list(next(stream).token_ids)
        _kill(group.actors[0])
        last = None
        for chunk in stream:
            tokens += chunk.token_ids
            last = chunk
        assert tuple(tokens) == reference[1]
        assert last is not None and last.finish_reason is not None
        assert group.recoveries == 1
        # Unrecoverable: the next fault ends the request with UNAVAILABLE and a clear message.
        group.max_recoveries = 0
        stream = client.stream(prompts[2], GREEDY)
        next(stream)
        _kill(group.actors[1])
        with pytest.raises(dspark.errors.Unavailable, match="target group"):
            for _ in stream:
                pass
