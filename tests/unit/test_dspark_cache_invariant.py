"""Invariants 1 and 2 of DESIGN.md §4 for the DSpark draft state, property-tested.

The DSpark proposer's only state is the projected context: per draft layer, the keys/values of
one row per committed target position before the anchor. After every step, (rows the proposer
holds) + (rows the engine is relaying) = committed tokens − 1, and the held rows equal a fresh
projection of a fresh target prefill of the committed tokens; rejected drafts never enter them.
Random per-request ℓ and accept patterns (sampled drafts at T = 1, greedy at T = 0), EOS/stop
and max_tokens cut-offs, and rebuilds (both caches dropped mid-generation and recomputed by
prefill from the committed tokens). Once every request is done no block is left allocated.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_doubles import RandomPolicy
from tiny_checkpoints import write_tiny_checkpoint

from dspark.coordinator.engine import Engine
from dspark.draft_worker.dspark_checkpoint import new_drafter, save_drafter
from dspark.draft_worker.dspark_proposer import DSparkProposer
from dspark.messages import NewRequest
from dspark.sampling_params import SamplingParams

ATOL, RTOL = 2e-5, 1e-4


@pytest.fixture(scope="module")
def tiny_dspark(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random 2-layer Qwen3 target and a random DSpark drafter reading its layers -1 and 1;
    small weights (flat distributions), so drafts are both accepted and rejected."""
    root = tmp_path_factory.mktemp("dspark_inv")
    target = write_tiny_checkpoint(root / "target", "qwen3", layers=2, seed=1, std=0.1)
    drafter = new_drafter(
        target,
        block_size=7,
        num_draft_layers=2,
        target_layer_ids=[-1, 1],
        mask_token_id=11,
        markov_rank=16,
        std=0.02,
        seed=3,
    )
    save_drafter(drafter, root / "drafter", dtype=torch.float32)
    return target, root / "drafter"


