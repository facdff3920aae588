"""Invariants 1 and 2 of DESIGN.md §4, property-tested.

After every step, each cache (the target's and the draft model's) holds exactly what a fresh
prefill of the committed tokens gives, for its visible length; rejected positions are never
visible; the target's length is the committed tokens minus the anchor. Random per-request ℓ,
random accept/reject patterns (a scripted proposer corrupting the target's own greedy choice,
or the real draft model at T = 1), EOS/stop-token and max_tokens cut-offs. Once every request
is done, no block is left allocated.
"""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_doubles import RandomPolicy

from dspark.coordinator.engine import Engine
from dspark.messages import DraftQuery, Drafts, NewRequest
from dspark.models.decoder import DecoderLM
from dspark.models.kv_cache import PagedKVCache
from dspark.sampling_params import SamplingParams


class CorruptedGreedyProposer:
    """Test double: the target's own greedy continuation, each draft corrupted with prob 0.35."""

    name = "scripted"

    def __init__(self, model: DecoderLM, rng: random.Random) -> None:
        self.model, self.rng = model, rng
        self.tokens: dict[str, list[int]] = {}

    def add_request(self, new: NewRequest) -> None:
        self.tokens[new.req_id] = []

    @torch.inference_mode()
    def propose(self, queries: list[DraftQuery]) -> Drafts:
        out = []
        for q in queries:
            seq = self.tokens[q.req_id]
            seq.extend(q.new_token_ids)
            drafts, ctx = [], list(seq)
            for _ in range(q.num_drafts):
                h, _ = self.model.forward_dense(torch.tensor([ctx]))
                best = int(self.model.compute_logits(h[0, -1]).argmax())
                tok = best if self.rng.random() > 0.35 else self.rng.randrange(4096)
                drafts.append(tok)
                ctx.append(tok)
            out.append(drafts)
        width = max((len(d) for d in out), default=0)
        ids = torch.full((len(queries), width), -1, dtype=torch.long)
        for i, d in enumerate(out):
            ids[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        return Drafts(tuple(q.req_id for q in queries), ids,
                      torch.tensor([len(d) for d in out], dtype=torch.long), None, None)

    def commit(self, req_id: str, num_accepted: int) -> None:
        pass

    def release(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)


def fresh_prefill(model: DecoderLM, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                         num_blocks=64, block_size=16)
    cache.reserve("x", len(tokens))
    meta = cache.metadata(["x"], [0], [len(tokens)])
    model.forward_paged(torch.tensor(tokens), meta, cache, torch.tensor([len(tokens) - 1]))
    return cache.read("x")


def assert_cache_matches(
    model: DecoderLM, cache: PagedKVCache, req_id: str, tokens: list[int]
) -> None:
    n = cache.length(req_id)
    if n == 0:
        return
    k, v = cache.read(req_id)
    k_ref, v_ref = fresh_prefill(model, tokens[:n])
    torch.testing.assert_close(k, k_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(v, v_ref, atol=2e-5, rtol=1e-4)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    num_requests=st.integers(1, 4),
    k=st.integers(1, 7),
    proposer=st.sampled_from(["draft-model", "scripted"]),
    temperature=st.sampled_from([0.0, 1.0]),
    ignore_eos=st.booleans(),
)
def test_caches_equal_fresh_prefill_after_every_step(
    tiny_pair, seed: int, num_requests: int, k: int, proposer: str, temperature: float,
    ignore_eos: bool,
) -> None:
    target_dir, draft_dir = tiny_pair
    rng = random.Random(seed)
    engine = Engine(target_dir, proposer="draft-model", drafter=draft_dir, policy="fixed", k=k,
                    num_blocks=96, block_size=4, max_num_seqs=3)
    engine.policy = RandomPolicy(rng, k)
    if proposer == "scripted":
        engine.proposer = CorruptedGreedyProposer(engine.target.model, rng)
    stop_ids = tuple(rng.sample(range(4096), 60))
    for _ in range(num_requests):
        prompt = [rng.randrange(1, 4096) for _ in range(rng.randint(1, 20))]
        params = SamplingParams(
            temperature=temperature,
            max_tokens=rng.randint(1, 30),
            stop_token_ids=stop_ids,
            ignore_eos=ignore_eos,
            seed=rng.randrange(1000),
        )
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished():
        state = engine.step()
        steps += 1
        assert state is not None and steps < 200
        for s in state.requests:
            assert s.num_accepted <= s.num_planned <= s.num_drafted
            assert len(s.committed) <= s.num_accepted + 1
        for req in engine._running.values():
            tokens = list(req.prompt_ids) + req.output_ids
            assert engine.target.cache.length(req.req_id) == len(tokens) - 1 == req.target_length
            assert_cache_matches(engine.target.model, engine.target.cache, req.req_id, tokens)
            if proposer == "draft-model":
                draft = engine.proposer
                assert draft.cache.length(req.req_id) <= len(tokens) - 1
                assert_cache_matches(draft.model, draft.cache, req.req_id, tokens)
    assert engine.target.cache.num_free_blocks == engine.target.cache.num_blocks
    if proposer == "draft-model":
        assert engine.proposer.cache.num_free_blocks == engine.proposer.cache.num_blocks
    assert engine._reserved_blocks == 0
