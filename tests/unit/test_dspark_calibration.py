"""Sequential temperature scaling (STS) of the DSpark confidence head.

Synthetic blocks with a known truth: the realised conditional acceptance at position k is
Bernoulli(σ(z_k / T*_k)) given the prefix was accepted, with T*_k > 1 (the raw head σ(z_k) is
over-confident, as the paper reports). STS fitted on one sample must keep the order within each
position, recover temperatures near T*, and lower the ECE of the survivals on a fresh sample.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import write_tiny_checkpoint

from dspark.draft_worker.dspark_checkpoint import (
    load_drafter,
    new_drafter,
    save_drafter,
    save_sts_temperatures,
)
from dspark.training.calibration import auroc, ece, fit_sts, survivals

GAMMA = 7
TRUE_T = [1.6, 1.9, 2.2, 2.5, 2.0, 1.5, 3.0]


def synthetic_blocks(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """z [n, γ] raw logits and accepted [n, γ] realised prefix acceptance."""
    gen = torch.Generator().manual_seed(seed)
    z = 1.5 + 2.5 * torch.randn(n, GAMMA, generator=gen, dtype=torch.float64)
    p = torch.sigmoid(z / torch.tensor(TRUE_T, dtype=torch.float64))
    ok = torch.rand(n, GAMMA, generator=gen, dtype=torch.float64) < p
    return z.float(), ok.to(torch.int32).cumprod(dim=1).bool()


def test_ece_and_auroc_on_known_cases() -> None:
    label = torch.tensor([0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
    assert ece(label.double(), label) == 0.0
    assert ece(torch.full((8,), 0.5, dtype=torch.float64), label) == pytest.approx(0.0)
    assert ece(torch.full((8,), 0.9, dtype=torch.float64), label) == pytest.approx(0.4)
    assert auroc(label.double(), label) == 1.0
    assert auroc(-label.double(), label) == 0.0
    assert auroc(torch.zeros(8), label) == pytest.approx(0.5)


def test_sts_keeps_order_and_lowers_heldout_ece() -> None:
    z_fit, acc_fit = synthetic_blocks(20000, seed=0)
    z_new, acc_new = synthetic_blocks(20000, seed=1)
    temps = fit_sts(z_fit, acc_fit)
    assert len(temps) == GAMMA
    # The first positions, where most blocks are still alive, identify their temperature well.
    for t, true in zip(temps[:3], TRUE_T[:3], strict=True):
        assert 0.75 * true < t < 1.3 * true, (temps, TRUE_T)
    before, after = survivals(z_new), survivals(z_new, temps)
    for k in range(GAMMA):
        # Order within a position is unchanged (σ(z/T) is increasing in z for T > 0) ...
        conditional_before = torch.sigmoid(z_new[:, k].double())
        conditional_after = torch.sigmoid(z_new[:, k].double() / temps[k])
        assert torch.equal(
            conditional_before.argsort(stable=True), conditional_after.argsort(stable=True)
        )
        # ... and the survivals' calibration error on fresh data drops well below the raw one.
        e_before, e_after = ece(before[:, k], acc_new[:, k]), ece(after[:, k], acc_new[:, k])
        assert e_after < 0.02 and e_after < 0.5 * e_before, (k, e_before, e_after)


def test_temperatures_are_stored_and_applied(tmp_path: Path) -> None:
    target = write_tiny_checkpoint(tmp_path / "target", "qwen3", layers=2, seed=1)
    save_drafter(
        new_drafter(target, block_size=GAMMA, target_layer_ids=[1], markov_rank=8),
        tmp_path / "drafter",
    )
    save_sts_temperatures(tmp_path / "drafter", TRUE_T)
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert raw["confidence_sts_temperatures"] == TRUE_T
    drafter = load_drafter(tmp_path / "drafter", target)
    z = torch.tensor([[2.0] * GAMMA])
    expected = torch.sigmoid(z / torch.tensor(TRUE_T))
    torch.testing.assert_close(drafter.calibrated(z), expected)
    with pytest.raises(ValueError, match="confidence_sts_temperatures"):
        save_sts_temperatures(tmp_path / "drafter", [1.0, -1.0])
