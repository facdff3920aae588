"""commit() with fabricated verify results (no model): cuts, lengths and stats."""

from __future__ import annotations

import torch

from dspark.coordinator.commit import commit
from dspark.coordinator.request import Request
from dspark.messages import Drafts, VerifyPlan, VerifyResult
from dspark.sampling_params import SamplingParams

EOS = 0


def detok(ids: list[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def run(req: Request, drafted: int, planned: int, accepted: int, tokens: tuple[int, ...],
        max_len: int = 100):
    drafts = Drafts((req.req_id,), torch.full((1, drafted), 5), torch.tensor([drafted]), None, None)
    plan = VerifyPlan((req.req_id,), (req.target_length,), ((1,),), (planned,),
                      torch.full((1, planned), 5), None, planned)
    result = VerifyResult((req.req_id,), (accepted,), (tokens,))
    return commit(
        1, {req.req_id: req}, drafts, plan, result, frozenset({EOS}), max_len, detok
    ).requests[0]


def new(params: SamplingParams, prompt=(1, 2, 3)) -> Request:
    return Request("r", tuple(prompt), params, seed=0)


def test_all_accepted_commits_a_plus_one_and_sets_target_length() -> None:
    req = new(SamplingParams(max_tokens=50))
    s = run(req, drafted=4, planned=3, accepted=3, tokens=(7, 8, 9, 10))
    assert s.committed == (7, 8, 9, 10) and s.finish_reason is None
    assert req.output_ids == [7, 8, 9, 10]
    assert s.target_length == req.target_length == 3 + 4 - 1
    assert (s.num_drafted, s.num_planned, s.num_accepted) == (4, 3, 3)
    assert req.stats.accepted_per_position == [1, 1, 1]
    assert req.stats.verified_per_position == [1, 1, 1]


def test_eos_among_accepted_drafts_cuts_right_after_it_with_no_bonus() -> None:
    req = new(SamplingParams(max_tokens=50))
    s = run(req, drafted=3, planned=3, accepted=3, tokens=(7, EOS, 9, 10))
    assert s.committed == (7, EOS) and s.finish_reason == "stop"
    assert req.output_ids == [7, EOS]


def test_ignore_eos_keeps_going_and_stop_token_ids_stop() -> None:
    req = new(SamplingParams(max_tokens=50, ignore_eos=True, stop_token_ids=(9,)))
    s = run(req, drafted=3, planned=3, accepted=3, tokens=(7, EOS, 9, 10))
    assert s.committed == (7, EOS, 9) and s.finish_reason == "stop"


def test_max_tokens_cut() -> None:
    req = new(SamplingParams(max_tokens=2))
    s = run(req, drafted=3, planned=3, accepted=3, tokens=(7, 8, 9, 10))
    assert s.committed == (7, 8) and s.finish_reason == "length"


def test_context_limit_cut() -> None:
    req = new(SamplingParams(max_tokens=50))
    s = run(req, drafted=3, planned=3, accepted=3, tokens=(7, 8, 9, 10), max_len=5)
    assert s.committed == (7, 8) and s.finish_reason == "length" and req.num_tokens == 5


def test_stop_string_cuts_text_at_the_match() -> None:
    # detok maps 7 -> 'h', 8 -> 'i', 9 -> 'j': stop "ij" completes at token 9.
    req = new(SamplingParams(max_tokens=50, stop=("ij",)))
    s = run(req, drafted=3, planned=3, accepted=3, tokens=(7, 8, 9, 10))
    assert s.committed == (7, 8, 9) and s.finish_reason == "stop"
    assert req.stop_text_end == 1  # text "hij" is cut to "h"


def test_rejection_commits_accepted_prefix_and_correction() -> None:
    req = new(SamplingParams(max_tokens=50))
    s = run(req, drafted=5, planned=5, accepted=1, tokens=(7, 42))
    assert s.committed == (7, 42) and req.target_length == 3 + 2 - 1
    assert req.stats.verified_per_position == [1, 1, 1, 1, 1]
    assert req.stats.accepted_per_position == [1]
    assert req.stats.mean_accepted_length == 2.0
