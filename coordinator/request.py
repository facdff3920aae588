"""The coordinator's request: the one truth about committed tokens (DESIGN.md §4, invariant 1).

Only `commit()` changes a running request; everything else reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.sampling_params import SamplingParams


@dataclass
class RequestStats:
    """Speculation counters of one request.

    accepted: a draft the target's acceptance rule kept; verified: a draft admitted to a verify
    pass; drafted: a draft the proposer produced (verified or not). `accepted_per_position[j]`
    counts acceptances at draft position j + 1, `verified_per_position[j]` admissions there, so
    their ratio is the conditional acceptance rate at that position.
    """

    target_passes: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verified_per_position: list[int] = field(default_factory=list)

    def record(self, drafted: int, verified: int, accepted: int) -> None:
        self.target_passes += 1
        self.drafted_tokens += drafted
        self.verified_tokens += verified
        self.accepted_tokens += accepted
        for counts, n in (
            (self.verified_per_position, verified),
            (self.accepted_per_position, accepted),
        ):
            counts.extend([0] * (n - len(counts)))
            for j in range(n):
                counts[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target pass (the correction or bonus token counted)."""
        return (self.accepted_tokens + self.target_passes) / max(1, self.target_passes)

    def as_dict(self) -> dict[str, object]:
        return {
            "target_passes": self.target_passes,
            "drafted_tokens": self.drafted_tokens,
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "verified_per_position": list(self.verified_per_position),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
        }


@dataclass
class Request:
    req_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    target_length: int = 0  # target KV entries: committed tokens minus the uncached anchor
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where the text is cut when a stop string matched
    rebuilds: int = 0  # times a worker's state of this request was rebuilt after a fault
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def uncached_tokens(self) -> int:
        """Committed tokens beyond the anchor that the target has not cached: a prompt (or a
        rebuilt context) that the next verify pass prefills; 0 for a decoding request."""
        return self.num_tokens - self.target_length - 1

    def token(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens_from(self, start: int) -> tuple[int, ...]:
        """Committed tokens from index `start` on (prompt then output)."""
        n = len(self.prompt_ids)
        if start >= n:
            return tuple(self.output_ids[start - n :])
        return self.prompt_ids[start:] + tuple(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class GenerationResult:
    """What `Engine.generate` returns per prompt (and what the gRPC SDK returns)."""

    req_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated only
    text: str
    finish_reason: str
    stats: dict[str, object]
