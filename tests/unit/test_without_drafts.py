"""`without_drafts`: rank 0's view of a plan whose q was lost for some rows: those rows keep
their p_0 logits row alone and plan no drafts; the others are untouched."""

from __future__ import annotations

import torch

from dspark.messages import VerifyPlan
from dspark.target_worker.draft_probs import without_drafts


def test_unjudged_rows_keep_only_their_first_logits_row() -> None:
    plan = VerifyPlan(
        req_ids=("a", "b", "c"), starts=(4, 7, 2),
        input_ids=((1, 5, 6), (9,), (3, 4, 8, 8, 2)),
        num_draft=(2, 0, 3),
        draft_token_ids=torch.tensor([[5, 6, -1], [-1, -1, -1], [8, 8, 2]]),
        draft_probs=None, budget=5,
    )
    logits = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 4)  # row i holds i
    judged, kept = without_drafts(plan, logits, frozenset({0, 2}))
    assert kept[:, 0].tolist() == [0, 3, 4]  # p_0 of a, b's only row, p_0 of c
    assert judged.num_draft == (0, 0, 0)
    assert judged.draft_token_ids.tolist() == [[-1] * 3] * 3
    assert judged.input_ids == plan.input_ids and judged.starts == plan.starts  # the pass ran
    judged, kept = without_drafts(plan, logits, frozenset({1}))  # b planned none anyway
    assert judged.num_draft == plan.num_draft and torch.equal(kept, logits)
    assert torch.equal(judged.draft_token_ids, plan.draft_token_ids)
