"""Security of the front door (issue 7, item 6): bearer tokens, TLS, mutual TLS, and an audit
that nothing reachable from the public API unpickles or evaluates input.

Servers are started as `dspark serve` starts them (`start_service` with a ServeConfig), with
the shipped demo models; certificates are made per test session by a throwaway CA.

Reproduce: `OMP_NUM_THREADS=1 pytest tests/e2e/test_security.py -q`.
"""

from __future__ import annotations

import ast
import asyncio
import datetime
import ipaddress
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import dspark
from dspark import errors
from dspark.cli import main as cli_main
from dspark.config import ServeConfig
from dspark.coordinator.auth import security_from_config
from dspark.coordinator.engine import Engine
from dspark.coordinator.serve import Service, start_service
from dspark.protos import dspark_pb2 as pb

TOKEN = "tok-" + "a1b2c3d4" * 4
OLD_TOKEN = "old-" + "9f8e7d6c" * 4
PARAMS = {"temperature": 0, "max_tokens": 6}


def _config(**kw: object) -> ServeConfig:
    base = dict(
        port=0,
        metrics_port=-1,
        in_process=True,
        proposer="draft-model",
        policy="fixed",
        k=4,
        num_blocks=1024,
        grace=1.0,
        auth_token_env="",
    )
    return ServeConfig(**{**base, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(f"{TOKEN}\n\n{OLD_TOKEN}\n")  # two tokens: a rotation in progress
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def engine(engine_kwargs) -> Engine:
    """The engine of the short-lived servers below, which run one at a time (`authed` has its
    own: an engine belongs to one loop thread)."""
    return Engine(**engine_kwargs)


@pytest.fixture(scope="module")
def authed(token_file: Path, engine_kwargs) -> Iterator[Service]:
    svc = start_service(_config(auth_token_file=str(token_file)), Engine(**engine_kwargs))
    yield svc
    svc.stop()


# --- bearer tokens ------------------------------------------------------------------------------
def test_no_token_unauthenticated(authed: Service, monkeypatch) -> None:
    monkeypatch.delenv("DSPARK_AUTH_TOKEN", raising=False)  # the SDK's default token
    with dspark.Client(authed.address, timeout=30, token=None) as client:
        with pytest.raises(errors.Unauthenticated) as e:
            client.generate("import os\n", PARAMS)
        assert e.value.code == "UNAUTHENTICATED" and "missing bearer token" in e.value.details
        with pytest.raises(errors.Unauthenticated):
            client.model_info()


def test_wrong_token_unauthenticated(authed: Service) -> None:
    for wrong in (TOKEN[:-1] + "x", TOKEN + "x", "", "Bearer", OLD_TOKEN.upper()):
        with dspark.Client(authed.address, timeout=30, token=wrong or "-") as client:
            with pytest.raises(errors.Unauthenticated) as e:
                client.generate("import os\n", PARAMS)
        assert "invalid bearer token" in e.value.details
    # Not a bearer credential at all.
    with grpc.insecure_channel(authed.address) as channel:
        call = channel.unary_unary(
            "/dspark.v1.DSpark/GetModelInfo",
            request_serializer=None,
            response_deserializer=pb.ModelInfo.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(b"", metadata=(("authorization", f"Basic {TOKEN}"),), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_right_token_served(authed: Service, prompts, reference, greedy) -> None:
    for token in (TOKEN, OLD_TOKEN):
        with dspark.Client(authed.address, timeout=60, token=token) as client:
            out = client.generate(prompts[0], greedy)
            assert client.model_info()["vocab_size"] == 4096
        assert out.token_ids == reference[0].token_ids and out.text == reference[0].text

    async def run() -> dspark.GenerationResult:
        async with dspark.AsyncClient(authed.address, timeout=60, token=TOKEN) as ac:
            return await ac.generate(prompts[1], greedy)

    assert asyncio.run(run()).token_ids == reference[1].token_ids


def test_sdk_reads_the_token_from_the_environment(authed: Service, monkeypatch) -> None:
    monkeypatch.setenv("DSPARK_AUTH_TOKEN", TOKEN)
    with dspark.Client(authed.address, timeout=60) as client:
        assert len(client.generate("import os\n", PARAMS).token_ids) >= 1


def test_health_and_reflection_need_no_token(authed: Service) -> None:
    with grpc.insecure_channel(authed.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        resp = health.Check(health_pb2.HealthCheckRequest(service="dspark.v1.DSpark"), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        (listed,) = reflect.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
    assert "dspark.v1.DSpark" in {s.name for s in listed.list_services_response.service}


def test_unauthenticated_calls_are_not_parsed_nor_probed(authed: Service) -> None:
    """Without a token, malformed bytes and unknown methods get UNAUTHENTICATED too: nothing of
    the request is deserialised and the method table is not revealed."""
    with grpc.insecure_channel(authed.address) as channel:
        for method, data in (
            ("/dspark.v1.DSpark/Generate", b"\xff\xff"),
            ("/dspark.v1.DSpark/NoSuchMethod", b""),
            ("/no.such.Service/Call", b""),
        ):
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as e:
                call(data, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        # With the token, the same malformed bytes reach the servicer: INVALID_ARGUMENT.
        gen = channel.unary_stream(
            "/dspark.v1.DSpark/Generate", request_serializer=None, response_deserializer=None
        )
        with pytest.raises(grpc.RpcError) as e:
            list(gen(b"\xff\xff", metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_exemptions_are_configurable(engine: Engine, monkeypatch) -> None:
    """auth_exempt='' puts health behind the token too; the token comes from a variable."""
    monkeypatch.setenv("DSPARK_TEST_TOKEN", TOKEN)
    svc = start_service(_config(auth_token_env="DSPARK_TEST_TOKEN", auth_exempt=""), engine)
    try:
        with grpc.insecure_channel(svc.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as e:
                health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            resp = health.Check(
                health_pb2.HealthCheckRequest(),
                timeout=10,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        svc.stop()


@pytest.mark.parametrize(
    "content, words",
    [("", "holds no token"), ("short\n", "at least 16"), ("has a space in it 0123\n", "spaces")],
)
def test_bad_token_files_refused_at_start(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(ValueError, match="ServeConfig.auth_token_file=") as e:
        security_from_config(_config(auth_token_file=str(path)))
    assert words in str(e.value)
    with pytest.raises(ValueError, match="cannot read"):
        security_from_config(_config(auth_token_file=str(tmp_path / "missing")))


def test_config_checks_tls_pairs() -> None:
    with pytest.raises(ValueError, match="ServeConfig.tls_key_file=None"):
        _config(tls_cert_file="cert.pem")
    with pytest.raises(ValueError, match="ServeConfig.tls_client_ca_file="):
        _config(tls_client_ca_file="ca.pem")


# --- TLS ----------------------------------------------------------------------------------------
def _write_pki(root: Path) -> dict[str, Path]:
    """A throwaway CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    files: dict[str, Path] = {}

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def cert(subject: str, key, issuer_name, issuer_key, *, ca: bool, sans=(), usage=None):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def save(name: str, data: bytes) -> None:
        files[name] = root / f"{name}.pem"
        files[name].write_bytes(data)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dspark test CA")])
    ca_cert = cert("dspark test CA", ca_key, ca_name, ca_key, ca=True)
    save("ca", ca_cert.public_bytes(serialization.Encoding.PEM))
    for name, sans, usage in (
        (
            "server",
            (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")),
            ExtendedKeyUsageOID.SERVER_AUTH,
        ),
        ("client", (), ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        save(f"{name}-key", key_pem(key))
        c = cert(f"dspark test {name}", key, ca_name, ca_key, ca=False, sans=sans, usage=usage)
        save(f"{name}-cert", c.public_bytes(serialization.Encoding.PEM))
    return files


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _write_pki(tmp_path_factory.mktemp("pki"))


def test_tls_with_the_ca_served_plaintext_refused(
    pki: dict[str, Path], token_file: Path, engine: Engine, capsys, monkeypatch
) -> None:
    monkeypatch.delenv("DSPARK_AUTH_TOKEN", raising=False)
    cfg = _config(
        tls_cert_file=str(pki["server-cert"]),
        tls_key_file=str(pki["server-key"]),
        auth_token_file=str(token_file),
    )
    svc = start_service(cfg, engine)
    ca = pki["ca"].read_bytes()
    try:
        with dspark.Client(svc.address, timeout=30, token=TOKEN, root_certificates=ca) as client:
            assert len(client.generate("import os\n", PARAMS).token_ids) >= 1
        # TLS is still not authentication: the token is checked on the TLS port too.
        with dspark.Client(svc.address, timeout=30, token="-", root_certificates=ca) as client:
            with pytest.raises(errors.Unauthenticated):
                client.generate("import os\n", PARAMS)
        # A plaintext client cannot talk to a TLS port; the RayService replica's health check
        # reads the server's own state, so it still sees it serving.
        with dspark.Client(svc.address, timeout=5, token=TOKEN) as client:
            with pytest.raises(errors.Unavailable):
                client.generate("import os\n", PARAMS)
        assert svc.server.is_serving()
        # A client that does not trust the CA (system roots only) refuses the certificate.
        with dspark.Client(svc.address, timeout=5, token=TOKEN, tls=True) as client:
            with pytest.raises(errors.Unavailable):
                client.generate("import os\n", PARAMS)

        async def run() -> int:
            async with dspark.AsyncClient(
                svc.address, timeout=30, token=TOKEN, root_certificates=ca
            ) as ac:
                return len((await ac.generate("import os\n", PARAMS)).token_ids)

        assert asyncio.run(run()) >= 1
        # The CLI speaks the same: a token file and the CA file, else a clear error and exit 1.
        base = ["generate", "--server", svc.address, "--prompt", "import os\n", "--max-tokens",
                "4", "--json", "--timeout", "30"]
        assert cli_main(base + ["--token-file", str(token_file), "--ca-file", str(pki["ca"])]) == 0
        assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 1
        assert cli_main(base + ["--ca-file", str(pki["ca"])]) == 1  # no token
        assert "missing bearer token" in capsys.readouterr().err
    finally:
        svc.stop()


def test_mutual_tls_requires_a_client_certificate(pki: dict[str, Path], engine: Engine) -> None:
    cfg = _config(
        tls_cert_file=str(pki["server-cert"]),
        tls_key_file=str(pki["server-key"]),
        tls_client_ca_file=str(pki["ca"]),
    )
    svc = start_service(cfg, engine)
    ca = pki["ca"].read_bytes()
    try:
        with dspark.Client(
            svc.address,
            timeout=30,
            root_certificates=ca,
            private_key=pki["client-key"].read_bytes(),
            certificate_chain=pki["client-cert"].read_bytes(),
        ) as client:
            assert len(client.generate("import os\n", PARAMS).token_ids) >= 1
        with dspark.Client(svc.address, timeout=5, root_certificates=ca) as client:
            with pytest.raises(errors.Unavailable):
                client.generate("import os\n", PARAMS)
    finally:
        svc.stop()


def test_tls_files_checked_at_start(tmp_path: Path, pki: dict[str, Path]) -> None:
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match="ServeConfig.tls_cert_file=.*not a PEM file"):
        security_from_config(_config(tls_cert_file=str(not_pem), tls_key_file=str(pki["ca"])))


# --- audit --------------------------------------------------------------------------------------
PUBLIC_API = (
    "coordinator/server.py",
    "coordinator/engine_loop.py",
    "coordinator/serve.py",
    "coordinator/auth.py",
    "coordinator/limits.py",
    "coordinator/detokenize.py",
    "dspark/protocol.py",
    "dspark/client.py",
    "dspark/config.py",
    "dspark/errors.py",
    "dspark/sampling_params.py",
    "dspark/cli.py",
)
FORBIDDEN_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def test_no_pickle_or_eval_in_the_request_path() -> None:
    """The modules a request passes through import no unpickler and call no eval/exec: a
    request is protobuf, decoded by protobuf, and only ever becomes strings and integers."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for rel in PUBLIC_API:
        tree = ast.parse((root / rel).read_text(), filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                found += [
                    f"{rel}: import {n}" for n in names if n.split(".")[0] in FORBIDDEN_MODULES
                ]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in FORBIDDEN_CALLS:
                    found.append(f"{rel}:{node.lineno}: {node.func.id}()")
            elif isinstance(node, ast.Attribute) and node.attr in ("loads", "load"):
                base = node.value
                if isinstance(base, ast.Name) and base.id in FORBIDDEN_MODULES | {"torch", "yaml"}:
                    found.append(f"{rel}:{node.lineno}: {base.id}.{node.attr}")
    assert not found, found
