"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-6  # below it logits / T overflow float32 and sampling breaks


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Example:
        >>> SamplingParams(temperature=0.0, max_tokens=32).greedy
        True
    """

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    max_tokens: int = 64
    """Most tokens to generate (the EOS or stop token included)."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these tokens (kept in the output ids)."""
    stop: tuple[str, ...] = ()
    """Generation stops when the text contains one of these strings (cut from the text)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS token."""
    seed: int | None = None
    """Seed of the request's own random generator; None draws one."""

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, CLIs) but store tuples so the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        _check(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
            and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
            "temperature", self.temperature,
            f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (smaller values "
            "overflow the tempered logits)",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
            "must be an integer >= 0 (0 disables)",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p", self.top_p,
            "must be in (0, 1]",
        )
        _check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
            self.max_tokens, "must be an integer >= 1",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
            self.stop_token_ids, "must be non-negative integers",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
            "must be non-empty strings",
        )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed", self.seed, "must be None or an integer in [0, 2**63)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field}={value!r}: {rule}")
