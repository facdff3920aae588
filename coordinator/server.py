"""The gRPC server (`dspark.v1.DSpark`, health, reflection) in front of one engine loop.

The servicer is a thin adapter: it decodes a request (`dspark.protocol`), submits it to the
`EngineLoop` with a sink that puts events on this RPC's asyncio queue, and encodes what comes
back. The engine may be in-process or drive Ray worker pools; the server cannot tell.

- Cancellation and deadlines: when the RPC ends for any reason before the request finished
  (the client cancelled, its deadline passed, the server stopped), the done callback cancels the
  request in the loop, which aborts it and frees its caches.
- Errors: the engine's or SamplingParams' ValueError becomes INVALID_ARGUMENT with its message;
  an engine failure INTERNAL (and health NOT_SERVING); requests after that UNAVAILABLE.
- Shutdown: health goes NOT_SERVING, in-flight calls get `grace` seconds to finish, then the
  rest are cancelled and the loop stops.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from dspark.coordinator.engine_loop import EngineLike, EngineLoop, Event, Failed, Rejected
from dspark.coordinator.metrics import ServeMetrics
from dspark.protocol import chunk_to_proto, request_from_proto
from dspark.protos import dspark_pb2 as pb
from dspark.protos import dspark_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DSpark"].full_name  # "dspark.v1.DSpark"


class DSparkServicer(pb_grpc.DSparkServicer):
    def __init__(self, loop: EngineLoop, info: pb.ModelInfo) -> None:
        self._loop = loop
        self._info = info

    async def Generate(  # noqa: N802 - the RPC's name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        try:
            prompt, params = request_from_proto(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        events: asyncio.Queue[Event] = asyncio.Queue()
        aio_loop = asyncio.get_running_loop()
        handle = self._loop.submit(
            prompt, params, lambda ev: aio_loop.call_soon_threadsafe(events.put_nowait, ev)
        )
        finished = False

        def on_done(_: object) -> None:
            if not finished:
                self._loop.cancel(handle)

        context.add_done_callback(on_done)
        while not finished:
            event = await events.get()
            if isinstance(event, Rejected):
                finished = True
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, event.message)
            if isinstance(event, Failed):
                finished = True
                await context.abort(grpc.StatusCode[event.code], event.message)
            finished = event.finished  # type: ignore[union-attr]
            yield chunk_to_proto(event)  # type: ignore[arg-type]

    async def GetModelInfo(  # noqa: N802 - the RPC's name
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return self._info


def model_info(engine: Any, **extra: object) -> pb.ModelInfo:
    """ModelInfo read from an engine's target config; `extra` fills the serve-side fields."""
    cfg = engine.target.config
    fields: dict[str, object] = {
        "architecture": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "max_model_len": engine.max_model_len,
        "eos_token_ids": sorted(engine.eos_ids),
        "policy": getattr(engine.policy, "name", ""),
        "k": engine.max_k,
        "tp": 1,
        "version": _version(),
    }
    fields.update(extra)
    return pb.ModelInfo(**fields)  # type: ignore[arg-type]


def _version() -> str:
    try:
        return importlib.metadata.version("dspark-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Server:
    """A gRPC server on its own thread and asyncio loop, with the engine on the loop thread.

    Example:
        >>> from dspark.coordinator.engine import Engine
        >>> server = Server(Engine(proposer="ngram")).start()  # 127.0.0.1, a free port
        >>> server.address.startswith("127.0.0.1:")
        True
        >>> server.stop()
    """

    def __init__(
        self,
        engine: EngineLike,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        info: pb.ModelInfo | None = None,
        metrics: ServeMetrics | None = None,
        grace: float = 5.0,
    ) -> None:
        self.host = host
        self.port = port
        self.grace = grace
        self.metrics = metrics
        self.loop = EngineLoop(engine, metrics)
        self._info = info if info is not None else model_info(engine)
        self._thread = threading.Thread(target=self._serve_thread, name="dspark-grpc", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._health: health_aio.HealthServicer | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> Server:
        """Start the engine loop and the gRPC server; returns once the port is bound."""
        self.loop.start()
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self.loop.stop()
            raise self._error
        logger.info("dspark gRPC server listening on %s", self.address)
        return self

    def stop(self, grace: float | None = None) -> None:
        """Finish in-flight calls within `grace` seconds, cancel the rest, stop the loop."""
        if (
            self._aio_loop is not None
            and self._stop_requested is not None
            and self._thread.is_alive()
        ):
            if grace is not None:
                self.grace = grace
            self._aio_loop.call_soon_threadsafe(self._stop_requested.set)
            self._thread.join()
        self.loop.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (or `timeout` passed); True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the server thread ----------------------------------------------------------------
    def _serve_thread(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self._aio_loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        server = grpc.aio.server()
        pb_grpc.add_DSparkServicer_to_server(DSparkServicer(self.loop, self._info), server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        self.port = server.add_insecure_port(f"{self.address}")
        if self.port == 0:
            raise OSError(f"could not bind {self.host}:{self.port}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.loop.on_failure(self._set_not_serving)
        self._ready.set()
        await self._stop_requested.wait()
        await self._health.enter_graceful_shutdown()
        await server.stop(self.grace)

    def _set_not_serving(self, message: str) -> None:
        # Called on the engine-loop thread: hop to the server's loop.
        assert self._aio_loop is not None and self._health is not None
        health = self._health
        for name in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(
                health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING), self._aio_loop
            )
