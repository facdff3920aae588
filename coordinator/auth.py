"""Who may call the server: bearer-token authentication and TLS credentials (issue 7).

- **Bearer tokens.** `BearerTokenInterceptor` admits a call whose `authorization` metadata is
  `Bearer <token>` for one of the configured tokens, compared in constant time
  (`hmac.compare_digest`, every token every time). A call without the header, or with a wrong
  token, ends with UNAUTHENTICATED before its request is even deserialised: a wrong token
  establishes no identity, so it is an authentication failure, not PERMISSION_DENIED. Services
  (or `/service/method` paths) in `exempt` are served without a token: by default the standard
  health and reflection services, so load balancers and grpcurl can probe the server.
- **Tokens come from a file or an environment variable**, never a command-line value (which
  `ps` shows to every user). A file may hold several tokens, one a line, so a token can be
  rotated without downtime: add the new one, move the clients, remove the old one.
- **TLS.** `server_credentials` loads a PEM certificate chain and key; with a client CA bundle
  the server requires and verifies client certificates (mutual TLS).

Example:
    >>> interceptor = BearerTokenInterceptor([b"s3cret-token-0123456789"])
    >>> interceptor.authorized((("authorization", "Bearer s3cret-token-0123456789"),))
    True
    >>> interceptor.authorized((("authorization", "Bearer guess"),))
    False
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from dspark.config import ServeConfig

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16  # shorter secrets are guessable; refuse them at start-up
_HEADER = "authorization"
_SCHEME = "bearer "


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call without a valid bearer token, except to the `exempt` services."""

    def __init__(self, tokens: Iterable[bytes], exempt: Sequence[str] = ()) -> None:
        self._tokens = tuple(tokens)
        if not self._tokens:
            raise ValueError("BearerTokenInterceptor: no tokens given")
        self._exempt = tuple(_method_prefix(e) for e in exempt)

    def exempt(self, method: str) -> bool:
        """Whether `method` ("/pkg.Service/Method") is served without a token."""
        return any(method == e or (e.endswith("/") and method.startswith(e)) for e in self._exempt)

    def authorized(self, metadata: Iterable[Any] | None) -> bool:
        """Whether the call's metadata carries `authorization: Bearer <a configured token>`."""
        given = _bearer(metadata)
        if given is None:
            return False
        ok = False
        for token in self._tokens:  # no early exit: time does not tell which token matched
            ok |= hmac.compare_digest(given, token)
        return ok

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if self.exempt(method):
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata  # type: ignore[attr-defined]
        if self.authorized(metadata):
            return await continuation(handler_call_details)
        missing = _bearer(metadata) is None
        message = (
            "missing bearer token: send metadata 'authorization: Bearer <token>'"
            if missing
            else "invalid bearer token"
        )
        logger.info("refused %s: %s", method, "no token" if missing else "wrong token")
        handler = await continuation(handler_call_details)
        return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, message)


@dataclass(frozen=True)
class ServerSecurity:
    """What a Server needs to authenticate callers: interceptors and port credentials."""

    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    credentials: grpc.ServerCredentials | None = None  # None: a plaintext port
    summary: str = "no authentication, plaintext"


def security_from_config(cfg: ServeConfig, environ: dict[str, str] | None = None) -> ServerSecurity:
    """Load the token(s) and TLS files `cfg` names; raises ValueError naming a bad field."""
    environ = dict(os.environ) if environ is None else environ
    tokens, source = load_tokens(cfg.auth_token_file, cfg.auth_token_env, environ)
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    parts = []
    if tokens:
        exempt = [e.strip() for e in cfg.auth_exempt.split(",") if e.strip()]
        interceptors = (BearerTokenInterceptor(tokens, exempt),)
        parts.append(f"bearer token ({source}; exempt: {', '.join(exempt) or 'none'})")
    else:
        parts.append("no authentication")
    credentials = None
    if cfg.tls_cert_file is not None:
        assert cfg.tls_key_file is not None  # ServeConfig checks the pair
        credentials = server_credentials(
            cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file
        )
        parts.append("mutual TLS" if cfg.tls_client_ca_file else "TLS")
    else:
        parts.append("plaintext")
    return ServerSecurity(interceptors, credentials, ", ".join(parts))


def load_tokens(
    path: str | None, env_var: str, environ: dict[str, str]
) -> tuple[tuple[bytes, ...], str]:
    """(tokens, where they came from): the file's non-empty lines if `path` is given, else
    the environment variable's value if set; () when neither."""
    if path is not None:
        file = Path(path)
        try:
            text = file.read_text()
        except OSError as e:
            raise ValueError(f"ServeConfig.auth_token_file={path!r}: cannot read it ({e})") from e
        if file.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("auth token file %s is readable by others: chmod 600 it", path)
        tokens = tuple(line.strip() for line in text.splitlines() if line.strip())
        where, field_name = f"file {path}", "auth_token_file"
    elif env_var and environ.get(env_var, "").strip():
        tokens = (environ[env_var].strip(),)
        where, field_name = f"environment variable {env_var}", "auth_token_env"
    else:
        return (), ""
    if not tokens:
        raise ValueError(f"ServeConfig.{field_name}={path or env_var!r}: holds no token")
    for t in tokens:
        if len(t) < MIN_TOKEN_CHARS or any(c.isspace() for c in t) or not t.isprintable():
            raise ValueError(
                f"ServeConfig.{field_name}={path or env_var!r}: a token must be at least "
                f"{MIN_TOKEN_CHARS} printable characters without spaces (e.g. "
                "`openssl rand -hex 32`)"
            )
    return tuple(t.encode() for t in tokens), where


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> grpc.ServerCredentials:
    """TLS credentials of a server port; with `client_ca_file`, clients must show a
    certificate signed by it (mutual TLS)."""
    cert = _read("tls_cert_file", cert_file)
    key = _read("tls_key_file", key_file)
    ca = _read("tls_client_ca_file", client_ca_file) if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def _read(name: str, path: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"ServeConfig.{name}={path!r}: cannot read it ({e})") from e
    if b"-----BEGIN " not in data:
        raise ValueError(f"ServeConfig.{name}={path!r}: not a PEM file")
    return data


def _bearer(metadata: Iterable[Any] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == _HEADER and isinstance(value, str) and value[: len(_SCHEME)].lower() == _SCHEME:
            return value[len(_SCHEME) :].strip().encode()
    return None


def _method_prefix(name: str) -> str:
    """'/pkg.Service/Method' stays; 'pkg.Service' becomes the prefix '/pkg.Service/'."""
    name = name.strip()
    if name.startswith("/"):
        return name
    return f"/{name}/"


def _refusal(
    handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `code` at once.

    It takes the request as raw bytes (no deserializer), so nothing of an unauthenticated
    request is parsed. An unknown method is refused the same way: no probing without a token.
    """

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    streaming_in = handler is not None and handler.request_streaming
    streaming_out = handler is not None and handler.response_streaming
    if streaming_in and streaming_out:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if streaming_in:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if streaming_out:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
