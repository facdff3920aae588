"""What the Ray pools cost: the same workload in-process and over the worker pools, side by side.

    python benchmarks/ray_transport.py --num-prompts 4 --max-tokens 64 --rounds 6

Arms: the in-process engine and an engine over Ray workers (a tp = 1 target group and
`--draft-actors` DSpark draft actors on a local Ray instance), each with the policies `off` and
`confidence`: the demo models, greedy (or `--temperature`: sampled drafts carry their q,
[requests, γ, vocab] float64, to the coordinator and on to the target). Each round runs every
arm once on the same prompts, in turn, so the machine's load changes hit all arms alike; per
arm the median over rounds is reported, and each Ray arm's tokens a second over its in-process
pair's, per round (median and range). A step of a Ray arm splits into: the workers' own time
(inside their calls: the draft actors' busiest one and rank 0), the transport (the rest of the
time the coordinator spent in those calls: serialising, Ray's hand-offs, waiting to be
scheduled), and the coordinator's own work. Writes a table, JSON and a PNG of that split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.coordinator.engine import Engine
from dspark.coordinator.ray_workers import build_ray_workers, shutdown
from dspark.demo import heldout_prompts_path
from dspark.sampling_params import SamplingParams
from dspark.training.prompts import load_prompts

POLICIES = "off,confidence"  # `fixed` verifies `--k` drafts a step


def _worker_seconds(workers: tuple) -> tuple[float, float, float, float]:
    """(draft-call wall, busiest draft actor, verify-call wall, rank 0) seconds so far."""
    target, pool = workers
    return (pool.timing["propose_seconds"], max(b["seconds"] for b in pool.busy()),
            target.timing["verify_seconds"], target.busy()[0]["seconds"])


def run_arm(engine: Engine, prompts: list[str], params: SamplingParams,
            workers: tuple | None) -> dict:
    steps0, busy0 = engine.stats.steps, engine.stats.busy_seconds
    parts0 = _worker_seconds(workers) if workers else None
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = engine.stats.steps - steps0
    row = {"tok_s": sum(len(o.token_ids) for o in outs) / wall, "steps": steps,
           "ms_per_step": 1e3 * (engine.stats.busy_seconds - busy0) / steps,
           "tokens": [o.token_ids for o in outs]}
    if parts0 is not None:
        d = [(b - a) * 1e3 / steps for a, b in zip(parts0, _worker_seconds(workers), strict=True)]
        row |= {"draft_call_ms": d[0], "draft_worker_ms": d[1], "verify_call_ms": d[2],
                "verify_worker_ms": d[3]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--draft-actors", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--policies", default=POLICIES, help="comma-separated: off, fixed, confidence")
    ap.add_argument("--k", type=int, default=7, help="ℓ for `fixed`, γ for `confidence`")
    ap.add_argument("--out", default="runs/ray_transport")
    a = ap.parse_args()
    torch.set_num_threads(1)  # as each actor runs: the arms compare like with like
    prompts = load_prompts(heldout_prompts_path(), a.num_prompts)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)
    workers = build_ray_workers(num_draft_actors=a.draft_actors)
    try:
        arms = {}
        for policy in a.policies.split(","):
            arms[f"in-process {policy}"] = (Engine(policy=policy, k=a.k), None)
            arms[f"ray {policy}"] = (Engine(policy=policy, k=a.k, workers=workers), workers)
        warm = SamplingParams(temperature=a.temperature, max_tokens=16)
        for engine, _ in arms.values():
            engine.generate(prompts, warm)  # each scheduler learns its step costs first
        runs: dict[str, list[dict]] = {name: [] for name in arms}
        for _ in tqdm(range(a.rounds), desc="rounds", unit="round"):
            for name, (engine, w) in arms.items():
                runs[name].append(run_arm(engine, prompts, params, w))
    finally:
        shutdown(workers, stop_ray=True)
    if a.temperature == 0:  # greedy: every arm's tokens are the target's
        reference = runs["in-process off"][0]["tokens"]
        assert all(r["tokens"] == reference for rs in runs.values() for r in rs), "outputs differ"
    summary = _summarise(runs)
    _print(summary, a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"args": vars(a), "arms": summary}
    (out / "ray_transport.json").write_text(json.dumps(record, indent=1))
    _plot(summary, out / "ray_transport.png")
    print(f"wrote {out / 'ray_transport.json'} and {out / 'ray_transport.png'}")


def _summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    summary = {}
    for name, rs in runs.items():
        keys = [k for k in rs[0] if k != "tokens"]
        s = {k: statistics.median(r[k] for r in rs) for k in keys}
        if name.startswith("ray"):
            pair = runs[name.replace("ray", "in-process")]
            ratios = [r["tok_s"] / p["tok_s"] for r, p in zip(rs, pair, strict=True)]
            s |= {"x_in_process": statistics.median(ratios), "x_range": [min(ratios), max(ratios)]}
            s["transport_ms"] = (s["draft_call_ms"] - s["draft_worker_ms"]
                                 + s["verify_call_ms"] - s["verify_worker_ms"])
        summary[name] = s
    return summary


def _print(summary: dict[str, dict], a: argparse.Namespace) -> None:
    print(f"\n{a.num_prompts} requests in flight, T = {a.temperature:g}, {a.max_tokens} tokens, "
          f"{a.rounds} rounds, {a.draft_actors} draft actors (medians)")
    print("ms per step; calls: the coordinator's wall time in them, workers: inside them")
    print(f"{'arm':<22}{'tok/s':>7}{'ms/step':>9}{'x in-process':>20}{'draft call':>12}"
          f"{'worker':>8}{'verify call':>13}{'worker':>8}{'transport':>11}")
    for name, s in summary.items():
        line = f"{name:<22}{s['tok_s']:>7.0f}{s['ms_per_step']:>9.2f}"
        if "x_in_process" in s:
            lo, hi = s["x_range"]
            line += (f"{s['x_in_process']:.2f} ({lo:.2f}-{hi:.2f})".rjust(20)
                     + f"{s['draft_call_ms']:>12.2f}{s['draft_worker_ms']:>8.2f}"
                     f"{s['verify_call_ms']:>13.2f}{s['verify_worker_ms']:>8.2f}"
                     f"{s['transport_ms']:>11.2f}")
        print(line)


def _plot(summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in summary if n.startswith("ray")]
    parts = {
        "draft worker": [summary[n]["draft_worker_ms"] for n in names],
        "verify worker (rank 0)": [summary[n]["verify_worker_ms"] for n in names],
        "transport": [summary[n]["transport_ms"] for n in names],
    }
    rest = [summary[n]["ms_per_step"] - sum(p[i] for p in parts.values())
            for i, n in enumerate(names)]
    parts["coordinator"] = rest
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = [0.0] * len(names)
    for label, vals in parts.items():
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, n in enumerate(names):
        ref = summary[n.replace("ray", "in-process")]["ms_per_step"]
        ax.hlines(ref, i - 0.4, i + 0.4, colors="k", linestyles="dashed")
    ax.set_ylabel("ms per step (dashed: in-process)")
    ax.set_title("Where a step over Ray goes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