def fresh_context(engine: Engine, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per draft layer k, v [n, kv_heads, hd] from a fresh target prefill of tokens[:-1]."""
    proposer = engine.proposer
    assert isinstance(proposer, DSparkProposer)
    with torch.no_grad():
        _, hidden = engine.target.model.forward_dense(
            torch.tensor([tokens[:-1]]), hidden_layers=proposer.hidden_layers
        )
        rows = proposer.model.context_rows(hidden[0])
        return proposer.model.context_kv(rows, torch.arange(len(tokens) - 1))


def rebuild(engine: Engine, req_id: str) -> None:
    """Drop both caches of a running request; the next step recomputes them from its tokens."""
    req = engine._running[req_id]
    new = NewRequest(req_id, req.prompt_ids, req.params, req.seed)
    for worker in (engine.target, engine.proposer):
        worker.release(req_id)
        worker.add_request(new)
    req.target_length = 0
    engine._sent_to_drafter[req_id] = 0
    engine._pending_hidden.pop(req_id, None)


def check_request(engine: Engine, req_id: str) -> None:
    req = engine._running[req_id]
    tokens = list(req.prompt_ids) + req.output_ids
    proposer = engine.proposer
    held = proposer.context_length(req_id)
    pending = sum(r.shape[0] for r in engine._pending_hidden.get(req_id, []))
    # Rows come from verified positions only: never more than the committed ones, none lost.
    assert held + pending == len(tokens) - 1 == req.target_length
    if held == 0:
        return
    k, v = proposer.cache.read(req_id)  # [layers, held, kv_heads, hd]
    for layer, (k_ref, v_ref) in enumerate(fresh_context(engine, tokens)):
        torch.testing.assert_close(k[layer], k_ref[:held], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(v[layer], v_ref[:held], atol=ATOL, rtol=RTOL)


def run_checked(
    dirs: tuple[Path, Path],
    seed: int,
    num_requests: int,
    k: int,
    temperature: float,
    rebuild_prob: float,
) -> tuple[int, int, int]:
    """Serve random requests, checking every running request after every step.

    Returns (accepted drafts, rejected drafts, rebuilds) so callers can see what was exercised.
    """
    target_dir, drafter_dir = dirs
    rng = random.Random(seed)
    engine = Engine(
        target_dir,
        proposer="dspark",
        drafter=drafter_dir,
        policy="fixed",
        k=k,
        num_blocks=96,
        block_size=4,
        max_num_seqs=3,
    )
    engine.policy = RandomPolicy(rng, k)
    stop_ids = tuple(rng.sample(range(4096), 60))
    for _ in range(num_requests):
        prompt = [rng.randrange(1, 4096) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(
            temperature=temperature,
            max_tokens=rng.randint(1, 30),
            stop_token_ids=stop_ids,
            seed=rng.randrange(1000),
        )
        engine.add_request(prompt, params)
    steps = rebuilds = accepted = rejected = 0
    while engine.has_unfinished():
        for req_id in list(engine._running):
            if rng.random() < rebuild_prob:
                rebuild(engine, req_id)
                rebuilds += 1
        state = engine.step()
        steps += 1
        assert state is not None and steps < 200
        for s in state.requests:
            assert s.num_accepted <= s.num_planned <= s.num_drafted <= 7
            accepted += s.num_accepted
            rejected += int(s.num_accepted < s.num_planned)
        for req_id in engine._running:
            check_request(engine, req_id)
    assert engine.proposer.cache.num_free_blocks == engine.proposer.cache.num_blocks
    assert engine.target.cache.num_free_blocks == engine.target.cache.num_blocks
    return accepted, rejected, rebuilds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    num_requests=st.integers(1, 4),
    k=st.integers(1, 7),
    temperature=st.sampled_from([0.0, 1.0]),
    rebuild_prob=st.sampled_from([0.0, 0.25]),
)
def test_context_rows_equal_fresh_prefill_after_every_step(
    tiny_dspark,
    seed: int,
    num_requests: int,
    k: int,
    temperature: float,
    rebuild_prob: float,
) -> None:
    run_checked(tiny_dspark, seed, num_requests, k, temperature, rebuild_prob)


def test_the_property_run_sees_accepts_rejects_and_rebuilds(tiny_dspark) -> None:
    """A fixed case of the property test: all three events really happen there."""
    accepted, rejected, rebuilds = run_checked(tiny_dspark, 7, 4, 7, 1.0, 0.25)
    assert accepted > 0 and rejected > 0 and rebuilds > 0


def test_no_drafts_until_the_context_is_complete(tiny_dspark) -> None:
    """First step: no target pass yet, so no context and no drafts; the next step drafts."""
    target_dir, drafter_dir = tiny_dspark
    engine = Engine(target_dir, proposer="dspark", drafter=drafter_dir, policy="fixed", k=7)
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    first = engine.step()
    assert first is not None and first.requests[0].num_drafted == 0
    second = engine.step()
    assert second is not None and second.requests[0].num_drafted == 7
    assert engine.proposer.context_length("req-0") == 3  # prompt positions 0..2; anchor at 3


def test_an_idle_drafter_is_sent_nothing_until_it_drafts_again(tiny_dspark) -> None:
    """Steps that draft nothing send no tokens and no hidden rows (they wait in the engine);
    the next query that drafts carries all of them, and the context is then complete."""
    target_dir, drafter_dir = tiny_dspark
    engine = Engine(target_dir, proposer="dspark", drafter=drafter_dir, policy="fixed", k=3)

    def idle_then_three(caps: list[int], *_: object, **__: object) -> list[int]:
        return [0 if 1 <= engine._step_no <= 4 else min(3, c) for c in caps]

    engine.policy.draft_lengths = idle_then_three  # type: ignore[method-assign]
    sent = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda queries: (sent.append(queries), propose(queries))[1]
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(6):
        engine.step()
    idle = [q[0] for q in sent[1:5]]
    assert all(q.num_drafts == 0 and q.new_token_ids == () and q.new_hidden is None for q in idle)
    resumed = sent[5][0]
    req = engine._running["req-0"]
    assert resumed.num_drafts == 3 and resumed.new_hidden is not None
    # The prompt (step 1 drafts nothing: its prompt is in that pass) and five steps' tokens;
    # the prompt's rows (returned by step 1) and four steps' rows.
    assert sent[0][0].num_drafts == 0 and sent[0][0].new_token_ids == ()
    assert len(resumed.new_token_ids) == 3 + 5 and resumed.new_hidden.shape[0] == 3 + 4
    check_request(engine, "req-0")
    assert engine.proposer.context_length("req-0") + sum(
        r.shape[0] for r in engine._pending_hidden.get("req-0", [])) == req.target_length


def test_off_keeps_no_hidden_rows_for_a_drafter_that_never_drafts(tiny_dspark) -> None:
    """With `off` the target still returns the drafter's rows (it was built to), but nothing will
    ever read them: the engine keeps none, where it kept every token's until the request ended."""
    target_dir, drafter_dir = tiny_dspark
    engine = Engine(target_dir, proposer="dspark", drafter=drafter_dir, policy="off")
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for _ in range(6):
        assert engine.step() is not None
    assert engine._running["req-0"].target_length > 3  # still running, prompt and tokens cached
    assert engine._pending_hidden == {}


def test_a_request_whose_prompt_is_in_the_pass_is_planned_no_drafts(tiny_dspark) -> None:
    """The drafter has no context rows for a prompt the target takes in this step: the policy
    sees a cap of 0 for it (a budget must not price slots nobody can draft), the others keep
    theirs, and the next step drafts for it."""
    target_dir, drafter_dir = tiny_dspark
    engine = Engine(target_dir, proposer="dspark", drafter=drafter_dir, policy="fixed", k=3)
    seen: list[list[int]] = []
    draft_lengths = engine.policy.draft_lengths

    def record(caps: list[int], *args: object, **kwargs: object) -> list[int]:
        seen.append(list(caps))
        return draft_lengths(caps, *args, **kwargs)  # type: ignore[arg-type]

    engine.policy.draft_lengths = record  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request([5, 6, 7], params)
    engine.step()  # req-0's prompt
    engine.step()
    engine.add_request([8, 9, 10, 11], params)
    engine.step()  # req-1's prompt beside req-0's decode
    last = engine.step()
    assert seen[0] == [0] and seen[1][0] > 0
    assert seen[2][0] > 0 and seen[2][1] == 0 and min(seen[3]) > 0
    assert last is not None and [s.num_drafted for s in last.requests] == [3, 3]


def test_a_requests_drafts_do_not_depend_on_the_batch_it_drafts_in(tiny_dspark) -> None:
    # Regression guard for the round's context gather (`DSparkProposer._gather_context`): the
    # batch pads every context to the longest and every block to the deepest, and writes each
    # block's keys into the room after the padded context. A request drafted beside others
    # (contexts of 5..61 rows, depths 1..7) must draft what it drafts alone: the same greedy
    # tokens, the same confidences and draft distributions (fp32).
    from dspark.messages import DraftQuery

    target, drafter = tiny_dspark
    rng = torch.Generator().manual_seed(0)
    lengths, depths = [61, 5, 23, 40, 9], [3, 7, 1, 5, 2]
    for temperature in (0.0, 1.0):
        batched = DSparkProposer(drafter, target, num_blocks=64, block_size=4)
        width = batched.model.fc.in_features
        prompts = [tuple(torch.randint(1, 50, (n,), generator=rng).tolist()) for n in lengths]
        rows = [torch.randn(n - 1, width, generator=rng) for n in lengths]
        ids = [f"r{i}" for i in range(len(lengths))]
        params = SamplingParams(temperature=temperature)
        for i, r in enumerate(ids):
            batched.add_request(NewRequest(r, (), params, seed=i))
        batched.propose(
            [DraftQuery(r, p, 0, h) for r, p, h in zip(ids, prompts, rows, strict=False)]
        )
        together = batched.propose(
            [DraftQuery(r, (), d, None) for r, d in zip(ids, depths, strict=False)]
        )
        for i, r in enumerate(ids):
            alone = DSparkProposer(drafter, target, num_blocks=64, block_size=4)
            alone.add_request(NewRequest(r, (), params, seed=i))
            alone.propose([DraftQuery(r, prompts[i], 0, rows[i])])
            one = alone.propose([DraftQuery(r, (), depths[i], None)])
            d = depths[i]
            assert torch.equal(together.token_ids[i, :d], one.token_ids[0, :d]), (temperature, i)
            torch.testing.assert_close(together.confidences[i, :d], one.confidences[0, :d],
                                       atol=ATOL, rtol=RTOL)
            if temperature > 0:
                torch.testing.assert_close(together.probs[i, :d], one.probs[0, :d],
                                           atol=ATOL, rtol=RTOL)
