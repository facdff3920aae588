"""The engine-loop thread: the one owner of an `Engine`, fed by a thread-safe queue.

The engine is not thread-safe, so every touch of it happens on this thread: requests,
cancellations and queries arrive as commands on one FIFO queue; between steps the loop applies
them, then runs `engine.step()` and publishes each request's newly committed tokens (with their
text delta) to that request's sink. Sinks are callables that must not block (the gRPC server's
put the chunk on its event loop). The loop blocks on the queue only when the engine is idle.

Events a sink receives: `Chunk`s (the last one has a finish reason), or one `Rejected` (the
engine refused the request: nothing was queued), or one `Failed` (the loop gave up on it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dspark.coordinator.detokenize import IncrementalDetokenizer
from dspark.coordinator.metrics import ServeMetrics
from dspark.errors import DSparkError
from dspark.faults import WorkersUnavailable
from dspark.messages import StepState
from dspark.protocol import Chunk
from dspark.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request as given (its ValueError's message); nothing was queued.

    `code`: the gRPC status name, INVALID_ARGUMENT unless the error carries its own (a
    `dspark.errors.OutOfRange` raised by the engine says OUT_OF_RANGE)."""

    message: str
    code: str = "INVALID_ARGUMENT"


@dataclass(frozen=True)
class Failed:
    """The loop could not finish the request; `code` is a gRPC status name."""

    code: str
    message: str


Event = Chunk | Rejected | Failed
Sink = Callable[[Event], None]


