"""Leak checks: what `Engine.accounting()` reads when nothing is held anywhere, and a poll for it
through a running server's engine loop (requests may still be winding down when a test looks)."""

from __future__ import annotations

import time

from dspark.coordinator.engine_loop import EngineLoop

IDLE = {
    "waiting": 0,
    "running": 0,
    "unclaimed": 0,
    "reserved_blocks": 0,
    "coordinator_requests": [],
    "target": {"requests": [], "used_blocks": 0},
    "draft": {"requests": [], "used_blocks": 0},
}


def accounting_when_idle(loop: EngineLoop, timeout: float = 20.0) -> dict:
    """The engine's accounting once it equals IDLE, or whatever it is after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        acc = loop.call(lambda e: e.accounting(), timeout=30)
        if acc == IDLE or time.monotonic() > deadline:
            return acc
        time.sleep(0.05)
