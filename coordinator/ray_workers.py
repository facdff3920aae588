"""Ray worker pools for the engine: a tensor-parallel target group and a draft-actor pool.

`build_ray_workers(...)` returns `(TargetGroup, DraftPool)`, the two objects `Engine(workers=...)`
takes in place of its in-process runner and proposer: the coordinator's code is the same, only
the transport differs (DESIGN.md §2, §6).

    >>> workers = build_ray_workers(demo_path("target"), "ngram", tp=2)  # doctest: +SKIP
    >>> engine = Engine(demo_path("target"), "ngram", workers=workers)  # doctest: +SKIP
    >>> engine.generate("def add(a, b):")  # doctest: +SKIP
    >>> shutdown(workers, stop_ray=True)  # doctest: +SKIP

Without an address a local Ray instance is started on loopback only: every Ray socket binds to
127.0.0.1, no dashboard. With an address (`"auto"`: the cluster this node belongs to) the pools
are placed on that cluster. Resources are reserved with placement groups: one bundle per TP rank
(a GPU each where the cluster has GPUs; STRICT_PACK keeps the ranks on one node) and one per
draft actor.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dspark import tensor_wire
from dspark.demo import demo_path
from dspark.draft_worker.actor import (
    NAMESPACE,
    PROPOSER_NAMES,
    DraftActor,
    DraftPool,
    draft_actor_name,
)
from dspark.models.config import ModelConfig
from dspark.target_worker.actor import TargetActor, TargetGroup, target_actor_name
from dspark.target_worker.tensor_parallel import local_config

logger = logging.getLogger(__name__)

Workers = tuple[TargetGroup, DraftPool]

_PG_TIMEOUT_S = 120.0
DRAFT_MAX_RESTARTS = 8  # a crash-looping drafter stops being restarted; requests decode plainly


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_memory: int = 256 * 2**20) -> bool:
    """Join the Ray cluster at `address`, or start a local loopback-only instance (None).

    Returns True when this call started or joined Ray, False when Ray was already initialised
    in this process (then only the tensor transport is installed).
    """
    loaded = sys.modules.get("ray")
    if loaded is not None and loaded.is_initialized():
        tensor_wire.install()
        return False
    if address is None:
        # Ray picks the node's routable address unless told the node is alone; it reads this
        # when imported, and the processes it starts inherit it.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if address is None:
        from ray._private import ray_constants

        # Where Ray was imported before the variable was set, it has read it already.
        ray_constants.ENABLE_RAY_CLUSTER = False
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE,
            _node_ip_address="127.0.0.1", object_store_memory=object_store_memory,
            logging_level=logging.WARNING,
        )
    else:
        ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
    tensor_wire.install()
    return True


def build_ray_workers(
    target_dir: str | Path | None = None,
    proposer: str = "dspark",
    drafter_dir: str | Path | None = None,
    tp: int = 1,
    num_draft_actors: int = 2,
    num_blocks: int = 4096,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    address: str | None = None,
    *,
    draft_num_gpus: float = 0.0,
    omp_threads: int = 1,
) -> Workers:
    """Start the target group (`tp` ranks) and the draft pool; connect to Ray first if needed.

    `proposer` is `draft-model`, `ngram`, `dspark` or `none`; `drafter_dir` defaults to the
    shipped demo drafter of that kind. `omp_threads` is each actor's intra-op thread count.
    """
    if tp < 1 or num_draft_actors < 1:
        raise ValueError(f"tp={tp}, num_draft_actors={num_draft_actors}: both must be >= 1")
    target = Path(target_dir) if target_dir is not None else demo_path("target")
    connect(address, num_cpus=None if address else max(os.cpu_count() or 1, tp + num_draft_actors))
    # The rank processes start while the draft actors load; the ranks join once the drafter
    # has said which target layers it reads.
    started = _start_target_ranks(target, tp, omp_threads)
    try:
        pool = build_draft_pool(proposer, drafter_dir, target, num_draft_actors, num_blocks,
                                block_size, dtype, num_gpus=draft_num_gpus, omp_threads=omp_threads)
    except BaseException:
        _kill(*started)
        raise
    try:
        group = _join_target_ranks(started, target, num_blocks, block_size, dtype,
                                   pool.hidden_layers, pool.max_model_len, omp_threads)
    except BaseException:
        shutdown((None, pool))
        raise
    logger.info("ray workers: tp=%d on %s, %d %s draft actors", tp, group.device,
                num_draft_actors, proposer)
    return group, pool


def build_draft_pool(
    proposer: str = "dspark",
    drafter_dir: str | Path | None = None,
    target_dir: str | Path | None = None,
    num_actors: int = 2,
    num_blocks: int = 4096,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    *,
    num_gpus: float = 0.0,
    omp_threads: int = 1,
    max_restarts: int = DRAFT_MAX_RESTARTS,
) -> DraftPool:
    """Start `num_actors` draft actors (`draft-0` ...) on the connected Ray cluster.

    Ray restarts a dead draft actor up to `max_restarts` times (its state is rebuilt by the
    coordinator; see `DraftPool`)."""
    import ray

    if proposer not in PROPOSER_NAMES:
        raise ValueError(f"proposer={proposer!r}: choose one of {list(PROPOSER_NAMES)}")
    target = None  # only the DSpark drafter reads the target (its embedding and LM head)
    if proposer == "dspark":
        target = Path(target_dir) if target_dir is not None else demo_path("target")
    drafter = None
    if proposer in ("draft-model", "dspark"):
        drafter = Path(drafter_dir) if drafter_dir is not None else demo_path(proposer)
    bundle: dict[str, float] = {"CPU": 1.0}
    if num_gpus:
        bundle["GPU"] = num_gpus
    pg = _reserve([bundle] * num_actors, "PACK")
    cls = ray.remote(DraftActor)
    actors = [
        cls.options(
            name=draft_actor_name(i), namespace=NAMESPACE, num_cpus=1, num_gpus=num_gpus,
            scheduling_strategy=_in_bundle(pg, i), runtime_env=_env(omp_threads),
            max_restarts=max_restarts,
        ).remote(proposer, _str(drafter), _str(target), num_blocks, block_size, dtype, omp_threads)
        for i in range(num_actors)
    ]
    try:
        infos = ray.get([a.info.remote() for a in actors])
    except BaseException:
        _kill(actors, pg)
        raise
    return DraftPool(actors, infos[0], pg)


def build_target_group(
    target_dir: str | Path | None = None,
    tp: int = 1,
    num_blocks: int = 4096,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    *,
    hidden_layers: tuple[int, ...] = (),
    max_model_len: int | None = None,
    omp_threads: int = 1,
) -> TargetGroup:
    """Start `tp` target ranks (`target-0` ...) joined into one process group.

    GPU bundles (and NCCL) when the cluster has `tp` GPUs, CPU bundles (and gloo) otherwise.
    `hidden_layers`: decoder layers whose outputs the drafter consumes; `max_model_len` caps the
    context the group reports (the drafter's, when shorter).
    """
    target = Path(target_dir) if target_dir is not None else demo_path("target")
    started = _start_target_ranks(target, tp, omp_threads)
    return _join_target_ranks(started, target, num_blocks, block_size, dtype, hidden_layers,
                              max_model_len, omp_threads)


def _start_target_ranks(target: Path, tp: int, omp_threads: int) -> tuple[list[Any], Any]:
    """Reserve the bundles and start the rank processes (not waiting for them)."""
    import ray

    local_config(ModelConfig.from_dir(target), tp)  # a clear error here, not inside an actor
    have = ray.cluster_resources().get("GPU", 0)
    gpus = 1 if have >= tp else 0
    if 0 < have < tp:
        logger.warning("tp=%d but the cluster has %g GPUs: the target ranks run on CPUs", tp, have)
    pg = _reserve([{"CPU": 1.0, "GPU": float(gpus)} if gpus else {"CPU": 1.0}] * tp, "STRICT_PACK")
    cls = ray.remote(TargetActor)
    actors = [
        cls.options(
            name=target_actor_name(rank), namespace=NAMESPACE, num_cpus=1, num_gpus=gpus,
            scheduling_strategy=_in_bundle(pg, rank), runtime_env=_env(omp_threads),
        ).remote(rank, tp, omp_threads)
        for rank in range(tp)
    ]
    return actors, pg


def _join_target_ranks(
    started: tuple[list[Any], Any], target: Path, num_blocks: int, block_size: int,
    dtype: torch.dtype, hidden_layers: tuple[int, ...], max_model_len: int | None,
    omp_threads: int,
) -> TargetGroup:
    import ray

    actors, pg = started
    try:
        master = ray.get(actors[0].address.remote())
        # Every rank must be inside `setup` at once: init_process_group waits for all of them.
        infos = ray.get([
            a.setup.remote(master, str(target), num_blocks, block_size, dtype, hidden_layers)
            for a in actors
        ])
    except BaseException:
        _kill(actors, pg)
        raise
    group = TargetGroup(actors, infos[0], pg, max_model_len=max_model_len)
    group.rebuild = functools.partial(
        _rebuild_target_group, target=target, num_blocks=num_blocks, block_size=block_size,
        dtype=dtype, hidden_layers=hidden_layers, max_model_len=max_model_len,
        omp_threads=omp_threads,
    )
    return group


def _rebuild_target_group(old: TargetGroup, *, target: Path, num_blocks: int, block_size: int,
                          dtype: torch.dtype, hidden_layers: tuple[int, ...],
                          max_model_len: int | None, omp_threads: int) -> TargetGroup:
    """Kill what is left of `old` and start a fresh group of the same shape (no requests)."""
    tp = old.tp
    _kill(old.actors, old.placement_group)
    _await_free_names([target_actor_name(i) for i in range(tp)])
    started = _start_target_ranks(target, tp, omp_threads)
    return _join_target_ranks(started, target, num_blocks, block_size, dtype, hidden_layers,
                              max_model_len, omp_threads)


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _env(omp_threads: int) -> dict[str, Any]:
    return {"env_vars": {"OMP_NUM_THREADS": str(omp_threads)}}


def _reserve(bundles: list[dict[str, float]], strategy: str) -> Any:
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group(bundles, strategy=strategy)
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=_PG_TIMEOUT_S)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"could not reserve {bundles} ({strategy}) within {_PG_TIMEOUT_S:.0f}s; "
            f"cluster resources: {ray.cluster_resources()}"
        )
    return pg


def _in_bundle(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def _kill(actors: list[Any], pg: Any) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for a in actors:
        ray.kill(a, no_restart=True)
    if pg is not None:
        remove_placement_group(pg)


def _await_free_names(names: list[str], timeout: float = 30.0) -> None:
    """Wait until no live actor holds these names: a killed actor's name is free only once the
    GCS has seen it die."""
    import ray

    deadline = time.monotonic() + timeout
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.05)


def shutdown(workers: tuple[TargetGroup | None, DraftPool | None] | None = None,
             stop_ray: bool = False) -> None:
    """Kill the pools' actors, free their placement groups and names; optionally stop Ray."""
    loaded = sys.modules.get("ray")
    if loaded is None or not loaded.is_initialized():
        return
    import ray

    names = []
    for part in workers or ():
        if part is None:
            continue
        _kill(part.actors, part.placement_group)
        names += [target_actor_name(i) if isinstance(part, TargetGroup) else draft_actor_name(i)
                  for i in range(len(part.actors))]
    _await_free_names(names)
    if stop_ray:
        ray.shutdown()
