"""Ray Serve wrapper for a KubeRay RayService (cluster/kuberay/rayservice.yaml).

dspark's front door is its own gRPC server, not Serve's HTTP proxy. The one Serve deployment
here, pinned to the head node, runs that coordinator (`dspark serve` with the given flags) in
its replica and reports its health to Serve, so a RayService can roll it out and restart it.
Needs `ray[serve]` (the `serve` extra).

    import_path: dspark.coordinator.serve_app:app
    args: {serve_args: "--address auto --port 50051 --tp 2 ..."}
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from ray import serve

from dspark.config import ServeConfig


def parse_serve_args(serve_args: str) -> ServeConfig:
    """`dspark serve` flags (one string) -> ServeConfig; bad values raise ValueError."""
    parser = argparse.ArgumentParser(prog="dspark serve", exit_on_error=False)
    ServeConfig.add_arguments(parser)
    try:
        ns = parser.parse_args(shlex.split(serve_args))
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"serve_args {serve_args!r}: {e}") from e
    return ServeConfig.from_arguments(ns)


@serve.deployment(name="Coordinator", num_replicas=1, health_check_period_s=10)
class Coordinator:
    def __init__(self, serve_args: str) -> None:
        from dspark.coordinator.serve import start_service

        self.service = start_service(parse_serve_args(serve_args))

    def check_health(self) -> None:
        """Serve calls this; raising marks the replica unhealthy and restarts it. It reads the
        server's own health state, so it works whatever TLS or token the port requires."""
        if not self.service.server.is_serving():
            raise RuntimeError(f"dspark coordinator at {self.service.address} is not serving")

    def address(self) -> str:
        return self.service.address

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.stop()


def app(args: dict[str, Any]) -> serve.Application:
    """Application builder named by the RayService's `import_path`."""
    serve_args = str(args.get("serve_args", ""))
    parse_serve_args(serve_args)  # fail at deploy time, not in the replica
    return Coordinator.bind(serve_args)
