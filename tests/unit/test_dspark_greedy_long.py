"""Invariant 3 of DESIGN.md §4 with the DSpark proposer, the long case: 50 held-out prompts
(other than the 16 of test_dspark_greedy_identity.py) × 48 tokens, k = 7, batch 8, token-identical
to target-only greedy decoding of one request at a time (fp32)."""

from __future__ import annotations

from dspark.coordinator.engine import Engine
from dspark.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=48)


def test_dspark_greedy_identical_fifty_prompts(heldout_prompts: list[str]) -> None:
    prompts = heldout_prompts[16:66]
    plain = Engine(proposer="none", policy="off", max_num_seqs=1)
    reference = [o.token_ids for o in plain.generate(prompts, LONG)]
    engine = Engine(proposer="dspark", policy="fixed", k=7, max_num_seqs=8)
    outs = engine.generate(prompts, LONG)
    pairs = enumerate(zip(outs, reference, strict=True))
    mismatches = [i for i, (o, r) in pairs if o.token_ids != r]
    assert not mismatches, f"prompts {mismatches} differ from target-only greedy"
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0
    assert sum(len(o.token_ids) for o in outs) >= 40 * len(prompts)  # not cut short by EOS
