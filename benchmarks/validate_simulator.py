"""Validate the fleet simulator against the real engine on this machine (issue 8).

One run, in this order:
1. load the demo models with `Engine()`'s defaults (demo target, draft-model proposer, `fixed`
   policy, k = 4) and profile the cost model *now* (coordinator/profiler.py), so the profile
   and the measurements share the machine's current load;
   The profile times 8-token verify blocks over a 256-token context; a prompt's prefill is one
   long request from position 0 and costs much less per token, so prefills of m prompts of
   the mean prompt length are timed too (`FleetConfig.prefill`);
2. calibrate the engine's per-step CPU overhead (scheduling, commit, Python) from held-out
   traces: 2 and 8 requests in flight on other prompts; per batch size the median of the
   measured step time minus the profile's verify + draft time (prefill steps left out), then a
   line through those medians: fixed + per request;
3. measure: 1, 4 and 16 requests in flight (closed batches of 3·N prompts, greedy, fixed
   output length), recording traces; tokens/s = output tokens / wall-clock of `generate`, the
   median of `--repeats` runs (the machine is shared: medians resist the other jobs);
4. simulate each measured workload from its trace (acceptance and lengths replayed) with the
   profile and the calibrated overhead, and print predicted against measured.

Writes docs/img/sim_validation.json and .png (and the traces under runs/validate_simulator).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_simulator.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark.coordinator.cost_model import CostModel  # noqa: E402
from dspark.coordinator.engine import Engine  # noqa: E402
from dspark.coordinator.profiler import profile, time_forward  # noqa: E402
from dspark.coordinator.sim.acceptance import TraceReplay  # noqa: E402
from dspark.coordinator.sim.fleet import FleetConfig, simulate  # noqa: E402
from dspark.coordinator.sim.report import summarize  # noqa: E402
from dspark.coordinator.sim.workload import Workload  # noqa: E402
from dspark.coordinator.trace import Trace, TraceRecorder  # noqa: E402
from dspark.demo import heldout_prompts_path  # noqa: E402
from dspark.sampling_params import SamplingParams  # noqa: E402
from dspark.training.prompts import load_prompts  # noqa: E402

logger = logging.getLogger("validate_simulator")
K = 4  # Engine()'s default k


def run_engine(engine: Engine, prompts: list[str], in_flight: int, max_tokens: int,
               path: Path) -> tuple[float, Trace]:
    """Tokens/s of `generate` with `in_flight` requests at a time, and its trace."""
    rec = TraceRecorder(meta={"in_flight": in_flight, "proposer": "draft-model", "policy": "fixed",
                              "k": K, "max_tokens": max_tokens})
    engine.trace = rec
    engine.max_num_seqs = in_flight
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    engine.trace = None
    rec.save(path)
    return sum(len(o.token_ids) for o in outs) / seconds, rec.trace()


def compute_time(cost: CostModel, step) -> float:  # noqa: ANN001
    """The profile's share of a traced step: verify of B tokens + sequential draft forwards."""
    positions = max(step.drafted, default=0)
    return cost.verify_time(step.num_tokens) + cost.draft_time(len(step.req_ids), positions)


def fit_overhead(cost: CostModel, traces: list[Trace]) -> tuple[float, float]:
    """(fixed, per request) seconds per step: a line through the per-batch-size medians of
    measured − profiled time over decode steps (no prefill in them)."""
    by_size: dict[int, list[float]] = {}
    for tr in traces:
        for s in tr.steps:
            if not any(s.new):
                by_size.setdefault(len(s.req_ids), []).append(s.seconds - compute_time(cost, s))
    sizes = sorted(by_size)
    rows = np.array([(1.0, n) for n in sizes])
    medians = np.array([float(np.median(by_size[n])) for n in sizes])
    coef, *_ = np.linalg.lstsq(rows, medians, rcond=None)
    return max(0.0, float(coef[0])), max(0.0, float(coef[1]))


def profile_prefill(engine: Engine, cost: CostModel, prompt_len: int,
                    counts: tuple[int, ...] = (1, 2, 4, 8, 16)) -> tuple[tuple[int, float], ...]:
    """(prompt tokens beyond the first of each, extra seconds) for m prompts of `prompt_len`."""
    points = []
    for m in counts:
        t = time_forward(engine.target.model, [prompt_len] * m, 0, repeats=3)
        points.append((m * (prompt_len - 1), max(0.0, t - cost.verify_time(m))))
    return tuple(points)


