"""`dspark serve`: build the engine a ServeConfig asks for, then its gRPC server and metrics.

By default the workers run as Ray actor pools on a local Ray instance (DESIGN.md §6); with
`in_process` (or when this install has no Ray worker pools) the engine runs its workers in this
process. Both give the same output; the log says which one runs.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from dspark.config import ServeConfig
from dspark.coordinator.auth import security_from_config
from dspark.coordinator.engine import Engine
from dspark.coordinator.limits import Limits
from dspark.coordinator.metrics import ServeMetrics
from dspark.coordinator.server import Server, model_info

logger = logging.getLogger(__name__)


def ray_workers_module() -> ModuleType | None:
    """`dspark.coordinator.ray_workers` when it and Ray are importable, else None."""
    try:
        module = importlib.import_module("dspark.coordinator.ray_workers")
    except ImportError as e:
        logger.debug("no Ray worker pools: %s", e)
        return None
    return module if hasattr(module, "build_ray_workers") else None


@dataclass
class Service:
    """A running server with its engine, metrics endpoint and (when used) Ray worker pools."""

    config: ServeConfig
    engine: Engine
    server: Server
    metrics: ServeMetrics
    metrics_port: int | None
    mode: str  # "ray" | "in-process"
    workers: Any = None
    stop_ray: bool = False  # this service started the Ray instance, so it stops it

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (in-flight calls get `grace` seconds), then the metrics and the pools."""
        self.server.stop(self.config.grace if grace is None else grace)
        self.metrics.stop_http()
        if self.workers is not None:
            module = ray_workers_module()
            assert module is not None
            module.shutdown(self.workers, stop_ray=self.stop_ray)
            self.workers = None


def build_engine(cfg: ServeConfig) -> tuple[Engine, str, Any, bool]:
    """(engine, mode, workers, started Ray): Ray pools unless `in_process` or this install lacks
    them. Ray is started (locally) only when no address is given and it is not running yet."""
    dtype = getattr(torch, cfg.dtype)
    engine_kwargs = dict(
        target=cfg.target,
        proposer=cfg.proposer,
        drafter=cfg.drafter,
        policy=cfg.policy,
        k=cfg.k,
        dtype=dtype,
        max_num_seqs=cfg.max_num_seqs,
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
    )
    module = None if cfg.in_process else ray_workers_module()
    if module is None:
        if cfg.tp > 1 or cfg.address is not None:
            raise ValueError(
                f"ServeConfig.tp={cfg.tp}, address={cfg.address!r}: need Ray worker pools, "
                "which this install lacks (pip install ray)"
            )
        if not cfg.in_process:
            logger.warning("Ray worker pools unavailable: running the engine in-process (tp 1)")
        logger.info("engine: in-process, proposer %s", cfg.proposer)
        return Engine(**engine_kwargs), "in-process", None, False  # type: ignore[arg-type]
    ray = sys.modules.get("ray")
    start_ray = cfg.address is None and not (ray is not None and ray.is_initialized())
    workers = module.build_ray_workers(
        cfg.target,
        cfg.proposer,
        cfg.drafter,
        cfg.tp,
        cfg.num_draft_actors,
        cfg.num_blocks,
        cfg.block_size,
        dtype,
        address=cfg.address,
    )
    try:
        engine = Engine(**engine_kwargs, workers=workers)  # type: ignore[arg-type]
    except BaseException:
        module.shutdown(workers, stop_ray=start_ray)
        raise
    logger.info(
        "engine: Ray, tp %d, %d draft actors (%s)", cfg.tp, cfg.num_draft_actors, cfg.proposer
    )
    return engine, "ray", workers, start_ray


def limits_from_config(cfg: ServeConfig) -> Limits:
    return Limits(
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_tokens=cfg.max_tokens_limit,
        max_in_flight=cfg.max_in_flight,
        max_message_bytes=cfg.max_message_bytes,
    )


def start_service(cfg: ServeConfig, engine: Engine | None = None) -> Service:
    """Build (or take) the engine, start the gRPC server and the metrics endpoint."""
    security = security_from_config(cfg)  # bad token or TLS files fail before any model loads
    mode, workers, stop_ray = "in-process", None, False
    if engine is None:
        engine, mode, workers, stop_ray = build_engine(cfg)
    metrics = ServeMetrics()
    info = model_info(
        engine,
        target=str(cfg.target or "demo:target"),
        proposer=cfg.proposer,
        tp=cfg.tp if mode == "ray" else 1,
        num_draft_actors=cfg.num_draft_actors if mode == "ray" else 0,
    )
    server = Server(
        engine,
        host=cfg.host,
        port=cfg.port,
        info=info,
        metrics=metrics,
        grace=cfg.grace,
        limits=limits_from_config(cfg),
        security=security,
    )
    logger.info("security: %s", security.summary)
    if not _loopback(cfg.host) and (not security.interceptors or security.credentials is None):
        logger.warning(
            "serving on %s with %s: anyone who reaches this address can use it (docs/deploy.md,"
            " Security)",
            cfg.host,
            security.summary,
        )
    try:
        server.start()
        metrics_port = (
            None if cfg.metrics_port < 0 else metrics.start_http(cfg.host, cfg.metrics_port)
        )
    except BaseException:
        server.stop(0)
        if workers is not None:
            ray_workers_module().shutdown(workers, stop_ray=stop_ray)  # type: ignore[union-attr]
        raise
    return Service(cfg, engine, server, metrics, metrics_port, mode, workers, stop_ray)


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
