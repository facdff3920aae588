"""commit(): the one place where a step changes request state (DESIGN.md §4).

For each request: append x_1..x_A and y, cut right after EOS / a stop token / a stop string,
never past max_tokens or the context; set the target KV length to the committed tokens minus
the anchor. Decide, then commit, then free: freeing caches is the caller's separate step.
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.coordinator.request import Request
from dspark.messages import Drafts, RequestStep, StepState, VerifyPlan, VerifyResult


def commit(
    step_no: int,
    requests: dict[str, Request],
    drafts: Drafts,
    plan: VerifyPlan,
    result: VerifyResult,
    eos_ids: frozenset[int],
    max_model_len: int,
    detokenize: Callable[[list[int]], str],
) -> StepState:
    drafted = dict(zip(drafts.req_ids, drafts.num_drafts.tolist(), strict=True))
    steps = []
    for req_id, planned, accepted, tokens in zip(
        result.req_ids, plan.num_draft, result.num_accepted, result.output_tokens, strict=True
    ):
        req = requests[req_id]
        assert len(tokens) == accepted + 1 and accepted <= planned
        committed = _append_until_stop(req, tokens, eos_ids, max_model_len, detokenize)
        req.target_length = req.num_tokens - 1
        req.stats.record(drafted.get(req_id, 0), planned, accepted)
        steps.append(
            RequestStep(
                req_id=req_id,
                num_drafted=drafted.get(req_id, 0),
                num_planned=planned,
                num_accepted=accepted,
                committed=committed,
                target_length=req.target_length,
                finish_reason=req.finish_reason,
            )
        )
    return StepState(step=step_no, budget=plan.budget, requests=tuple(steps))


def _append_until_stop(
    req: Request,
    tokens: tuple[int, ...],
    eos_ids: frozenset[int],
    max_model_len: int,
    detokenize: Callable[[list[int]], str],
) -> tuple[int, ...]:
    params = req.params
    for i, t in enumerate(tokens):
        req.output_ids.append(t)
        if (t in eos_ids and not params.ignore_eos) or t in params.stop_token_ids:
            req.finish_reason = "stop"
        elif params.stop and _stop_string_end(req, detokenize) is not None:
            req.finish_reason = "stop"
        elif len(req.output_ids) >= params.max_tokens or req.num_tokens >= max_model_len:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            return tokens[: i + 1]
    return tokens


def _stop_string_end(req: Request, detokenize: Callable[[list[int]], str]) -> int | None:
    text = detokenize(req.output_ids)
    hits = [text.find(s) for s in req.params.stop if s in text]
    if hits:
        req.stop_text_end = min(hits)
        return req.stop_text_end
    return None
