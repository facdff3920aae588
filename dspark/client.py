"""Python SDK of the dspark gRPC service: a sync `Client` and an asyncio `AsyncClient`.

Both speak the same verbs as the in-process engine: `generate` returns the same
`GenerationResult` (token_ids, text, finish_reason, stats), `stream` yields `Chunk`s as the
server commits tokens. Failed calls raise `dspark.errors` exceptions mapped from the status code,
carrying the server's message (`InvalidArgument` is also a ValueError, `DeadlineExceeded` a
TimeoutError, `Unavailable` a ConnectionError).

Security: `token=` sends `authorization: Bearer <token>` with every call (default: the
DSPARK_AUTH_TOKEN environment variable, when set); `tls=True` or `root_certificates=` (PEM bytes
of the CA that signed the server's certificate) opens a TLS channel, and `private_key=` with
`certificate_chain=` present a client certificate (mutual TLS). Without TLS a token travels in
plain text: use it so only on loopback or a trusted network.

Example (with `dspark serve` running):
    >>> from dspark import Client, SamplingParams
    >>> with Client("127.0.0.1:50051") as client:  # doctest: +SKIP
    ...     out = client.generate("def fib(n):\\n", SamplingParams(temperature=0, max_tokens=32))
    ...     print(out.text, out.finish_reason, out.stats["mean_accepted_length"])
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from dspark.coordinator.request import GenerationResult
from dspark.errors import DSparkError, Internal, Unavailable, from_status
from dspark.protocol import Chunk, Prompt, chunk_from_proto, info_from_proto, request_to_proto
from dspark.protos import dspark_pb2 as pb
from dspark.protos import dspark_pb2_grpc as pb_grpc
from dspark.sampling_params import SamplingParams

Params = SamplingParams | Mapping[str, object] | None

__all__ = ["AsyncClient", "Chunk", "Client", "result_from_chunks"]

TOKEN_ENV = "DSPARK_AUTH_TOKEN"


class _Connection:
    """What both clients share: the channel's credentials and the per-call metadata."""

    def __init__(
        self,
        token: str | None,
        tls: bool,
        root_certificates: bytes | None,
        private_key: bytes | None,
        certificate_chain: bytes | None,
    ) -> None:
        if (private_key is None) != (certificate_chain is None):
            raise ValueError("private_key and certificate_chain go together (mutual TLS)")
        token = token if token is not None else os.environ.get(TOKEN_ENV, "").strip() or None
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ()
        )
        secure = tls or root_certificates is not None or private_key is not None
        self.credentials = (
            grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            if secure
            else None
        )


def result_from_chunks(chunks: Iterable[Chunk]) -> GenerationResult:
    """Fold a complete stream into the engine's result type."""
    token_ids: list[int] = []
    texts: list[str] = []
    last: Chunk | None = None
    for last in chunks:
        token_ids.extend(last.token_ids)
        texts.append(last.text)
    if last is None or last.finish_reason is None:
        raise Internal("the stream ended without a final chunk")
    return GenerationResult(
        req_id=last.request_id,
        prompt_ids=last.prompt_ids,
        token_ids=tuple(token_ids),
        text="".join(texts),
        finish_reason=last.finish_reason,
        stats=dict(last.stats or {}),
    )


def _error(e: grpc.RpcError) -> DSparkError:
    code = e.code() if hasattr(e, "code") else None  # type: ignore[attr-defined]
    details = e.details() if hasattr(e, "details") else str(e)  # type: ignore[attr-defined]
    return from_status(code.name if code is not None else "UNKNOWN", details or "")


