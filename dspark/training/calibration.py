"""Sequential temperature scaling (STS) of the DSpark confidence head (DSpark paper, §3; the
notes' §2).

The head's conditional scores c_k = σ(z_k) rank well but are over-confident; the scheduler needs
the magnitudes of the survivals a_k = c_1·…·c_k. STS fits one temperature per position, left to
right: T_k minimises the ECE of Π_{i≤k} σ(z_i / T_i) against the realised prefix acceptance
(x_1..x_k all accepted), with T_1..T_{k−1} already fixed. A temperature > 0 is monotone in z, so
the order within a position never changes.

Data: full γ-blocks drafted and verified offline on the held-out split (`block_eval`), sampled
at temperature 1 by default (the head's training label is the T = 1 acceptance rate). The first
half of the held-out token stream fits, the second half reports ECE before/after and AUROC.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from dspark.draft_worker.dspark_checkpoint import load_drafter, save_sts_temperatures
from dspark.models.checkpoint import load_model
from dspark.training.block_eval import BlockEval, eval_blocks
from dspark.training.lm_training import encode_corpus

NUM_BINS = 20  # equal-width bins, as DeepSpec's confidence evaluation
GRID = torch.logspace(-1.5, 1.5, 241).tolist()  # candidate temperatures 0.03 .. 30
TOLERANCE = 1e-3  # ECE differences below 0.1 percentage point count as ties


def ece(pred: torch.Tensor, label: torch.Tensor, num_bins: int = NUM_BINS) -> float:
    """Expected calibration error: Σ_bins (n_b / n)·|mean pred − mean label|. pred, label: [n]"""
    pred, label = pred.double().flatten(), label.double().flatten()
    bins = (pred * num_bins).long().clamp(0, num_bins - 1)
    count = torch.bincount(bins, minlength=num_bins).double()
    gap = torch.bincount(bins, weights=pred - label, minlength=num_bins).abs()
    return float(gap.sum() / count.sum().clamp(min=1))


def auroc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann–Whitney U, ties counted half); NaN with one class only."""
    score, label = score.double().flatten(), label.bool().flatten()
    pos, neg = int(label.sum()), int((~label).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = score.argsort()
    ranks = torch.empty_like(score)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    # Average ranks over ties.
    uniq, inverse = torch.unique(score, return_inverse=True)
    mean_rank = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    mean_rank /= torch.bincount(inverse, minlength=len(uniq)).double()
    u = mean_rank[inverse][label].sum() - pos * (pos + 1) / 2
    return float(u / (pos * neg))


def survivals(z: torch.Tensor, temps: list[float] | None = None) -> torch.Tensor:
    """a_k = Π_{i≤k} σ(z_i / T_i). z: [n, γ] -> [n, γ] float64"""
    t = (
        torch.ones(z.shape[1], dtype=torch.float64)
        if temps is None
        else torch.tensor(temps, dtype=torch.float64)
    )
    return torch.sigmoid(z.double() / t).cumprod(dim=1)


def fit_sts(
    z: torch.Tensor, accepted: torch.Tensor, grid: list[float] = GRID, tol: float = TOLERANCE
) -> list[float]:
    """Per-position temperatures, left to right, by grid search on the cumulative ECE.

    Among the temperatures within `tol` of the smallest ECE, the one nearest 1 (in log scale) is
    taken: late positions, whose survivals are mostly near 0, give a flat objective, and its
    noise alone must not pick an extreme temperature.
    """
    temps: list[float] = []
    prefix = torch.ones(z.shape[0], dtype=torch.float64)
    for k in range(z.shape[1]):
        label = accepted[:, k]
        errors = [ece(prefix * torch.sigmoid(z[:, k].double() / t), label) for t in grid]
        near = [i for i, e in enumerate(errors) if e <= min(errors) + tol]
        best = grid[min(near, key=lambda i: abs(math.log(grid[i])))]
        temps.append(float(best))
        prefix = prefix * torch.sigmoid(z[:, k].double() / best)
    return temps


def calibration_table(data: BlockEval, temps: list[float]) -> list[dict[str, float]]:
    """Per position: ECE of the survival before/after STS, AUROC, mean predicted and realised."""
    assert data.z is not None
    before, after = survivals(data.z), survivals(data.z, temps)
    rows = []
    for k in range(data.z.shape[1]):
        label = data.accepted[:, k]
        rows.append(
            {
                "position": k + 1,
                "temperature": temps[k],
                "ece_before": ece(before[:, k], label),
                "ece_after": ece(after[:, k], label),
                "auroc": auroc(after[:, k], label),
                "auroc_conditional": _conditional_auroc(data, k),
                "predicted": float(after[:, k].mean()),
                "realised": float(label.double().mean()),
            }
        )
    return rows


def _conditional_auroc(data: BlockEval, k: int) -> float:
    # The head's own task: does x_k survive, among blocks whose x_1..x_{k−1} were accepted?
    assert data.z is not None
    reached = torch.ones_like(data.accepted[:, 0]) if k == 0 else data.accepted[:, k - 1]
    return auroc(data.z[reached, k], data.accepted[reached, k])


def calibrate(
    drafter_dir: str | Path,
    target_dir: str | Path,
    *,
    num_windows: int = 768,
    anchors_per_window: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    plot: str | Path | None = None,
    write: bool = True,
) -> dict[str, Any]:
    """Fit STS for a drafter on held-out data, store it in its config.json, report the table."""
    target = load_model(target_dir).eval()
    drafter = load_drafter(drafter_dir, target_dir)
    drafter.set_sts_temperatures(None)  # fit on the raw head
    stream = encode_corpus(target_dir, held_out=True)
    half = len(stream) // 2
    kwargs = {
        "num_windows": num_windows,
        "anchors_per_window": anchors_per_window,
        "temperature": temperature,
    }
    fit = eval_blocks(target, drafter, stream[:half], seed=seed, **kwargs)
    held = eval_blocks(target, drafter, stream[half:], seed=seed + 1, **kwargs)
    if fit.z is None:
        raise ValueError(f"{drafter_dir}: the drafter has no confidence head")
    temps = fit_sts(fit.z, fit.accepted)
    table = calibration_table(held, temps)
    if write:
        save_sts_temperatures(drafter_dir, temps)
    report = {
        "temperatures": temps,
        "temperature_sampling": temperature,
        "fit_blocks": int(fit.accepted.shape[0]),
        "heldout_blocks": int(held.accepted.shape[0]),
        "tau_sampled": held.tau,
        "table": table,
    }
    (Path(drafter_dir) / "calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    if plot is not None:
        reliability_diagram(held, temps, Path(plot))
    return report


def print_table(report: dict[str, Any]) -> None:
    print(
        f"STS on {report['fit_blocks']} blocks, reported on {report['heldout_blocks']} other "
        f"held-out blocks (T={report['temperature_sampling']:g}, τ={report['tau_sampled']:.3f})"
    )
    print(
        f"{'pos':>3} {'T_k':>6} {'ECE before':>10} {'ECE after':>10} {'AUROC':>6} "
        f"{'AUROC|prefix':>12} {'pred a_k':>8} {'real a_k':>8}"
    )
    for r in report["table"]:
        print(
            f"{r['position']:>3} {r['temperature']:>6.3f} {100 * r['ece_before']:>9.2f}% "
            f"{100 * r['ece_after']:>9.2f}% {r['auroc']:>6.3f} {r['auroc_conditional']:>12.3f} "
            f"{r['predicted']:>8.3f} {r['realised']:>8.3f}"
        )


def reliability_diagram(data: BlockEval, temps: list[float], path: Path) -> None:
    """Per position: mean realised prefix acceptance against mean predicted survival, per bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assert data.z is not None
    gamma = data.z.shape[1]
    fig, axes = plt.subplots(1, gamma, figsize=(2.6 * gamma, 2.9), sharey=True)
    for k, ax in enumerate(axes):
        label = data.accepted[:, k].double()
        for name, pred, style in (
            ("raw", survivals(data.z)[:, k], "o--"),
            ("STS", survivals(data.z, temps)[:, k], "s-"),
        ):
            bins = (pred * NUM_BINS).long().clamp(0, NUM_BINS - 1)
            count = torch.bincount(bins, minlength=NUM_BINS).double()
            keep = count > 0
            mp = torch.bincount(bins, weights=pred, minlength=NUM_BINS)[keep] / count[keep]
            ml = torch.bincount(bins, weights=label, minlength=NUM_BINS)[keep] / count[keep]
            ax.plot(mp, ml, style, ms=3, lw=1, label=f"{name} ECE {100 * ece(pred, label):.1f}%")
        ax.plot([0, 1], [0, 1], color="grey", lw=0.6)
        ax.set_title(f"position {k + 1}", fontsize=9)
        ax.set_xlabel("predicted a_k", fontsize=8)
        ax.legend(fontsize=6, loc="upper left")
    axes[0].set_ylabel("realised prefix acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
