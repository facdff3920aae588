"""Shared fixtures: tiny random checkpoints written by the tests, and the shipped demo pair."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# `python -m pytest` puts the repository root first on sys.path, and there the folder `kernels/`
# (installed as `dspark.kernels`) reads as a top-level package `kernels`, shadowing the Hub's
# `kernels` package that transformers >= 5.25 imports at start-up (ImportError: cannot import name
# 'CUDAProperties'). The project imports itself only as `dspark`, so the root is not needed here.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _ROOT]

import torch  # noqa: E402

# Triton decides at its first import whether to interpret; transformers imports it early through
# torch._dynamo, so the choice must be made before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

from dspark.demo import heldout_prompts_path  # noqa: E402
from dspark.training.prompts import load_prompts  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, drafter): random Qwen3 and Llama checkpoints; peaked logits (std 0.2)."""
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_checkpoint(root / "target", "qwen3", layers=2, seed=1, std=0.2)
    drafter = write_tiny_checkpoint(root / "drafter", "llama", layers=1, seed=2, std=0.2)
    return target, drafter


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from intra-op threads, and on a busy machine two OpenMP threads
    spin against each other (measured: ~9x slower); the setting is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    return load_prompts(heldout_prompts_path())
