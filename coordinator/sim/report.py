"""What a simulation measured: throughput, latency percentiles, verified tokens, load curves.

Definitions (per run):
- throughput: tokens committed per second over the measuring window: the whole run for a
  `batch` workload (the engine's `generate` tokens/s); otherwise from `warmup` of the run to the
  last arrival (open loop) or the last request sent (closed loop), i.e. at steady load;
- TTFT: first committed token − arrival; TPOT (inter-token latency): (finish − first token) /
  (output − 1) per request; per-user speed: 1 / TPOT, the DSpark paper's tokens/s/user;
- verified tokens per request per step: Σ (1 + ℓ_r) / Σ R over steps (the paper's Fig. 8);
- τ: tokens committed per request per step; expected accepted: Σ of true survivals of the plan.

Example:
    >>> percentiles([1.0, 2.0, 3.0, 4.0])["p50"]
    2.5
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dspark.coordinator.sim.fleet import SimResult

PCTS = (50, 90, 99)


def percentiles(values: list[float] | np.ndarray) -> dict[str, float]:
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {f"p{p}": float("nan") for p in PCTS} | {"mean": float("nan")}
    return {f"p{p}": float(np.percentile(v, p)) for p in PCTS} | {"mean": float(v.mean())}


def window(res: SimResult, warmup: float) -> tuple[float, float]:
    """The measuring window [t0, t1] (see the module docstring)."""
    if res.workload.kind == "batch":
        return 0.0, res.end_time
    t1 = res.last_arrival if res.last_arrival > 0 else res.end_time
    return warmup * t1, t1


def summarize(res: SimResult, warmup: float = 0.2) -> dict[str, object]:
    """Headline numbers of one run, JSON-ready."""
    t0, t1 = window(res, warmup)
    tokens = sum(s.committed for s in res.steps if t0 < s.end <= t1)
    reqs = [r for r in res.requests if r.arrival >= t0] or res.requests
    ttft = [r.first_token - r.arrival for r in reqs]
    tpot = [(r.finish - r.first_token) / (r.output_len - 1) for r in reqs if r.output_len > 1]
    steps = [s for s in res.steps if t0 < s.end <= t1] or res.steps
    n_req_steps = sum(s.num_reqs for s in steps)
    cfg = res.config
    return {
        "policy": cfg.policy, "replicas": cfg.replicas, "gamma": cfg.gamma,
        "workload": res.workload.kind, "requests_finished": len(res.requests),
        "window_s": [round(t0, 4), round(t1, 4)],
        "throughput_tok_s": tokens / (t1 - t0) if t1 > t0 else 0.0,
        "throughput_per_replica_tok_s": tokens / (t1 - t0) / cfg.replicas if t1 > t0 else 0.0,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "per_user_tok_s": float(np.mean([1.0 / t for t in tpot if t > 0])) if tpot else 0.0,
        "verified_per_request_step": (sum(s.num_reqs + s.planned for s in steps) / n_req_steps
                                      if n_req_steps else 0.0),
        "tau": sum(s.committed for s in steps) / n_req_steps if n_req_steps else 0.0,
        "expected_accepted_per_step": float(np.mean([s.expected_accepted for s in steps]))
        if steps else 0.0,
        "accepted_per_step": float(np.mean([s.accepted for s in steps])) if steps else 0.0,
        "mean_batch": n_req_steps / len(steps) if steps else 0.0,
        "mean_verify_tokens": float(np.mean([s.num_tokens for s in steps])) if steps else 0.0,
        "steps": len(res.steps),
    }


def littles_law(res: SimResult, t0: float, t1: float) -> tuple[float, float]:
    """(L, λ·W) over [t0, t1]: time-average requests in the system, against arrival rate times
    mean time in system of the requests that arrived in the window (equal at steady state)."""
    inside = sum(max(0.0, min(r.finish, t1) - max(r.arrival, t0)) for r in res.requests)
    arrived = [r for r in res.requests if t0 <= r.arrival < t1]
    lam = len(arrived) / (t1 - t0)
    w = float(np.mean([r.finish - r.arrival for r in arrived]))
    return inside / (t1 - t0), lam * w


def write_json(obj: object, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")
    return path


def plot_load_curves(curves: dict[str, list[dict]], path: str | Path, title: str = "") -> Path:
    """The production-figure form: total throughput against per-user speed, one curve per
    policy over load; beside it, verified tokens per request per step against load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, pts in curves.items():
        loads = [p["load"] for p in pts]
        axes[0].plot([p["per_user_tok_s"] for p in pts], [p["throughput_tok_s"] for p in pts],
                     "o-", label=name)
        axes[1].plot(loads, [p["throughput_tok_s"] for p in pts], "o-", label=name)
        axes[2].plot(loads, [p["verified_per_request_step"] for p in pts], "o-", label=name)
    axes[0].set_xlabel("per-user speed (tok/s/user)")
    axes[0].set_ylabel("total throughput (tok/s)")
    axes[0].set_title("throughput vs per-user speed across load")
    for ax in axes[1:]:
        ax.set_xscale("log")
        ax.set_xlabel("concurrent requests")
    axes[1].set_ylabel("total throughput (tok/s)")
    axes[2].set_ylabel("verified tokens / request / step")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