def predict(trace: Trace, cost: CostModel, in_flight: int, overhead: tuple[float, float],
            prefill: tuple[tuple[int, float], ...]) -> dict:
    n = len(trace.requests())
    cfg = FleetConfig(cost=cost, policy="fixed", gamma=K, replicas=1, max_num_seqs=in_flight,
                      sequential_drafts=True, confidence_head=False, overhead_s=overhead[0],
                      overhead_per_req_s=overhead[1], prefill=prefill, progress=False)
    res = simulate(cfg, Workload(kind="batch", num_requests=n), TraceReplay(trace, K),
                   trace=trace)
    return summarize(res)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--in-flight", default="1,4,16")
    ap.add_argument("--per-slot", type=int, default=3, help="requests per in-flight slot")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per setting (median)")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--runs", default="runs/validate_simulator")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    runs = Path(a.runs)
    prompts = load_prompts(heldout_prompts_path())
    engine = Engine()  # demo target, draft-model proposer, fixed k = 4
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    t0 = time.perf_counter()
    cost = profile(engine.target.model, engine.proposer.model, b_max=160, n_max=16, repeats=5)
    cost.save(runs / "cost_model.json")
    lens = [len(engine.tokenizer.encode(p)) for p in prompts[:48]]
    prefill = profile_prefill(engine, cost, int(round(float(np.mean(lens)))))
    logger.info("profiled in %.0f s; prefill points %s", time.perf_counter() - t0,
                [(p, round(t * 1e3, 1)) for p, t in prefill])

    # Held-out calibration of the per-step overhead: other prompts, other concurrencies.
    calib = [run_engine(engine, prompts[100 + 20 * i: 100 + 20 * i + 2 * n], n, a.max_tokens,
                        runs / f"calib_{n}.trace.jsonl")[1] for i, n in enumerate((2, 8))]
    overhead = fit_overhead(cost, calib)
    logger.info("overhead: %.2f ms per step + %.3f ms per request", overhead[0] * 1e3,
                overhead[1] * 1e3)

    rows = []
    for n in (int(x) for x in a.in_flight.split(",")):
        runs_n = sorted((run_engine(engine, prompts[: a.per_slot * n], n, a.max_tokens,
                                    runs / f"measure_{n}_{i}.trace.jsonl") for i in range(a.repeats)),
                        key=lambda mt: mt[0])
        measured, trace = runs_n[len(runs_n) // 2]
        raw = predict(trace, cost, n, (0.0, 0.0), prefill)["throughput_tok_s"]
        pred = predict(trace, cost, n, overhead, prefill)
        rows.append({"in_flight": n, "measured_tok_s": measured,
                     "measured_runs_tok_s": [mt[0] for mt in runs_n],
                     "predicted_tok_s": pred["throughput_tok_s"],
                     "predicted_without_overhead_tok_s": raw,
                     "error": pred["throughput_tok_s"] / measured - 1,
                     "trace_busy_tok_s": trace.tokens_per_second(),
                     "steps_measured": len(trace.steps), "steps_simulated": pred["steps"]})
    _print(rows, overhead)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_validation.json").write_text(json.dumps({
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_simulator.py",
        "engine": "Engine() defaults: demo target, draft-model, fixed k=4; greedy, ignore_eos",
        "max_tokens": a.max_tokens, "cost_model": str(runs / "cost_model.json"),
        "overhead_s": {"per_step": overhead[0], "per_request": overhead[1]},
        "prefill_points": prefill,
        "rows": rows}, indent=1) + "\n")
    _plot(rows, out / "sim_validation.png")
    print(f"wrote {out / 'sim_validation.json'} and {out / 'sim_validation.png'}")
    return 0


def _print(rows: list[dict], overhead: tuple[float, float]) -> None:
    print(f"\noverhead (held-out calibration): {overhead[0] * 1e3:.2f} ms/step + "
          f"{overhead[1] * 1e3:.3f} ms/request")
    print(f"{'in flight':>9} {'measured':>9} {'predicted':>10} {'error':>7} {'no-overhead':>12}")
    for r in rows:
        print(f"{r['in_flight']:>9} {r['measured_tok_s']:>9.1f} {r['predicted_tok_s']:>10.1f} "
              f"{r['error']:>+7.1%} {r['predicted_without_overhead_tok_s']:>12.1f}")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    x = np.arange(len(rows))
    ax.bar(x - 0.27, [r["measured_tok_s"] for r in rows], 0.27, label="measured (engine)")
    ax.bar(x, [r["predicted_tok_s"] for r in rows], 0.27, label="simulated")
    ax.bar(x + 0.27, [r["predicted_without_overhead_tok_s"] for r in rows], 0.27,
           label="simulated, no CPU overhead")
    ax.set_xticks(x, [str(r["in_flight"]) for r in rows])
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("output tokens/s")
    ax.set_title("simulator vs engine (demo models, CPU, 1 thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
