"""What one request may ask of the server, checked before it reaches the engine (issue 7).

`Limits` holds the configured bounds (ServeConfig's `max_*` fields); `RequestChecker` resolves
them against the served model (its context and vocabulary) and checks a decoded request. Bad
input raises `dspark.errors.InvalidArgument`, a value beyond a limit `dspark.errors.OutOfRange`;
each message names the field and the value. The server maps them to INVALID_ARGUMENT and
OUT_OF_RANGE.

Text prompts are bounded by bytes before they are tokenised: a text longer than
`max_prompt_bytes` (the prompt-token limit times the longest token's bytes, times a slack of 2)
cannot fit, whatever it says, so it is refused without paying for its tokenisation.

Example:
    >>> checker = RequestChecker(Limits(max_prompt_tokens=8), vocab_size=100, max_model_len=64)
    >>> checker.check_prompt((1, 2, 3), "token_ids.ids")
    >>> try:
    ...     checker.check_prompt(tuple(range(9)), "token_ids.ids")
    ... except OutOfRange as e:
    ...     print(e.code, e.details)  # doctest: +ELLIPSIS
    OUT_OF_RANGE GenerateRequest.token_ids.ids has 9 tokens: this server takes at most 8 ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark.errors import InvalidArgument, OutOfRange
from dspark.sampling_params import SamplingParams

# Caps no configuration needs to change: they bound per-step work of the stop-string check.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Below this a positive temperature overflows logits / T to inf in float64 (NaN distributions):
# the smallest temperature we take is far above that and far below any useful value.
_TEXT_SLACK = 2  # text bytes per token bound: normalisers (NFC) may shrink text a little


@dataclass(frozen=True)
class Limits:
    """Bounds on requests. None: the model's context decides (resolved by RequestChecker)."""

    max_prompt_tokens: int | None = None
    """Most prompt tokens (None: the model's context - 1, so one token can be generated)."""
    max_tokens: int | None = None
    """Ceiling on SamplingParams.max_tokens (None: the model's context)."""
    max_in_flight: int = 256
    """Requests admitted at once; one more is refused with RESOURCE_EXHAUSTED at once."""
    max_message_bytes: int = 4 * 1024 * 1024
    """Largest request message gRPC receives; larger ones get RESOURCE_EXHAUSTED."""

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Limits.{name}={value!r}: must be None or an integer >= 1")
        for name in ("max_in_flight", "max_message_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Limits.{name}={value!r}: must be an integer >= 1")


class RequestChecker:
    """`Limits` resolved against one model: checks a request's parameters and prompt."""

    def __init__(
        self,
        limits: Limits,
        vocab_size: int,
        max_model_len: int,
        token_bytes: int = 0,
    ) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        context_cap = max(1, max_model_len - 1)
        self.max_prompt_tokens = min(limits.max_prompt_tokens or context_cap, context_cap)
        self.max_tokens = limits.max_tokens or max_model_len
        # 0: unknown token width, no byte bound before tokenising.
        self.max_prompt_bytes = self.max_prompt_tokens * token_bytes * _TEXT_SLACK or None

    @classmethod
    def for_engine(cls, limits: Limits, engine: object) -> RequestChecker:
        """Resolve against an engine: its target's vocabulary, its context, its tokenizer."""
        vocab = engine.target.config.vocab_size  # type: ignore[attr-defined]
        decode = engine.tokenizer.decode  # type: ignore[attr-defined]
        return cls(limits, vocab, engine.max_model_len, longest_token_bytes(decode, vocab))  # type: ignore[attr-defined]

    def check_params(self, params: SamplingParams) -> None:
        """Limits SamplingParams' own validation does not know (the model's, the server's)."""
        if params.max_tokens > self.max_tokens:
            raise OutOfRange(
                f"SamplingParams.max_tokens={params.max_tokens}: over this server's ceiling "
                f"{self.max_tokens} (max_tokens_limit; the model's context is "
                f"{self.max_model_len} tokens)"
            )
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidArgument(
                f"SamplingParams.stop_token_ids={list(params.stop_token_ids)[:8]}: "
                f"{bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        _at_most("SamplingParams.stop_token_ids", len(params.stop_token_ids), MAX_STOP_TOKEN_IDS)
        _at_most("SamplingParams.stop", len(params.stop), MAX_STOP_STRINGS)
        for i, s in enumerate(params.stop):
            if len(s) > MAX_STOP_CHARS:
                raise OutOfRange(
                    f"SamplingParams.stop[{i}] has {len(s)} characters: at most "
                    f"{MAX_STOP_CHARS} are taken"
                )

    def check_text(self, text: str) -> None:
        """Refuse a text prompt that is empty or cannot fit, before it is tokenised."""
        if not text:
            raise InvalidArgument("GenerateRequest.text is empty: at least one token is needed")
        size = len(text.encode("utf-8"))
        if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
            raise OutOfRange(
                f"GenerateRequest.text has {size} bytes: more than {self.max_prompt_tokens} "
                f"tokens can hold (max_prompt_tokens {self.max_prompt_tokens}; the model's "
                f"context is {self.max_model_len} tokens)"
            )

    def check_prompt(self, ids: Sequence[int], field: str) -> None:
        """Refuse an empty prompt, ids outside the vocabulary, or more tokens than fit."""
        if not ids:
            raise InvalidArgument(f"GenerateRequest.{field} is empty: at least one token is needed")
        for i, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument(
                    f"GenerateRequest.{field}[{i}]={t}: outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        if len(ids) > self.max_prompt_tokens:
            raise OutOfRange(
                f"GenerateRequest.{field} has {len(ids)} tokens: this server takes at most "
                f"{self.max_prompt_tokens} (max_prompt_tokens {self.max_prompt_tokens}; the "
                f"model's context is {self.max_model_len} tokens)"
            )


def longest_token_bytes(decode: Callable[..., str], vocab_size: int) -> int:
    """UTF-8 bytes of the longest single-token text (special tokens included).

    A prompt of n tokens then spans at most n times this many bytes of text.
    """
    return max(
        (len(decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(vocab_size)),
        default=0,
    )


def _at_most(field: str, n: int, cap: int) -> None:
    if n > cap:
        raise OutOfRange(f"{field} has {n} entries: at most {cap} are taken")
