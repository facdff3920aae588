"""The gRPC server (`dspark.v1.DSpark`, health, reflection) in front of one engine loop.

The servicer is a thin adapter: it decodes a request (`dspark.protocol`), submits it to the
`EngineLoop` with a sink that puts events on this RPC's asyncio queue, and encodes what comes
back. The engine may be in-process or drive Ray worker pools; the server cannot tell.

- Cancellation and deadlines: when the RPC ends for any reason before the request finished
  (the client cancelled, its deadline passed, the server stopped), the done callback cancels the
  request in the loop, which aborts it and frees its caches.
- Errors (each message names the field and the value):

  | input | status |
  | --- | --- |
  | bytes that are no GenerateRequest, bad UTF-8 in a string | INVALID_ARGUMENT |
  | no prompt, empty prompt, token ids outside the vocabulary | INVALID_ARGUMENT |
  | SamplingParams out of their domain (top_p 2, temperature -1, ...) | INVALID_ARGUMENT |
  | prompt over max_prompt_tokens or the context, max_tokens over the ceiling | OUT_OF_RANGE |
  | a message over max_message_bytes (gRPC's own check) | RESOURCE_EXHAUSTED |
  | max_in_flight requests already admitted (answered at once) | RESOURCE_EXHAUSTED |
  | the server is draining (stop() or SIGTERM) | UNAVAILABLE |
  | an engine failure (and health NOT_SERVING); requests after it | INTERNAL; UNAVAILABLE |

  Requests are decoded by `lenient_parser`, so undecodable bytes reach the servicer as a
  `MalformedMessage` (a raising deserializer would make gRPC answer INTERNAL). Text prompts are
  bounded in bytes, then tokenised on a worker thread, never on the engine-loop thread.
- Shutdown (drain): health goes NOT_SERVING and new Generate calls are refused with
  UNAVAILABLE; in-flight calls get `grace` seconds to finish, then the rest are cancelled and
  the loop stops.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from dspark.coordinator.auth import ServerSecurity
from dspark.coordinator.engine_loop import EngineLike, EngineLoop, Event, Failed, Rejected
from dspark.coordinator.limits import Limits, RequestChecker
from dspark.coordinator.metrics import ServeMetrics
from dspark.errors import DSparkError
from dspark.protocol import MalformedMessage, chunk_to_proto, lenient_parser, request_from_proto
from dspark.protos import dspark_pb2 as pb
from dspark.protos import dspark_pb2_grpc as pb_grpc
from dspark.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["DSpark"].full_name  # "dspark.v1.DSpark"


class DSparkServicer(pb_grpc.DSparkServicer):
    """`dspark.v1.DSpark` over one EngineLoop: checks, admission, streaming, drain.

    Runs on the server's asyncio loop only, so its counters need no lock.
    """

    def __init__(
        self,
        loop: EngineLoop,
        info: pb.ModelInfo,
        checker: RequestChecker,
        max_in_flight: int,
        encode: Callable[[str], Sequence[int]],
        metrics: ServeMetrics | None = None,
    ) -> None:
        self._loop = loop
        self._metrics = metrics
        self._info = info
        self._encode = encode  # the target's tokenizer: stateless, safe on any thread
        self._checker = checker
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        """Generate calls admitted and not yet ended."""
        return self._in_flight

    def drain(self) -> None:
        """From now on refuse new Generate calls with UNAVAILABLE; in-flight ones go on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no Generate call is in flight (or `timeout` passed); True if none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:  # noqa: UP041 - not TimeoutError before 3.11
            return False
        return True

    async def Generate(  # noqa: N802 - the RPC's name
        self, request: pb.GenerateRequest | MalformedMessage, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        if self._draining:
            await self._refuse(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "server is draining (shutting down): retry elsewhere",
            )
        try:
            prompt, params = self._decode(request)
        except DSparkError as e:
            await self._refuse(context, grpc.StatusCode[e.code], e.details)
        except ValueError as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self._in_flight >= self._max_in_flight:
            await self._refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._in_flight} requests in flight, the most this server admits "
                f"(max_in_flight {self._max_in_flight}): retry later",
            )
        self._in_flight += 1
        self._idle.clear()
        try:
            ids = await self._tokenize(prompt, context)
            async for chunk in self._stream(ids, params, context):
                yield chunk
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _refuse(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str
    ) -> NoReturn:
        """End a Generate call that was never served, counted by status (`request_refused`)."""
        if self._metrics is not None:
            self._metrics.observe_refused(code.name)
        await context.abort(code, details)
        raise AssertionError("unreachable: context.abort raises")

    def _decode(self, request: pb.GenerateRequest | MalformedMessage) -> tuple[Any, SamplingParams]:
        """(prompt, params) of a well-formed request within limits; raises DSparkError or
        ValueError (SamplingParams' own check) otherwise."""
        if isinstance(request, MalformedMessage):
            raise ValueError(request.message)
        prompt, params = request_from_proto(request)
        self._checker.check_params(params)
        if isinstance(prompt, str):
            self._checker.check_text(prompt)
        else:
            self._checker.check_prompt(prompt, "token_ids.ids")
        return prompt, params

    async def _tokenize(
        self, prompt: str | tuple[int, ...], context: grpc.aio.ServicerContext
    ) -> tuple[int, ...]:
        """Token ids of the prompt, checked; text is tokenised off the engine-loop thread."""
        if not isinstance(prompt, str):
            return prompt
        ids = tuple(await asyncio.to_thread(self._encode, prompt))
        try:
            self._checker.check_prompt(ids, "text")
        except DSparkError as e:
            await self._refuse(context, grpc.StatusCode[e.code], e.details)
        return ids

    async def _stream(
        self, ids: tuple[int, ...], params: SamplingParams, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateChunk]:
        events: asyncio.Queue[Event] = asyncio.Queue()
        aio_loop = asyncio.get_running_loop()
        handle = self._loop.submit(
            ids, params, lambda ev: aio_loop.call_soon_threadsafe(events.put_nowait, ev)
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
                await self._refuse(context, grpc.StatusCode[event.code], event.message)
            if isinstance(event, Failed):
                finished = True
                await context.abort(grpc.StatusCode[event.code], event.message)
            finished = event.finished  # type: ignore[union-attr]
            yield chunk_to_proto(event)  # type: ignore[arg-type]

    async def GetModelInfo(  # noqa: N802 - the RPC's name
        self, request: pb.GetModelInfoRequest | MalformedMessage, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        if isinstance(request, MalformedMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return self._info


def add_dspark_service(servicer: DSparkServicer, server: grpc.aio.Server) -> None:
    """Register `dspark.v1.DSpark` as the generated `add_DSparkServicer_to_server` does, but
    with lenient request deserializers (undecodable bytes reach the servicer, which answers
    INVALID_ARGUMENT naming the bad field, instead of gRPC's INTERNAL)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=lenient_parser(pb.GenerateRequest),
            response_serializer=pb.GenerateChunk.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=lenient_parser(pb.GetModelInfoRequest),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


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

    `limits` bound what a request may ask (defaults: the model's context, 256 in flight,
    4 MiB messages); `security` adds authentication interceptors and TLS credentials
    (`dspark.coordinator.auth.security_from_config`).

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
        limits: Limits | None = None,
        security: ServerSecurity | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.grace = grace
        self.metrics = metrics
        self.loop = EngineLoop(engine, metrics)
        self.limits = limits if limits is not None else Limits()
        self.security = security if security is not None else ServerSecurity()
        self.checker = RequestChecker.for_engine(self.limits, engine)
        self._encode = engine.tokenizer.encode
        self._info = pb.ModelInfo()
        self._info.CopyFrom(info if info is not None else model_info(engine))
        self._info.max_prompt_tokens = self.checker.max_prompt_tokens
        self._info.max_tokens_limit = self.checker.max_tokens
        self._info.max_in_flight = self.limits.max_in_flight
        self._info.max_message_bytes = self.limits.max_message_bytes
        self.servicer: DSparkServicer | None = None
        self._thread = threading.Thread(target=self._serve_thread, name="dspark-grpc", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._health: health_aio.HealthServicer | None = None
        self._serving = False  # what the health service says, readable from any thread

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
        """Drain: refuse new calls (UNAVAILABLE, health NOT_SERVING), let in-flight calls
        finish within `grace` seconds, cancel the rest, stop the loop."""
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

    def is_serving(self) -> bool:
        """The health service's answer (SERVING) without a network round trip: True once the
        port is bound, until an engine failure or the start of a drain."""
        return self._serving and self._thread.is_alive()

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
        server = grpc.aio.server(
            interceptors=self.security.interceptors,
            options=[("grpc.max_receive_message_length", self.limits.max_message_bytes)],
        )
        self.servicer = DSparkServicer(
            self.loop, self._info, self.checker, self.limits.max_in_flight, self._encode,
            self.metrics,
        )
        add_dspark_service(self.servicer, server)
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
        if self.security.credentials is not None:
            self.port = server.add_secure_port(self.address, self.security.credentials)
        else:
            self.port = server.add_insecure_port(self.address)
        if self.port == 0:
            raise OSError(f"could not bind {self.host}:{self.port}")
        await server.start()
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True
        self.loop.on_failure(self._set_not_serving)
        self._ready.set()
        await self._stop_requested.wait()
        await self._drain(server)

    async def _drain(self, server: grpc.aio.Server) -> None:
        assert self._health is not None and self.servicer is not None
        start = time.monotonic()
        self._serving = False
        self.servicer.drain()
        await self._health.enter_graceful_shutdown()
        logger.info(
            "draining: %d calls in flight, %.1f s grace", self.servicer.in_flight, self.grace
        )
        if not await self.servicer.wait_idle(self.grace):
            logger.warning(
                "grace passed with %d calls in flight: cancelling them", self.servicer.in_flight
            )
        await server.stop(max(0.0, self.grace - (time.monotonic() - start)))

    def _set_not_serving(self, message: str) -> None:
        # Called on the engine-loop thread: hop to the server's loop.
        assert self._aio_loop is not None and self._health is not None
        self._serving = False
        health = self._health
        for name in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(
                health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING), self._aio_loop
            )
