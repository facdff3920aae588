"""Bad input gets a precise error and changes nothing: the other requests finish as if alone."""

from __future__ import annotations

import pytest

from dspark.coordinator.engine import Engine
from dspark.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture()
def engine(tiny_pair) -> Engine:
    target, drafter = tiny_pair
    return Engine(target, proposer="draft-model", drafter=drafter, policy="fixed", k=3,
                  num_blocks=64, block_size=4)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([5, 4096, 7], "prompt has token ids outside [0, 4096): [4096]"),
        ([5, -1], "prompt has token ids outside [0, 4096): [-1]"),
        ([1] * 512, "prompt has 512 tokens; the context holds 512"),
    ],
)
def test_bad_prompt_is_refused_precisely(engine: Engine, prompt, message: str) -> None:
    with pytest.raises(ValueError) as err:
        engine.add_request(prompt, GREEDY)
    assert message in str(err.value)
    assert not engine.has_unfinished()


def test_bad_requests_mid_run_leave_others_untouched(engine: Engine, tiny_pair) -> None:
    target, drafter = tiny_pair
    alone = Engine(target, proposer="none").generate([[11, 12, 13]], GREEDY)[0]
    good = engine.add_request([11, 12, 13], GREEDY)
    engine.step()
    for bad in ("", [9999], [3] * 600):
        with pytest.raises(ValueError):
            engine.add_request(bad, GREEDY)
    with pytest.raises(ValueError, match="max_tokens=0"):
        engine.add_request([1, 2], SamplingParams(max_tokens=0))
    while engine.has_unfinished():
        engine.step()
    req = engine.pop_finished(good)
    assert tuple(req.output_ids) == alone.token_ids
    assert engine.target.cache.num_free_blocks == engine.target.cache.num_blocks


def test_generation_stops_at_the_context_limit(tiny_pair) -> None:
    target, drafter = tiny_pair
    engine = Engine(target, proposer="draft-model", drafter=drafter, policy="fixed", k=7)
    out = engine.generate(
        [[7] * 500], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    )[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 512 - 500


def test_engine_options_are_checked(tiny_pair) -> None:
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="proposer='magic'"):
        Engine(target, proposer="magic")
    with pytest.raises(ValueError, match="policy='greedy'"):
        Engine(target, proposer="ngram", policy="greedy")
    with pytest.raises(ValueError, match="k=0"):
        Engine(target, proposer="ngram", policy="fixed", k=0)
