"""Worker faults as the coordinator sees them (DESIGN.md §4, invariant 5; issue 7).

A worker pool raises `WorkerLost` when a worker process died or stopped answering in the middle
of a call: whatever state it held is gone, and the coordinator rebuilds it from committed tokens
(invariant 1). `WorkersUnavailable` means the pool could not be rebuilt: the requests that need
it end with UNAVAILABLE instead of waiting forever.
"""

from __future__ import annotations


class WorkerLost(RuntimeError):
    """A worker died or timed out mid-call; its state is gone and can be rebuilt."""


class WorkersUnavailable(RuntimeError):
    """A pool lost workers and could not replace them; requests needing it cannot continue."""


def first_line(error: BaseException) -> str:
    """An error's first line for a log or status message (Ray's errors run to many lines)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
