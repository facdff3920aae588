"""The draft pool: M:N routing, sticky per request, and merged drafts in the query order."""

from __future__ import annotations

import torch

from dspark.coordinator.ray_workers import build_draft_pool, shutdown
from dspark.draft_worker.actor import (
    MAX_QUEUED_VERBS,
    RoutingTable,
    draft_actor_name,
    merge_drafts,
)
from dspark.draft_worker.ngram import NgramProposer
from dspark.messages import DraftQuery, Drafts, NewRequest, RemoteDraftProbs
from dspark.sampling_params import SamplingParams


def _new(i: int) -> NewRequest:
    return NewRequest(f"r{i}", (1, 2, 3), SamplingParams(temperature=0), seed=i)


def _histories(n: int) -> list[list[int]]:
    # Token streams with repeats, so prompt lookup finds drafts of various lengths.
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 6 + i, (30 + 7 * i,), generator=g).tolist() for i in range(n)]


def test_pool_routes_m_to_n_sticky_and_merges_in_query_order(ray_instance) -> None:
    import ray

    pool = build_draft_pool("ngram", num_actors=2)
    local = NgramProposer()
    try:
        assert [ray.get_actor(draft_actor_name(i), namespace="dspark")._actor_id
                for i in range(2)] == [a._actor_id for a in pool.actors]
        for i in range(5):
            pool.add_request(_new(i))
            local.add_request(_new(i))
        assert pool.routes.loads() == [3, 2]
        owner = {f"r{i}": pool.routes.actor_of(f"r{i}") for i in range(5)}
        assert set(owner.values()) == {0, 1}  # M requests over N actors
        hist = _histories(5)
        sent = [0] * 5
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            order = torch.randperm(5, generator=g).tolist()  # queries in a fresh order each step
            queries = []
            for i in order:
                n = 6 + 5 * step
                queries.append(DraftQuery(f"r{i}", tuple(hist[i][sent[i]:n]), num_drafts=1 + i % 4))
                sent[i] = n
            got, want = pool.propose(queries), local.propose(queries)
            assert got.req_ids == want.req_ids == tuple(q.req_id for q in queries)
            assert torch.equal(got.num_drafts, want.num_drafts)
            assert torch.equal(got.token_ids, want.token_ids)
            assert got.token_ids.shape[1] > 0
            for q in queries:
                pool.commit(q.req_id, 0)
        # Sticky: each actor holds exactly the requests routed to it, and they never moved.
        accounts = pool.actor_requests()
        for a in range(2):
            assert accounts[a]["held"] == sorted(r for r, o in owner.items() if o == a)
        assert {r: pool.routes.actor_of(r) for r in owner} == owner
        # Release two of actor 0's requests: the next request goes to the now least-loaded one.
        gone = [r for r, o in owner.items() if o == 0][:2]
        for r in gone:
            pool.release(r)
        pool.add_request(_new(9))
        assert pool.routes.actor_of("r9") == 0 and pool.routes.loads() == [2, 2]
        accounts = pool.actor_requests()
        assert "r9" in accounts[0]["held"] and not set(gone) & set(accounts[0]["held"])
    finally:
        shutdown((None, pool))


def test_routing_table_refuses_double_assignment() -> None:
    table = RoutingTable(3)
    assert [table.assign(f"r{i}") for i in range(4)] == [0, 1, 2, 0]
    try:
        table.assign("r1")
        raise AssertionError("a routed request was routed again")
    except ValueError as e:
        assert "already routed" in str(e)
    assert table.remove("r1") == 1 and table.assign("r5") == 1


def test_merge_leaves_q_where_the_actors_put_it() -> None:
    """Tokens and counts are merged in query order; q is not: the batch carries each part's
    reference with the rows it covers (rank 0 fetches them), and none for parts without q."""
    sampled = Drafts(("b",), torch.tensor([[2, 4, 1]]), torch.tensor([3]), None, None)
    deterministic = Drafts(("a", "c"), torch.tensor([[3], [-1]]), torch.tensor([1, 0]), None, None)
    q_ref = object()  # stands for the Ray reference; merging never looks inside
    merged = merge_drafts(("a", "b", "c"),
                          [([1], sampled, q_ref), ([0, 2], deterministic, None)], False)
    assert merged.token_ids.tolist() == [[3, -1, -1], [2, 4, 1], [-1, -1, -1]]
    assert merged.num_drafts.tolist() == [1, 3, 0] and merged.confidences is None
    assert merged.probs == RemoteDraftProbs(rows=((1,),), refs=(q_ref,))
    assert merge_drafts(("a", "c"), [([0, 1], deterministic, None)], False).probs is None


def test_idle_queries_make_no_call_and_verbs_wait_for_one(ray_instance) -> None:
    """A step that drafts nothing calls no actor; queued verbs travel with the next drafting
    call, or on their own once MAX_QUEUED_VERBS wait, and arrive in order."""
    pool = build_draft_pool("ngram", num_actors=2)
    local = NgramProposer()

    def calls() -> list[int]:
        return [int(b["calls"]) for b in pool.busy()]

    try:
        for i in range(4):
            pool.add_request(_new(i))
            local.add_request(_new(i))
        owner = [pool.routes.actor_of(f"r{i}") for i in range(4)]
        idle = [DraftQuery(f"r{i}", (), 0) for i in range(4)]
        before = calls()
        for _ in range(3):
            got = pool.propose(idle)
            assert got.num_drafts.tolist() == [0] * 4 and got.token_ids.shape == (4, 0)
            for i in range(4):
                pool.commit(f"r{i}", 0)
        assert calls() == before  # 3 idle steps, 12 commits and 4 additions queued: no call
        # Only r0 drafts: only its actor is called, with its queue (the additions first).
        hist = _histories(1)[0]
        queries = [DraftQuery("r0", tuple(hist), 3)] + idle[1:]
        got, want = pool.propose(queries), local.propose(queries)
        assert torch.equal(got.token_ids, want.token_ids) and got.num_drafts.tolist()[1:] == [0] * 3
        called = [c - b for c, b in zip(calls(), before, strict=True)]
        assert called[owner[0]] == 1 and called[1 - owner[0]] == 0
        # An actor that never drafts gets its verbs once MAX_QUEUED_VERBS wait.
        quiet = 1 - owner[0]
        mine = [f"r{i}" for i in range(4) if owner[i] == quiet]
        before, waiting = calls(), len(pool._ops[quiet])  # its additions and commits so far
        steps = 2 * MAX_QUEUED_VERBS // len(mine) + 1
        for _ in range(steps):
            pool.propose(idle)
            for r in mine:
                pool.commit(r, 0)
        sent = calls()[quiet] - before[quiet]
        assert sent == (waiting + steps * len(mine)) // MAX_QUEUED_VERBS >= 2
        pool.release(mine[0])
        assert mine[0] not in pool.actor_requests()[quiet]["held"]  # flushed, in order
    finally:
        shutdown((None, pool))


def test_merge_without_parts_keeps_a_confidence_head_s_shape() -> None:
    merged = merge_drafts(("a", "b"), [], True)
    assert merged.num_drafts.tolist() == [0, 0] and merged.token_ids.shape == (2, 0)
    assert merged.confidences is not None and merged.confidences.shape == (2, 0)
    assert merge_drafts(("a", "b"), [], False).confidences is None
