"""`python -m dspark.kernels.check`: the GPU check script, exercised without a GPU.

`--smoke` runs every code path (checks, ceilings, table, config sweep) at tiny shapes, here in
triton's CPU interpreter, so the script keeps working between the runs on real GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dspark.kernels import check
from dspark.kernels.dispatch import HAS_TRITON


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the full check would run")
def test_without_cuda_it_says_so_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert check.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (Linux x86-64)")
def test_smoke_run_passes_and_prints_the_table() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "dspark.kernels.check", "--smoke"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("  PASS  ") == 3 and "FAIL" not in out, out
    for op in ("verify attention", "acceptance", "kv write"):
        assert f"{op:<17}  triton" in out and f"{op:<17}  torch ref" in out, out
    assert "ceilings: copy bandwidth" in out and "BLOCK_N=128" in out
