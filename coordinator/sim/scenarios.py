"""Scenario sweeps of docs/scale.md that compare fleet set-ups rather than policies over load.

- `disagg`: drafting colocated on each target GPU against a shared draft pool (1, 2, 4 workers
  for 2 replicas) behind a 0.1 / 1 / 3 ms network hop, for a sequential draft model (γ = 5, no
  head: drafting costs γ forwards) and the DSpark block drafter (γ = 7: one block forward, then
  a Markov-head step per further position);
- `oracle`: `confidence` against `oracle` as the head's error grows (σ of its logit error
  0, 0.5, 1, 2), at a moderate and a high load.

    python -m dspark.coordinator.sim.scenarios disagg --out docs/img
    python -m dspark.coordinator.sim.scenarios oracle --out docs/img
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tqdm import tqdm

from dspark.coordinator.sim.acceptance import PositionModel
from dspark.coordinator.sim.fleet import DraftPool, FleetConfig, simulate
from dspark.coordinator.sim.hardware import load_curve
from dspark.coordinator.sim.report import summarize, write_json
from dspark.coordinator.sim.workload import Workload

REPLICAS = 2
LOAD = 256  # users in a closed loop: 128 per replica
HOPS_MS = (0.1, 1.0, 3.0)
WORKERS = (1, 2, 4)
# The oracle's loads: at the first (32 per replica) the budget hardly binds; at the second (128
# per replica) it binds and still speculates (at 256 per replica both stop: nothing to compare)
ORACLE_USERS = (64, 256)


def _workload(users: int) -> Workload:
    return Workload(kind="closed", clients=users, num_requests=2 * users, prompt_mean=256,
                    output_mean=256)


def _run(gpu: str, draft_model: bool, gamma: int, policy: str, users: int,
         pool_workers: int = 0, hop_ms: float = 0.0, head_noise: float = 0.5) -> dict:
    cost = load_curve(gpu, block_size=None if draft_model else gamma)
    pool = DraftPool(cost, pool_workers, hop_ms / 1e3) if pool_workers else None
    cfg = FleetConfig(cost=cost, policy=policy, gamma=gamma, replicas=REPLICAS,
                      max_num_seqs=256, lanes=2 if pool else 1, pool=pool,
                      sequential_drafts=draft_model, confidence_head=not draft_model,
                      drafts_from_target=not draft_model,
                      duration_s=15.0, max_prefill_tokens=8192, progress=False)
    acc = PositionModel(gamma=gamma, sigma_head=head_noise, has_head=not draft_model)
    return summarize(simulate(cfg, _workload(users), acc))


def disagg(gpu: str, out: Path) -> dict:
    rows = []
    drafters = (("draft-model γ=5", True, 5), ("dspark γ=7", False, 7))
    cells = [(d, 0, 0.0) for d in drafters]
    cells += [(d, w, h) for d in drafters for w in WORKERS for h in HOPS_MS]
    for (label, dm, gamma), workers, hop in tqdm(cells, desc="disagg", unit="run"):
        s = _run(gpu, dm, gamma, "confidence", LOAD, workers, hop)
        rows.append({"drafter": label, "pool_workers": workers, "hop_ms": hop, **s})
    off = _run(gpu, False, 7, "off", LOAD)
    result = {"gpu": gpu, "replicas": REPLICAS, "users": LOAD, "policy": "confidence",
              "off": off, "rows": rows}
    write_json(result, out / "sim_disagg.json")
    _plot_disagg(result, out / "sim_disagg.png")
    return result


def oracle(gpu: str, out: Path) -> dict:
    rows = []
    cells = [(n, u, p) for n in (0.0, 0.5, 1.0, 2.0) for u in ORACLE_USERS
             for p in ("confidence", "oracle")]
    for noise, users, policy in tqdm(cells, desc="oracle", unit="run"):
        s = _run(gpu, False, 7, policy, users, head_noise=noise)
        rows.append({"head_noise": noise, "users": users, **s})
    result = {"gpu": gpu, "replicas": REPLICAS, "rows": rows}
    write_json(result, out / "sim_oracle.json")
    _plot_oracle(result, out / "sim_oracle.png")
    return result


def _plt():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_disagg(result: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, drafter in zip(axes, ("draft-model γ=5", "dspark γ=7"), strict=True):
        rows = [r for r in result["rows"] if r["drafter"] == drafter]
        colocated = next(r for r in rows if r["pool_workers"] == 0)
        for w in WORKERS:
            pts = [r for r in rows if r["pool_workers"] == w]
            ax.plot([r["hop_ms"] for r in pts], [r["throughput_tok_s"] for r in pts], "o-",
                    label=f"pool of {w} (2 lanes per replica)")
        ax.axhline(colocated["throughput_tok_s"], color="k", ls="--", label="colocated")
        ax.axhline(result["off"]["throughput_tok_s"], color="grey", ls=":", label="off")
        ax.set_xscale("log")
        ax.set_xlabel("one-way network hop (ms)")
        ax.set_title(drafter)
    axes[0].set_ylabel("total throughput (tok/s)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['gpu']}, {result['replicas']} replicas, {result['users']} users, "
                 "policy confidence", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_oracle(result: dict, path: Path) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for users in ORACLE_USERS:
        for policy, style in (("confidence", "o-"), ("oracle", "s--")):
            pts = [r for r in result["rows"] if r["users"] == users and r["policy"] == policy]
            noise = [r["head_noise"] for r in pts]
            per_slot = [r["expected_accepted_per_step"] / max(1e-9, r["mean_batch"]) for r in pts]
            axes[0].plot(noise, per_slot, style, label=f"{policy}, {users} users")
            axes[1].plot(noise, [r["throughput_tok_s"] for r in pts], style,
                         label=f"{policy}, {users} users")
    axes[0].set_ylabel("expected accepted drafts / request / step")
    axes[1].set_ylabel("total throughput (tok/s)")
    for ax in axes:
        ax.set_xlabel("confidence-head logit error σ")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=["disagg", "oracle"])
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--out", default="runs/scenarios")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(a.out)
    (disagg if a.scenario == "disagg" else oracle)(a.gpu, out)
    print(f"wrote {out / ('sim_' + a.scenario + '.json')} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
