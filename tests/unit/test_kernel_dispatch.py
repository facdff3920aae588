"""The dispatch rule shared by every kernel (`dspark.kernels.dispatch`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dspark.kernels.dispatch import ENV_VAR, HAS_TRITON, next_power_of_2, use_triton
from dspark.kernels.paged_attention import ATTENTION_DTYPES


def test_cpu_tensors_use_the_reference_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(1)
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not use_triton(cpu)
    monkeypatch.setenv(ENV_VAR, "torch")
    assert not use_triton(cpu)
    monkeypatch.setenv(ENV_VAR, "triton")
    if HAS_TRITON:
        assert use_triton(cpu)
    else:
        with pytest.raises(RuntimeError, match="not installed"):
            use_triton(cpu)


def test_unknown_choice_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(ValueError, match=ENV_VAR):
        use_triton(torch.zeros(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert use_triton(torch.zeros(1, device="cuda")) == HAS_TRITON
    # A dtype the kernel does not take runs the reference (float64 attention on a GPU).
    f64 = torch.zeros(1, dtype=torch.float64, device="cuda")
    assert not use_triton(f64, (torch.float32,))
    assert use_triton(f64, (torch.float64,)) == HAS_TRITON


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (Linux x86-64)")
def test_a_forced_choice_ignores_the_kernels_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Forced, the kernel runs and its launcher's dtype check speaks (no silent reference).
    monkeypatch.setenv(ENV_VAR, "triton")
    assert use_triton(torch.zeros(1, dtype=torch.float64), ATTENTION_DTYPES)


def test_next_power_of_2() -> None:
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]


def test_importing_the_kernels_does_not_import_triton() -> None:
    """Triton fixes compiled-vs-interpreted at import, so dspark must leave that to first launch."""
    code = (
        "import sys, dspark.kernels.acceptance, dspark.kernels.paged_attention, "
        "dspark.kernels.budget, dspark.models.decoder; assert 'triton' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
