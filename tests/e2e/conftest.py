"""The e2e tier: a real gRPC server on loopback in front of the demo models, and references.

The module fixture `service` starts the server (in-process engine: demo target, demo draft
model, fixed k = 4) and stops it after the module; `reference` is the same configuration's
in-process greedy output for the held-out prompts, computed once per session.
"""

from __future__ import annotations

import pytest

from dspark.config import ServeConfig
from dspark.coordinator.engine import Engine
from dspark.coordinator.request import GenerationResult
from dspark.coordinator.serve import Service, start_service
from dspark.sampling_params import SamplingParams

NUM_PROMPTS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=32)
ENGINE_KWARGS = dict(proposer="draft-model", policy="fixed", k=4, num_blocks=1024)


@pytest.fixture(scope="session")
def greedy() -> SamplingParams:
    """The sampling parameters of `reference`."""
    return GREEDY


@pytest.fixture(scope="session")
def engine_kwargs() -> dict:
    """The engine configuration of `service` and `reference`."""
    return dict(ENGINE_KWARGS)


@pytest.fixture(scope="session")
def prompts(heldout_prompts: list[str]) -> list[str]:
    return heldout_prompts[:NUM_PROMPTS]


@pytest.fixture(scope="session")
def reference(prompts: list[str]) -> list[GenerationResult]:
    """The in-process engine's greedy results for `prompts` (one batch)."""
    return Engine(**ENGINE_KWARGS).generate(prompts, GREEDY)


@pytest.fixture(scope="module")
def service() -> Service:
    cfg = ServeConfig(
        port=0,
        metrics_port=0,
        in_process=True,
        proposer="draft-model",
        policy="fixed",
        k=4,
        num_blocks=1024,
        grace=1.0,
    )
    svc = start_service(cfg, Engine(**ENGINE_KWARGS))
    yield svc
    svc.stop()