class EngineLike(Protocol):
    """The verbs of `dspark.coordinator.engine.Engine` the loop uses."""

    tokenizer: Any

    def add_request(self, prompt: Any, params: SamplingParams | None = None) -> str: ...

    def step(self) -> StepState | None: ...

    def abort(self, req_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def pop_finished(self, req_id: str) -> Any: ...

    def result(self, req: Any) -> Any: ...


class RequestHandle:
    """A submitted request. Fields are written by the loop thread only."""

    def __init__(self, prompt: str | tuple[int, ...], params: SamplingParams, sink: Sink) -> None:
        self.prompt = prompt
        self.params = params
        self.sink = sink
        self.arrival = time.perf_counter()
        self.req_id: str | None = None
        self.detok: IncrementalDetokenizer | None = None
        self.last_emit: float | None = None  # when its last tokens were published


_STOP = object()


class EngineLoop:
    """Runs an engine on its own thread.

    Example:
        >>> from dspark.coordinator.engine import Engine
        >>> loop = EngineLoop(Engine(proposer="ngram")).start()
        >>> got = []
        >>> _ = loop.submit("import os\\n", SamplingParams(temperature=0, max_tokens=4), got.append)
        >>> loop.call(lambda engine: engine.has_unfinished(), timeout=60) in (True, False)
        True
        >>> loop.stop()
    """

    def __init__(self, engine: EngineLike, metrics: ServeMetrics | None = None) -> None:
        self.engine = engine  # touched only from the loop thread, or through `call`
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, RequestHandle] = {}
        self._thread = threading.Thread(target=self._run, name="dspark-engine-loop", daemon=True)
        self._failure: str | None = None
        self._on_failure: list[Callable[[str], None]] = []

    # --- any thread -----------------------------------------------------------------------
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def failure(self) -> str | None:
        """Why the loop stopped serving (an engine exception), or None while it serves."""
        return self._failure

    def on_failure(self, fn: Callable[[str], None]) -> None:
        """Call `fn(message)` (on the loop thread) if the engine fails."""
        self._on_failure.append(fn)

    def submit(
        self, prompt: str | tuple[int, ...], params: SamplingParams, sink: Sink
    ) -> RequestHandle:
        """Queue a request; its events go to `sink` (called on the loop thread)."""
        handle = RequestHandle(prompt, params, sink)
        self._inbox.put(("submit", handle))
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Abort the request and free its caches; nothing happens once it has finished."""
        self._inbox.put(("cancel", handle))

    def call(self, fn: Callable[[Any], T], timeout: float | None = None) -> T:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        fut: Future[T] = Future()
        self._inbox.put(("call", fn, fut))
        return fut.result(timeout)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort what is left (its sinks get UNAVAILABLE) and end the thread."""
        if self._thread.is_alive():
            self._inbox.put((_STOP,))
            self._thread.join(timeout)

    # --- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        while self._apply_commands(block=not self._live):
            if self._live:
                self._step()
        for handle in list(self._live.values()):
            self._drop(handle, Failed("UNAVAILABLE", "server shutting down"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once told to stop."""
        try:
            cmd = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] is _STOP:
                return False
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "submit":
            self._add(cmd[1])
        elif kind == "cancel":
            handle = cmd[1]
            if handle.req_id is not None and self._live.pop(handle.req_id, None) is not None:
                self.engine.abort(handle.req_id)
                logger.debug("aborted %s", handle.req_id)
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _add(self, handle: RequestHandle) -> None:
        if self._failure is not None:
            _send(handle, Failed("UNAVAILABLE", f"engine failed: {self._failure}"))
            return
        try:
            req_id = self.engine.add_request(handle.prompt, handle.params)
        except DSparkError as e:
            _send(handle, Rejected(e.details, e.code))
            return
        except ValueError as e:
            _send(handle, Rejected(str(e)))
            return
        handle.req_id = req_id
        handle.detok = IncrementalDetokenizer(self.engine.tokenizer.decode, handle.params.stop)
        self._live[req_id] = handle

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            state = self.engine.step()
        except WorkersUnavailable as e:  # a worker pool is gone for good: say so, do not hang
            logger.error("workers unavailable; failing every request: %s", e)
            self._fail(str(e), code="UNAVAILABLE")
            return
        except Exception as e:  # noqa: BLE001 - the engine's state is unknown: stop serving
            logger.exception("engine step failed; failing every request")
            self._fail(f"{type(e).__name__}: {e}")
            return
        now = time.perf_counter()
        if state is None:
            return
        running = 0
        for rs in state.requests:
            handle = self._live.get(rs.req_id)
            assert handle is not None, f"engine stepped unknown request {rs.req_id}"
            self._publish(handle, rs.committed, rs.finish_reason is not None, now)
            running += rs.finish_reason is None
        if self.metrics is not None:
            self.metrics.observe_step(state, now - start)
            self.metrics.observe_queue(waiting=len(self._live) - running, running=running)

    def _publish(
        self, handle: RequestHandle, tokens: tuple[int, ...], finished: bool, now: float
    ) -> None:
        assert handle.req_id is not None and handle.detok is not None
        if self.metrics is not None:
            first = handle.last_emit is None
            since = now - (handle.arrival if first else handle.last_emit)  # type: ignore[operator]
            self.metrics.observe_tokens(len(tokens), since, first)
        handle.last_emit = now
        if not finished:
            _send(handle, Chunk(handle.req_id, tokens, handle.detok.push(tokens)))
            return
        result = self.engine.result(self.engine.pop_finished(handle.req_id))
        del self._live[handle.req_id]
        if self.metrics is not None:
            self.metrics.observe_finished(
                result.finish_reason, len(result.prompt_ids), now - handle.arrival
            )
        _send(
            handle,
            Chunk(
                handle.req_id,
                tokens,
                handle.detok.finish(result.text),
                result.finish_reason,
                result.stats,
                result.prompt_ids,
            ),
        )

    def _fail(self, message: str, code: str = "INTERNAL") -> None:
        self._failure = message
        for handle in list(self._live.values()):
            self._drop(handle, Failed(code, f"engine failed: {message}"))
        for fn in self._on_failure:
            fn(message)

    def _drop(self, handle: RequestHandle, event: Failed) -> None:
        assert handle.req_id is not None
        del self._live[handle.req_id]
        try:
            self.engine.abort(handle.req_id)
        except Exception:  # noqa: BLE001 - best effort on a failed engine
            logger.exception("abort of %s failed", handle.req_id)
        _send(handle, event)


def _send(handle: RequestHandle, event: Event) -> None:
    try:
        handle.sink(event)
    except Exception as e:  # noqa: BLE001 - a gone consumer (closed event loop) is no fault
        logger.debug("could not deliver an event for %s: %s", handle.req_id, e)
