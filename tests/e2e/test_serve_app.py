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


def test_health_check_sees_a_running_coordinator_and_its_absence() -> None:
    service = start_service(ServeConfig(port=0, metrics_port=-1, in_process=True, proposer="ngram"))
    try:
        assert serve_app.grpc_health_serving(service.address)
    finally:
        service.stop(0)
    assert not serve_app.grpc_health_serving(service.address, timeout=0.5)
