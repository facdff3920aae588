"""Invariant 3 of DESIGN.md §4 with the DSpark proposer on the shipped demo pair (fp32): greedy
output is token-identical to target-only greedy decoding for every k in 1..7 and batch sizes 1
and 8 (16 held-out prompts × 32 tokens each). The long case is in test_dspark_greedy_long.py."""

from __future__ import annotations

import pytest

from dspark.coordinator.engine import Engine
from dspark.sampling_params import SamplingParams

SHORT = SamplingParams(temperature=0, max_tokens=32)


def target_alone(prompts: list[str], params: SamplingParams) -> list[tuple[int, ...]]:
    engine = Engine(proposer="none", policy="off", max_num_seqs=1)
    return [o.token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def short_case(heldout_prompts: list[str]) -> tuple[list[str], list[tuple[int, ...]]]:
    prompts = heldout_prompts[:16]
    return prompts, target_alone(prompts, SHORT)


def assert_identical(outs, reference) -> None:  # noqa: ANN001 - GenerationResult list, ids list
    pairs = enumerate(zip(outs, reference, strict=True))
    mismatches = [i for i, (o, r) in pairs if o.token_ids != r]
    assert not mismatches, f"prompts {mismatches} differ from target-only greedy"
    # Speculation must have run: blocks were verified and some drafts accepted.
    assert sum(o.stats["accepted_tokens"] for o in outs) > 0


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6, 7])
def test_dspark_greedy_identical_to_target_alone(short_case, k: int, batch: int) -> None:
    prompts, reference = short_case
    engine = Engine(proposer="dspark", policy="fixed", k=k, max_num_seqs=batch)
    assert_identical(engine.generate(prompts, SHORT), reference)
