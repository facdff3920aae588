"""Exceptions the SDK raises, one per gRPC status code a caller can act on.

Each carries the status code's name (`code`) and the server's message (`details`). Where an
in-process engine raises a builtin for the same fault, the SDK's exception also derives from
that builtin, so code written against `Engine` keeps its `except ValueError:` unchanged.

Example:
    >>> e = from_status("INVALID_ARGUMENT", "SamplingParams.top_p=2.0: must be in (0, 1]")
    >>> isinstance(e, InvalidArgument) and isinstance(e, ValueError), e.code
    (True, 'INVALID_ARGUMENT')
    >>> e = from_status("OUT_OF_RANGE", "SamplingParams.max_tokens=99999: over the limit 512")
    >>> isinstance(e, OutOfRange) and isinstance(e, InvalidArgument), e.code
    (True, 'OUT_OF_RANGE')
"""

from __future__ import annotations


class DSparkError(Exception):
    """A failed call to a dspark server. `code`: the gRPC status name; `details`: its message."""

    code = "UNKNOWN"

    def __init__(self, details: str = "", code: str | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.details}"


class InvalidArgument(DSparkError, ValueError):
    """The request was refused as given: bad SamplingParams, an empty or too long prompt."""

    code = "INVALID_ARGUMENT"


class OutOfRange(InvalidArgument):
    """A value beyond a limit: a prompt longer than the server's limit or the model's context,
    max_tokens over the server's ceiling. The request may fit another server (or a shorter
    prompt); a subclass of InvalidArgument, so `except InvalidArgument:` still catches it."""

    code = "OUT_OF_RANGE"


class DeadlineExceeded(DSparkError, TimeoutError):
    """The call's timeout passed; the server aborted the request and freed its caches."""

    code = "DEADLINE_EXCEEDED"


class Unavailable(DSparkError, ConnectionError):
    """No server answered at the address, or it is shutting down."""

    code = "UNAVAILABLE"


class Cancelled(DSparkError):
    """The call was cancelled (by the caller or the server's shutdown)."""

    code = "CANCELLED"


class ResourceExhausted(DSparkError):
    """The server cannot take the request now: too many requests in flight (retry later), or
    the message is larger than the server's max_message_bytes."""

    code = "RESOURCE_EXHAUSTED"


class Unauthenticated(DSparkError):
    """The server requires a bearer token and the call had none or a wrong one."""

    code = "UNAUTHENTICATED"


class Internal(DSparkError):
    """The server failed while serving the request; the message says how."""

    code = "INTERNAL"


_BY_CODE: dict[str, type[DSparkError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        OutOfRange,
        DeadlineExceeded,
        Unavailable,
        Cancelled,
        ResourceExhausted,
        Unauthenticated,
        Internal,
    )
}


def from_status(code: str, details: str) -> DSparkError:
    """The exception for a gRPC status name (`"INVALID_ARGUMENT"`); `DSparkError` for others."""
    cls = _BY_CODE.get(code, DSparkError)
    return cls(details) if cls is not DSparkError else DSparkError(details, code)
