"""The serve config: one frozen dataclass, every field documented; `dspark serve`'s flags come
from its fields (`add_arguments`, `from_arguments`).

Example:
    >>> ServeConfig(port=0, proposer="ngram").port
    0
    >>> ServeConfig(tp=0)
    Traceback (most recent call last):
    ...
    ValueError: ServeConfig.tp=0: must be an integer >= 1
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

Proposer = Literal["draft-model", "dspark", "ngram", "none"]
PolicyName = Literal["off", "fixed", "equal", "confidence-sync", "confidence"]
DType = Literal["float32", "float64", "bfloat16"]


def _doc(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ServeConfig:
    """How `dspark serve` runs: where it listens, which models, how they are distributed."""

    host: str = _doc(
        "127.0.0.1", "interface the gRPC and metrics servers bind (loopback by default)"
    )
    port: int = _doc(50051, "gRPC port; 0 picks a free one (the address is printed)")
    metrics_port: int = _doc(0, "Prometheus /metrics port on host; 0 picks a free one, -1 disables")
    address: str | None = _doc(
        None, "Ray cluster to join ('auto': this node's); default: start a local Ray instance"
    )
    in_process: bool = _doc(False, "run the engine in this process, without Ray (tp 1)")
    tp: int = _doc(
        1, "tensor-parallel degree of the target (Ray actors joined by torch.distributed)"
    )
    num_draft_actors: int = _doc(1, "draft actors in the Ray draft pool")
    target: str | None = _doc(None, "target HF directory (default: the shipped demo target)")
    proposer: Proposer = _doc("dspark", "who drafts")
    drafter: str | None = _doc(None, "drafter checkpoint directory (default: the shipped demo one)")
    policy: PolicyName | None = _doc(
        None, "verification policy (default: confidence; off for proposer none)"
    )
    k: int | None = _doc(None, "most drafts per request per step (default: 7 dspark, else 4)")
    dtype: DType = _doc("float32", "weights and KV-cache dtype")
    max_num_seqs: int = _doc(64, "requests in the running batch at most")
    num_blocks: int = _doc(4096, "KV-cache blocks per worker")
    block_size: int = _doc(16, "tokens per KV-cache block")
    grace: float = _doc(5.0, "seconds in-flight calls get to finish at shutdown")
    # --- limits (issue 7): beyond them a request is refused with a precise status -------------
    max_prompt_tokens: int | None = _doc(
        None, "most prompt tokens a request may send (default: the model's context - 1)"
    )
    max_tokens_limit: int | None = _doc(
        None, "ceiling on SamplingParams.max_tokens (default: the model's context)"
    )
    max_in_flight: int = _doc(
        256, "requests admitted at once (running + queued); more get RESOURCE_EXHAUSTED at once"
    )
    max_message_bytes: int = _doc(
        4 * 1024 * 1024, "largest request message the server receives (bytes)"
    )
    # --- security (docs/deploy.md, Security) --------------------------------------------------
    auth_token_file: str | None = _doc(
        None, "file holding the bearer token(s) clients must send, one a line (enables auth)"
    )
    auth_token_env: str = _doc(
        "DSPARK_AUTH_TOKEN",
        "environment variable holding the bearer token when no file is given (enables auth "
        "when set and non-empty; '' never reads one)",
    )
    auth_exempt: str = _doc(
        "grpc.health.v1.Health,grpc.reflection.v1alpha.ServerReflection",
        "comma-separated services or /service/method paths callable without a token",
    )
    tls_cert_file: str | None = _doc(None, "PEM certificate chain of the server (enables TLS)")
    tls_key_file: str | None = _doc(None, "PEM private key of tls_cert_file")
    tls_client_ca_file: str | None = _doc(
        None, "PEM CA bundle: clients must present a certificate it signed (mutual TLS)"
    )

    def __post_init__(self) -> None:
        for name, lo, hi in (("port", 0, 65535), ("metrics_port", -1, 65535)):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and lo <= value <= hi,
                name,
                value,
                f"must be in [{lo}, {hi}]",
            )
        for name in (
            "tp",
            "num_draft_actors",
            "max_num_seqs",
            "num_blocks",
            "block_size",
            "max_in_flight",
            "max_message_bytes",
        ):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, name, value, "must be an integer >= 1")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and value >= 1),
                name,
                value,
                "must be None (the model's context) or an integer >= 1",
            )
        self._check_security()
        _check(
            self.k is None or (isinstance(self.k, int) and self.k >= 1),
            "k",
            self.k,
            "must be None or an integer >= 1",
        )
        _check(
            isinstance(self.host, str) and bool(self.host), "host", self.host, "must be non-empty"
        )
        _check(
            isinstance(self.grace, (int, float)) and self.grace >= 0,
            "grace",
            self.grace,
            "must be >= 0",
        )
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            choices = _choices(hints[f.name])
            value = getattr(self, f.name)
            _check(
                not choices or value in choices or value is None and _optional(hints[f.name]),
                f.name,
                value,
                f"choose one of {list(choices)}",
            )
        if self.in_process:
            _check(self.tp == 1, "tp", self.tp, "needs Ray: drop in_process (--in-process)")
            _check(
                self.address is None,
                "address",
                self.address,
                "is a Ray cluster: drop in_process (--in-process)",
            )

    def _check_security(self) -> None:
        _check(
            (self.tls_cert_file is None) == (self.tls_key_file is None),
            "tls_key_file" if self.tls_key_file is None else "tls_cert_file",
            self.tls_key_file if self.tls_key_file is None else self.tls_cert_file,
            "TLS needs both tls_cert_file and tls_key_file",
        )
        _check(
            self.tls_client_ca_file is None or self.tls_cert_file is not None,
            "tls_client_ca_file",
            self.tls_client_ca_file,
            "mutual TLS needs the server's own tls_cert_file and tls_key_file",
        )
        for name in ("auth_token_file", "tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            value = getattr(self, name)
            _check(value is None or bool(value), name, value, "must be None or a path")
        _check(
            isinstance(self.auth_token_env, str),
            "auth_token_env",
            self.auth_token_env,
            "must be a variable name ('' reads none)",
        )
        exempt = [e.strip() for e in self.auth_exempt.split(",")] if self.auth_exempt else []
        _check(
            all(e and " " not in e for e in exempt),
            "auth_exempt",
            self.auth_exempt,
            "must be comma-separated names such as grpc.health.v1.Health",
        )

    # --- command line ---------------------------------------------------------------------
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (`--num-draft-actors` for num_draft_actors), help from its doc."""
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            doc = f.metadata["doc"]
            hint = hints[f.name]
            if hint is bool:
                parser.add_argument(flag, action="store_true", help=doc)
                continue
            choices = _choices(hint)
            kind = _scalar(hint)
            shown = "" if f.default is None else f" (default: {f.default})"
            parser.add_argument(
                flag, type=kind, choices=choices or None, default=f.default, help=doc + shown
            )

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> ServeConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"ServeConfig.{name}={value!r}: {rule}")


def _args(hint: Any) -> tuple[Any, ...]:
    return tuple(a for a in typing.get_args(hint) if a is not type(None))


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _choices(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    inner = _args(hint)
    return _choices(inner[0]) if len(inner) == 1 and inner[0] is not hint else ()


def _scalar(hint: Any) -> type:
    if typing.get_origin(hint) is Literal:
        return type(typing.get_args(hint)[0])
    inner = _args(hint)
    if inner and inner[0] is not hint:
        return _scalar(inner[0])
    return hint
