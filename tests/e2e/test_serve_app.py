"""The RayService wrapper: its application builds from the manifest's args and its health check
reads the coordinator's real gRPC health service."""

from __future__ import annotations

import pytest

serve_app = pytest.importorskip("dspark.coordinator.serve_app", reason="needs ray[serve]")

from dspark.config import ServeConfig  # noqa: E402
from dspark.coordinator.serve import start_service  # noqa: E402


def test_manifest_args_parse_into_a_serve_config() -> None:
    cfg = serve_app.parse_serve_args("--port 0 --tp 2 --num-draft-actors 2 --proposer ngram")
    assert (cfg.port, cfg.tp, cfg.num_draft_actors, cfg.proposer) == (0, 2, 2, "ngram")
    with pytest.raises(ValueError, match="serve_args"):
        serve_app.parse_serve_args("--tp two")


def test_app_builder_returns_a_serve_application() -> None:
    from ray.serve import Application

    assert isinstance(serve_app.app({"serve_args": "--port 0 --in-process"}), Application)
    with pytest.raises(ValueError):
        serve_app.app({"serve_args": "--no-such-flag"})


def grpc_health_serving(address: str, timeout: float = 2.0) -> bool:
    """The standard grpc.health.v1 check over the network (plaintext)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_health_check_follows_the_coordinators_health_service() -> None:
    """The replica's check reads the server's own health state: it agrees with the gRPC health
    service while serving, fails once the server drains, and needs no client credentials (so it
    works behind TLS and tokens, where a plaintext probe would be refused)."""
    from types import SimpleNamespace

    check = serve_app.Coordinator.func_or_class.check_health
    service = start_service(ServeConfig(port=0, metrics_port=-1, in_process=True, proposer="ngram"))
    replica = SimpleNamespace(service=service)
    try:
        assert grpc_health_serving(service.address)
        check(replica)  # does not raise
    finally:
        service.stop(0)
    assert not grpc_health_serving(service.address, timeout=0.5)
    with pytest.raises(RuntimeError, match="is not serving"):
        check(replica)
