"""The cost model's profile of the real worker verbs, its tables' meaning and its cache.

Timings themselves are never asserted (the machine is shared); the structure is: one entry per
size, monotone, positive, persisted and reloaded exactly, scratch requests released."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest

from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.profiler import (
    PROFILE_VERSION,
    draft_grid,
    load_or_profile,
    profile_workers,
    verify_grid,
)
from dspark.draft_worker.draft_model import DraftModelProposer
from dspark.target_worker.runner import TargetRunner

TABLES = ("draft_first", "draft", "draft_first_sampled", "draft_sampled")
VERIFY_TABLES = ("verify", "verify_sampled")


@pytest.fixture(scope="module")
def workers(tiny_pair, one_thread):
    target_dir, drafter_dir = tiny_pair
    return TargetRunner(target_dir, num_blocks=128), DraftModelProposer(drafter_dir, num_blocks=128)


def test_worker_profile_fills_every_table_monotone_and_releases_its_requests(workers) -> None:
    target, proposer = workers
    cost = profile_workers(target, proposer, b_max=12, n_max=5, context=20, repeats=1)
    assert len(cost.verify) == 12
    for name in VERIFY_TABLES + TABLES:
        table = getattr(cost, name)
        assert len(table) == (12 if name in VERIFY_TABLES else 5), name
        assert all(t > 0 for t in table) or name in ("draft", "draft_sampled"), name
        assert all(a <= b for a, b in pairwise(table)), f"{name} is not monotone"
    assert cost.meta["method"] == PROFILE_VERSION
    assert cost.catch_up >= 0.0 and cost.catch_up_time(10) == pytest.approx(10 * cost.catch_up)
    assert target.usage() == {"requests": [], "used_blocks": 0}
    assert proposer.usage() == {"requests": [], "used_blocks": 0}


def test_drafting_rounds_are_timed_at_the_profiled_context(workers) -> None:
    """Each round adds CATCH_UP committed tokens to its requests; left alone, the requests in
    every size's rounds grew by hundreds of tokens and the large rounds were priced at that
    context. No round may start past `context` + CONTEXT_SLACK cached tokens."""
    from dspark.coordinator.profiler import CONTEXT_SLACK

    target, proposer = workers
    seen: list[int] = []
    propose = proposer.propose

    def recording(queries):  # noqa: ANN001, ANN202
        seen.extend(proposer.cache.length(q.req_id) for q in queries if q.new_token_ids)
        return propose(queries)

    proposer.propose = recording
    try:
        profile_workers(target, proposer, b_max=2, n_max=5, context=20, repeats=2)
    finally:
        del proposer.propose  # the class's method again
    rounds = [n for n in seen if n > 0]  # a prefill starts from an empty cache
    assert len(rounds) > 100  # the profile really ran many rounds on the same requests
    assert max(rounds) <= 20 + CONTEXT_SLACK
    assert proposer.usage() == {"requests": [], "used_blocks": 0}


def test_verify_grid_is_dense_then_strided_and_ends_at_b_max() -> None:
    assert verify_grid(12) == list(range(1, 13))
    assert verify_grid(40) == list(range(1, 17)) + [24, 32, 40]
    assert verify_grid(45) == list(range(1, 17)) + [24, 32, 40, 45]


def test_no_proposer_gets_no_draft_tables(workers) -> None:
    cost = profile_workers(workers[0], None, b_max=3, n_max=2, context=8, repeats=1)
    assert len(cost.verify) == 3 and all(getattr(cost, n) == () for n in TABLES)
    assert cost.draft_time(4, 3) == 0.0


def test_verify_profile_times_one_request_per_pass(workers, monkeypatch) -> None:
    """Each profiled pass of B tokens is one request (an anchor and B − 1 drafts), so the table's
    slope is a further token's cost, not a share of a further sequence's."""
    target = workers[0]
    plans = []
    verify = target.verify

    def recorded(plan):
        plans.append(plan)
        return verify(plan)

    monkeypatch.setattr(target, "verify", recorded)
    profile_workers(target, None, b_max=20, n_max=2, context=8, repeats=1)
    assert all(len(plan.req_ids) == 1 for plan in plans)
    timed = {(plan.draft_probs is not None, plan.num_draft[0]) for plan in plans[1:]}
    assert {n for sampled, n in timed if not sampled} >= {b - 1 for b in verify_grid(20)}
    assert {n for sampled, n in timed if sampled} == {b - 1 for b in verify_grid(20)} - {0}
    assert target.usage() == {"requests": [], "used_blocks": 0}


def test_drafting_round_cost_first_position_then_each_and_sampled_tables() -> None:
    cost = CostModel("t", verify=(1.0, 2.0), draft=(0.1, 0.2), draft_first=(0.5, 0.6),
                     draft_sampled=(0.3, 0.4), draft_first_sampled=(0.9, 1.0))
    assert cost.draft_time(2, 0) == 0.0
    assert cost.draft_time(2, 1) == pytest.approx(0.6)
    assert cost.draft_time(2, 3) == pytest.approx(0.6 + 2 * 0.2)
    assert cost.draft_time(1, 3, sampled=True) == pytest.approx(0.9 + 2 * 0.3)
    pos = np.array([0, 1, 2, 4])
    for sampled in (False, True):
        expected = [cost.step_time(1 + i, 2, int(p), sampled) for i, p in enumerate(pos)]
        rounds = [cost.draft_time(2, int(p), sampled) for p in pos]
        times = cost.verify_times(1, len(pos), sampled) + np.array(rounds)
        assert times.tolist() == pytest.approx(expected)
    # A forward-only profile (no draft_first) keeps the old meaning: positions x per position.
    old = CostModel("t", verify=(1.0,), draft=(0.1, 0.2))
    assert old.draft_time(2, 3) == pytest.approx(0.6)
    assert old.draft_time(2, 3, sampled=True) == pytest.approx(0.6)


def test_profile_persists_reloads_and_is_cached_per_layout(workers, tiny_pair, tmp_path) -> None:
    target, proposer = workers
    target_dir, drafter_dir = tiny_pair
    kwargs = dict(b_max=4, n_max=3, context=8, repeats=1)
    first = load_or_profile(target_dir, drafter_dir, target, proposer, tmp_path, **kwargs)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and "local" in files[0].name and PROFILE_VERSION in files[0].name
    assert CostModel.load(files[0]) == first
    again = load_or_profile(target_dir, drafter_dir, target, proposer, tmp_path, **kwargs)
    assert again == first  # read back, not measured again (timings would differ)
    load_or_profile(target_dir, drafter_dir, target, proposer, tmp_path, layout="TargetGroup-tp2",
                    **kwargs)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_draft_grid_covers_small_sizes_and_ends_at_n_max() -> None:
    for n_max in (1, 5, 8, 9, 64, 100):
        grid = draft_grid(n_max)
        assert grid[: min(8, n_max)] == list(range(1, min(8, n_max) + 1))
        assert grid[-1] == n_max and grid == sorted(set(grid))


def test_parallel_drafters_are_profiled_by_round_and_by_position(tmp_path, one_thread) -> None:
    """DSpark (target hidden rows in, one block pass) and n-gram lookup: a round of 1 and of
    `block` positions are timed; draft_first is the first, `draft` the rest's share per
    further position (never negative), and a round of d positions costs first + (d − 1)·each."""
    from tiny_checkpoints import write_tiny_checkpoint

    from dspark.draft_worker.dspark_checkpoint import new_drafter, save_drafter
    from dspark.draft_worker.dspark_proposer import DSparkProposer
    from dspark.draft_worker.ngram import NgramProposer

    target_dir = write_tiny_checkpoint(tmp_path / "target", "qwen3", layers=2, seed=1)
    save_drafter(new_drafter(target_dir, block_size=4, num_draft_layers=1, target_layer_ids=[0, 1],
                             mask_token_id=9, markov_rank=8), tmp_path / "dspark")
    dspark = DSparkProposer(tmp_path / "dspark", target_dir, num_blocks=256)
    target = TargetRunner(target_dir, num_blocks=128, hidden_layers=dspark.hidden_layers)
    for proposer in (dspark, NgramProposer()):
        cost = profile_workers(target, proposer, b_max=3, n_max=4, context=12, repeats=1,
                               block=4)
        for name in TABLES:
            table = getattr(cost, name)
            assert len(table) == 4, name
            assert all(t > 0 if name.startswith("draft_first") else t >= 0 for t in table), name
        assert cost.draft_time(3, 1) == cost.draft_first[2]
        assert cost.draft_time(3, 4) == pytest.approx(cost.draft_first[2] + 3 * cost.draft[2])
        assert proposer.usage()["requests"] == []
    assert target.usage() == {"requests": [], "used_blocks": 0}


def test_interleaved_medians_time_every_size_in_each_round_in_a_new_order() -> None:
    from dspark.coordinator.cost_model import interleaved_medians

    calls: list[int] = []
    fns = [lambda i=i: calls.append(i) for i in range(6)]
    medians = interleaved_medians(fns, repeats=4, seed=1)
    assert len(medians) == 6 and all(m >= 0 for m in medians)
    rounds = [calls[i:i + 6] for i in range(0, len(calls), 6)]
    assert len(rounds) == 5  # a warm-up round, then 4 timed ones
    assert all(sorted(r) == list(range(6)) for r in rounds)  # each round runs every fn once
    assert len({tuple(r) for r in rounds}) > 1  # in shuffled orders


def test_sampled_batches_read_the_sampled_verify_table_if_profiled() -> None:
    cost = CostModel("t", verify=(1.0, 2.0), verify_sampled=(1.5, 3.0))
    assert cost.verify_time(2) == 2.0 and cost.verify_time(2, sampled=True) == 3.0
    assert cost.step_time(2, 1, 0, sampled=True) == 3.0
    verify = cost.verify_times(1, 2, True)
    assert verify.tolist() == [1.5, 3.0] and cost.draft_time(1, 0, sampled=True) == 0.0
    assert CostModel("t", verify=(1.0, 2.0)).verify_time(2, sampled=True) == 2.0  # older profile


def test_a_profiled_drafting_round_is_timed_on_its_second_call() -> None:
    """The profile interleaves sizes, so a round's first call runs cold; the scheduler prices
    steady rounds (a request that drafts every step) with it."""
    import time

    from dspark.coordinator.profiler import _round

    class ColdThenWarm:
        def __init__(self) -> None:
            self.calls = 0

        def propose(self, queries: list) -> None:  # noqa: ANN001
            self.calls += 1
            time.sleep(0.05 if self.calls % 2 else 0.001)

        def commit(self, req_id: str, accepted: int) -> None:
            pass

    proposer = ColdThenWarm()
    seconds = _round(proposer, ["a"], 1, lambda n: None)()
    assert proposer.calls == 2 and seconds < 0.02
