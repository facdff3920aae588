"""The distributed tier: one real local Ray instance for the tier, loopback only, few CPUs.

Ray is started once (it takes seconds) and the tensor-parallel target group once per module
(its ranks load the demo target); draft pools are started per test. Actors and this process use
one intra-op thread each: the CI machine has two cores.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from dspark.coordinator.ray_workers import build_target_group, connect, shutdown
from dspark.demo import demo_path
from dspark.target_worker.actor import TargetGroup

NUM_BLOCKS = 512  # 8k tokens of KV per rank: the tests' batches need a few hundred blocks
LOGICAL_CPUS = 6  # placement bundles: 2 TP ranks + 2 draft actors + a fault test's group (cores shared)


@pytest.fixture(scope="package")
def ray_instance() -> Iterator[None]:
    """A local Ray instance on loopback (`connect(None)`), stopped after the tier."""
    import ray

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the raylet and so by every worker
    assert connect(None, num_cpus=LOGICAL_CPUS), "Ray was already running in the test process"
    yield
    ray.shutdown()
    torch.set_num_threads(threads)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = omp


@pytest.fixture(scope="module")
def target_tp2(ray_instance: None) -> Iterator[TargetGroup]:
    """The demo target split over two gloo ranks (`target-0`, `target-1`). Per module: a test
    that starts a group of its own (the same actor names) runs where this one is not up."""
    group = build_target_group(demo_path("target"), tp=2, num_blocks=NUM_BLOCKS)
    yield group
    shutdown((group, None))
