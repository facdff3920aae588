"""`dspark simulate`: policies side by side across load, on a simulated fleet.

For every policy and every load value (concurrent users for a closed loop, requests/s for an
open one) one simulation runs; the table, `simulate.json` and `simulate.png` (throughput against
per-user speed, throughput and verified tokens against load) go to `--out`.

Example (a quick one):
    dspark simulate --gpu h100 --replicas 2 --policy off,fixed=3,confidence --load 64,256 \\
        --requests-per-user 2 --output-mean 64 --out runs/sim_quick
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from dspark.coordinator.sim.acceptance import PositionModel, TraceReplay
from dspark.coordinator.sim.fleet import DraftPool, FleetConfig, simulate
from dspark.coordinator.sim.hardware import GPUS, load_curve
from dspark.coordinator.sim.lane import SIM_POLICIES
from dspark.coordinator.sim.report import plot_load_curves, summarize, write_json
from dspark.coordinator.sim.workload import Workload
from dspark.coordinator.trace import read_trace

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", default="h100",
                   help=f"step-time curve: a GPU class ({', '.join(GPUS)}) or a profiled JSON")
    p.add_argument("--policy", default="off,fixed,equal,confidence,oracle",
                   help=f"comma-separated, from {', '.join(SIM_POLICIES)}; fixed=K for fixed "
                        "ℓ = K (plain `fixed`: ℓ = γ), e.g. off,fixed=1,fixed=3,confidence")
    p.add_argument("--gamma", type=int, default=7, help="block size γ (ℓ for fixed)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256, help="running requests per replica")
    p.add_argument("--workload", choices=["closed", "poisson", "bursty", "batch"], default="closed")
    p.add_argument("--load", default="64,256,1024",
                   help="comma-separated: users (closed, batch) or requests/s (poisson, bursty)")
    p.add_argument("--requests-per-user", type=float, default=3.0,
                   help="closed loop: requests simulated = this x users")
    p.add_argument("--num-requests", type=int, default=2000, help="open loop: requests simulated")
    p.add_argument("--prompt-mean", type=float, default=512)
    p.add_argument("--output-mean", type=float, default=256)
    p.add_argument("--trace", default=None,
                   help="replay acceptance and lengths from a trace (coordinator/trace.py)")
    p.add_argument("--head-noise", type=float, default=0.5,
                   help="σ of the confidence head's logit error (per-position model)")
    p.add_argument("--draft-model", action="store_true",
                   help="sequential draft model without a confidence head (default: DSpark "
                        "block drafter with a head)")
    p.add_argument("--draft-pool", type=int, default=0,
                   help="disaggregated draft pool with this many workers (0: colocated)")
    p.add_argument("--hop-ms", type=float, default=0.5, help="one-way network hop to the pool")
    p.add_argument("--lanes", type=int, default=0,
                   help="batch loops per replica (default: 2 with a pool, else 1)")
    p.add_argument("--overhead-ms", type=float, default=0.0, help="CPU time per step")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="prompt tokens admitted per step and replica lane (0: no limit)")
    p.add_argument("--duration", type=float, default=None, help="stop at this simulated time (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/simulate")
    p.add_argument("--name", default="simulate", help="file stem of the JSON and PNG in --out")


def configs(a: argparse.Namespace) -> tuple[list[tuple[str, str, int]], list[float]]:
    """([(label, policy, k)], loads): k is ℓ for `fixed` (`fixed=K`, else γ) and γ for the
    others."""
    arms = []
    for label in (x.strip() for x in a.policy.split(",")):
        if not label:
            continue
        name, _, k = label.partition("=")
        if name not in SIM_POLICIES:
            raise ValueError(f"policy={label!r}: choose from {list(SIM_POLICIES)}")
        if k and (name != "fixed" or not k.isdigit() or not 1 <= int(k) <= a.gamma):
            raise ValueError(f"policy={label!r}: only fixed takes =K, 1 <= K <= γ = {a.gamma}")
        arms.append((label, name, int(k) if k else a.gamma))
    return arms, [float(x) for x in a.load.split(",")]


def workload_for(a: argparse.Namespace, load: float) -> Workload:
    common = {"prompt_mean": a.prompt_mean, "output_mean": a.output_mean}
    if a.workload in ("closed", "batch"):
        users = int(load)
        n = max(users, int(round(users * a.requests_per_user)))
        return Workload(kind=a.workload, clients=users, num_requests=n, **common)
    return Workload(kind=a.workload, rate=load, num_requests=a.num_requests, **common)


def run(a: argparse.Namespace) -> dict[str, list[dict]]:
    arms, loads = configs(a)
    cost = load_curve(a.gpu, block_size=None if a.draft_model else a.gamma)
    pool = DraftPool(cost, a.draft_pool, a.hop_ms / 1e3) if a.draft_pool else None
    lanes = a.lanes or (2 if pool else 1)
    trace = read_trace(a.trace) if a.trace else None
    curves: dict[str, list[dict]] = {}
    cells = [(arm, load) for arm in arms for load in loads]
    for (label, policy, k), load in tqdm(cells, desc="simulate", unit="run"):
        cfg = FleetConfig(cost=cost, policy=policy, gamma=k, replicas=a.replicas,
                          max_num_seqs=a.max_num_seqs, lanes=lanes, pool=pool,
                          sequential_drafts=a.draft_model, confidence_head=not a.draft_model,
                          drafts_from_target=not a.draft_model,
                          overhead_s=a.overhead_ms / 1e3, duration_s=a.duration, seed=a.seed,
                          max_prefill_tokens=a.max_prefill_tokens or None,
                          progress=False)
        acc = (TraceReplay(trace, a.gamma, has_head=not a.draft_model) if trace is not None
               else PositionModel(gamma=a.gamma, sigma_head=a.head_noise,
                                  has_head=not a.draft_model))
        wl = workload_for(a, load)
        summary = summarize(simulate(cfg, wl, acc, trace=trace))
        curves.setdefault(label, []).append({"load": load, **summary})
    _print(curves)
    out = Path(a.out)
    meta = {k: v for k, v in vars(a).items() if k != "fn"}
    write_json({"args": meta, "cost_key": cost.key, "curves": curves,
                "workload": asdict(workload_for(a, loads[0]))}, out / f"{a.name}.json")
    pool_note = f", draft pool {a.draft_pool} x {a.hop_ms} ms hop" if a.draft_pool else ""
    plot_load_curves(curves, out / f"{a.name}.png",
                     title=f"{a.gpu}, {a.replicas} replicas, γ={a.gamma}, {a.workload}{pool_note}")
    print(f"wrote {out / (a.name + '.json')} and {out / (a.name + '.png')}")
    return curves


def _print(curves: dict[str, list[dict]]) -> None:
    print(f"\n{'policy':<16}{'load':>8}{'tok/s':>11}{'tok/s/user':>11}{'TTFT p50':>10}"
          f"{'TTFT p99':>10}{'TPOT p50':>10}{'ver/req':>8}{'tau':>6}")
    for policy, pts in curves.items():
        for p in pts:
            print(f"{policy:<16}{p['load']:>8g}{p['throughput_tok_s']:>11.0f}"
                  f"{p['per_user_tok_s']:>11.1f}{p['ttft_s']['p50'] * 1e3:>9.0f}m"
                  f"{p['ttft_s']['p99'] * 1e3:>9.0f}m{p['tpot_s']['p50'] * 1e3:>9.1f}m"
                  f"{p['verified_per_request_step']:>8.2f}{p['tau']:>6.2f}")


def main(a: argparse.Namespace) -> int:
    run(a)
    return 0