class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of every call; None: none.

    Example:
        >>> client = Client("127.0.0.1:50051", timeout=30)  # doctest: +SKIP
        >>> params = {"temperature": 0, "max_tokens": 8}
        >>> for chunk in client.stream([12, 7, 99], params):  # doctest: +SKIP
        ...     print(chunk.token_ids, chunk.text)
        >>> ca = open("ca.pem", "rb").read()  # doctest: +SKIP
        >>> secure = Client("dspark.internal:50051", token=os.environ["MY_TOKEN"],
        ...                 root_certificates=ca)  # doctest: +SKIP
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._conn = _Connection(token, tls, root_certificates, private_key, certificate_chain)
        if self._conn.credentials is not None:
            self._channel = grpc.secure_channel(
                address, self._conn.credentials, options=list(options)
            )
        else:
            self._channel = grpc.insecure_channel(address, options=list(options))
        self._stub = pb_grpc.DSparkStub(self._channel)

    def generate(
        self, prompt: Prompt, params: Params = None, *, timeout: float | None = None
    ) -> GenerationResult:
        """Generate for one prompt (text or token ids) and return the whole result."""
        return result_from_chunks(self.stream(prompt, params, timeout=timeout))

    def stream(
        self, prompt: Prompt, params: Params = None, *, timeout: float | None = None
    ) -> Iterator[Chunk]:
        """Yield chunks as tokens are committed; the last has finish_reason and stats.

        Closing the iterator early cancels the call, and the server frees the request.
        A mapping `params` is sent as given, for the server to validate.
        """
        request = request_to_proto(prompt, params)  # local faults raise here, before any call
        return self._chunks(request, timeout if timeout is not None else self.timeout)

    def _chunks(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[Chunk]:
        call = self._stub.Generate(request, timeout=timeout, metadata=self._conn.metadata)
        try:
            for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()  # a no-op once the call completed

    def model_info(self, *, timeout: float | None = None) -> dict[str, object]:
        """What the server serves: target, architecture, proposer, policy, k, tp, limits."""
        try:
            msg = self._stub.GetModelInfo(
                pb.GetModelInfoRequest(),
                timeout=timeout or self.timeout,
                metadata=self._conn.metadata,
            )
        except grpc.RpcError as e:
            raise _error(e) from None
        return info_from_proto(msg)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Wait until the channel connects; raises Unavailable after `timeout` seconds."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"no server at {self.address} after {timeout} s") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client; the channel opens on first use, in the running event loop.

    Example:
        >>> async def main() -> None:  # doctest: +SKIP
        ...     async with AsyncClient("127.0.0.1:50051") as client:
        ...         async for chunk in client.stream("import os\\n", {"temperature": 0}):
        ...             print(chunk.text, end="")
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
        token: str | None = None,
        tls: bool = False,
        root_certificates: bytes | None = None,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self._options = list(options)
        self._conn = _Connection(token, tls, root_certificates, private_key, certificate_chain)
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.DSparkStub | None = None

    def _stub(self) -> pb_grpc.DSparkStub:
        if self._stub_ is None:
            if self._conn.credentials is not None:
                self._channel = grpc.aio.secure_channel(
                    self.address, self._conn.credentials, options=self._options
                )
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub_ = pb_grpc.DSparkStub(self._channel)
        return self._stub_

    async def generate(
        self, prompt: Prompt, params: Params = None, *, timeout: float | None = None
    ) -> GenerationResult:
        """Generate for one prompt (text or token ids) and return the whole result."""
        return result_from_chunks([c async for c in self.stream(prompt, params, timeout=timeout)])

    def stream(
        self, prompt: Prompt, params: Params = None, *, timeout: float | None = None
    ) -> AsyncIterator[Chunk]:
        """Yield chunks as tokens are committed; closing early cancels the call."""
        request = request_to_proto(prompt, params)
        return self._chunks(request, timeout if timeout is not None else self.timeout)

    async def _chunks(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[Chunk]:
        call = self._stub().Generate(request, timeout=timeout, metadata=self._conn.metadata)
        try:
            async for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            call.cancel()

    async def model_info(self, *, timeout: float | None = None) -> dict[str, object]:
        try:
            msg = await self._stub().GetModelInfo(
                pb.GetModelInfoRequest(),
                timeout=timeout or self.timeout,
                metadata=self._conn.metadata,
            )
        except grpc.RpcError as e:
            raise _error(e) from None
        return info_from_proto(msg)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub_ = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
