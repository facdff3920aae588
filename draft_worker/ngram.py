"""Prompt-lookup (n-gram) proposer: no model, deterministic drafts (q one-hot)."""

from __future__ import annotations

import torch

from dspark.messages import DraftQuery, Drafts, NewRequest


def lookup(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier match of the longest suffix n-gram.

    Tries n = max_n .. min_n; for each n searches the most recent earlier occurrence of the last
    n tokens and returns what followed it.
    """
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n :]
        for start in range(size - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, window: int = 1024) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n, self.window = max_n, min_n, window
        self._tokens: dict[str, list[int]] = {}

    def add_request(self, new: NewRequest) -> None:
        self._tokens[new.req_id] = []

    def propose(self, queries: list[DraftQuery]) -> Drafts:
        proposals = []
        for q in queries:
            tokens = self._tokens[q.req_id]
            tokens.extend(q.new_token_ids)
            recent = tokens[-self.window :]
            proposals.append(
                lookup(recent, q.num_drafts, self.max_n, self.min_n) if q.num_drafts else []
            )
        width = max((len(p) for p in proposals), default=0)
        ids = torch.full((len(queries), width), -1, dtype=torch.long)
        for i, p in enumerate(proposals):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        return Drafts(
            req_ids=tuple(q.req_id for q in queries),
            token_ids=ids,
            num_drafts=torch.tensor([len(p) for p in proposals], dtype=torch.long),
            probs=None,
            confidences=None,
        )

    def commit(self, req_id: str, num_accepted: int) -> None:
        pass  # no state derived from drafts

    def release(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)

    def usage(self) -> dict[str, object]:
        """Requests holding state here (no cache: `used_blocks` is 0)."""
        return {"requests": sorted(self._tokens), "used_blocks": 0}
