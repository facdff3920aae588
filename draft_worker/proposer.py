"""The proposer interface: every drafter (DSpark, draft model, n-gram, none) speaks it.

A proposer keeps private per-request state, changed only by its verbs:
- `add_request(new)`: a request joins (prompt in full);
- `propose(queries)`: for each query, append its new committed tokens and propose up to
  `num_drafts` tokens; returns `Drafts` (tokens, the q that produced them, confidences);
- `commit(req_id, num_accepted)`: the target accepted `num_accepted` of the last drafts; the
  proposer drops every state derived from rejected ones (invariant 2 of DESIGN.md §4);
- `release(req_id)`: the request is gone.
Committed tokens always arrive through `propose` (as `new_token_ids`), so the coordinator's
token list stays the one truth.
"""

from __future__ import annotations

from typing import Protocol

from dspark.messages import DraftQuery, Drafts, NewRequest


class Proposer(Protocol):
    name: str

    def add_request(self, new: NewRequest) -> None: ...

    def propose(self, queries: list[DraftQuery]) -> Drafts: ...

    def commit(self, req_id: str, num_accepted: int) -> None: ...

    def release(self, req_id: str) -> None: ...

    def usage(self) -> dict[str, object]: ...


class NoProposer:
    """Proposes nothing: every step is a plain target decode."""

    name = "none"

    def add_request(self, new: NewRequest) -> None:
        pass

    def propose(self, queries: list[DraftQuery]) -> Drafts:
        return Drafts.empty(tuple(q.req_id for q in queries))

    def commit(self, req_id: str, num_accepted: int) -> None:
        pass

    def release(self, req_id: str) -> None:
        pass

    def usage(self) -> dict[str, object]:
        return {"requests": [], "used_blocks": 0}
