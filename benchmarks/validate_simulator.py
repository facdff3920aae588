"""Validate the fleet simulator against the real engine on this machine (issue 8).

One run (a few minutes):
1. load the demo models (demo target, draft-model proposer, `fixed`
   policy, k = 4);
2. calibrate the engine's CPU overhead per request and step (scheduling, commit, the drafter's
   Python loop): 2 and 8 requests in flight on other prompts (held out from step 3); the CPU
   seconds beyond what the simulator predicts without overhead, per request-step;
3. measure 1, 4 and 16 requests in flight: closed batches of 3·N prompts, greedy, fixed output
   length, the median of `--repeats` runs, recording traces. Right after each setting, profile
   the cost model (coordinator/profiler.py's `time_forward`) on exactly the verify shapes and
   draft batch sizes the trace ran, plus prefills of m prompts of the mean prompt length (a
   prompt is one long request from position 0, much cheaper per token than verify blocks over a
   full context: `FleetConfig.prefill`);
4. simulate each measured workload from its trace (acceptance and lengths replayed) with that
   profile and the calibrated overhead; print predicted against measured.

Clock: tokens per CPU second of this 1-thread process, profile and engine alike (see
`cpu_clock`): on the shared 2-core machine other jobs stretch wall-clock time by up to 2x at
random moments. Wall-clock tokens/s of every run are printed and stored beside them.

Writes docs/img/sim_validation.json and .png (and the traces under runs/validate_simulator).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_simulator.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark.coordinator import profiler  # noqa: E402
from dspark.coordinator.cost_model import CostModel, hardware_key, monotone  # noqa: E402
from dspark.coordinator.engine import Engine  # noqa: E402
from dspark.coordinator.profiler import time_forward  # noqa: E402
from dspark.coordinator.sim.acceptance import TraceReplay  # noqa: E402
from dspark.coordinator.sim.fleet import FleetConfig, simulate  # noqa: E402
from dspark.coordinator.sim.report import summarize  # noqa: E402
from dspark.coordinator.sim.workload import Workload  # noqa: E402
from dspark.coordinator.trace import Trace, TraceRecorder  # noqa: E402
from dspark.demo import heldout_prompts_path  # noqa: E402
from dspark.sampling_params import SamplingParams  # noqa: E402
from dspark.training.prompts import load_prompts  # noqa: E402

logger = logging.getLogger("validate_simulator")
K = 4  # drafts per request (fixed)


@contextmanager
def cpu_clock() -> Iterator[None]:
    """Profile in this process's CPU time instead of wall-clock time.

    The machine has 2 cores shared with other jobs; they stretch a 1-thread process's wall-clock
    time by up to 2x, at random moments, but hardly its CPU time (which on an idle machine *is*
    its wall-clock time). Profile and measurement then see the same machine.
    """
    saved = profiler.median_time
    profiler.median_time = _cpu_median_time
    try:
        yield
    finally:
        profiler.median_time = saved


def _cpu_median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def run_engine(engine: Engine, prompts: list[str], in_flight: int, max_tokens: int,
               path: Path) -> tuple[float, float, Trace]:
    """(tokens per CPU second, tokens per wall-clock second) of `generate` with `in_flight`
    requests at a time, and its trace."""
    rec = TraceRecorder(meta={"in_flight": in_flight, "proposer": "draft-model", "policy": "fixed",
                              "k": K, "max_tokens": max_tokens})
    engine.trace = rec
    engine.max_num_seqs = in_flight
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    engine.trace = None
    rec.save(path)
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / cpu, tokens / seconds, rec.trace()


def compute_time(cost: CostModel, step) -> float:  # noqa: ANN001
    """The profile's share of a traced step: verify of B tokens + sequential draft forwards."""
    positions = max(step.drafted, default=0)
    return cost.verify_time(step.num_tokens) + cost.draft_time(len(step.req_ids), positions)


def fit_overhead(calib: list[tuple[float, Trace, CostModel, tuple]]) -> tuple[float, float]:
    """(0, per request) seconds per step: the engine's CPU seconds beyond what the simulator
    predicts without overhead, per request-step, over the calibration runs."""
    extra, request_steps = 0.0, 0
    for cpu_tok_s, trace, cost, prefill in calib:
        tokens = sum(sum(s.committed) for s in trace.steps)
        in_flight = int(trace.meta["in_flight"])
        simulated = predict(trace, cost, in_flight, (0.0, 0.0), prefill)["throughput_tok_s"]
        predicted = tokens / simulated
        extra += tokens / cpu_tok_s - predicted
        request_steps += sum(len(s.req_ids) for s in trace.steps)
    return 0.0, max(0.0, extra / request_steps)


def profile_prefill(engine: Engine, cost: CostModel, prompt_len: int,
                    counts: tuple[int, ...]) -> tuple[tuple[int, float], ...]:
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


def local_profile(engine: Engine, traces: list[Trace], decoded: int, repeats: int = 5
                  ) -> tuple[CostModel, tuple[tuple[int, float], ...]]:
    """The cost model (and prefill points) of exactly the shapes these traces ran, timed now.

    Every distinct decode verify size B is timed with the batch's own per-request token counts;
    the drafter over 1..max requests; other sizes are interpolated, then made monotone. Timing
    right after the measured runs puts profile and measurement under the same machine load.
    """
    shapes: dict[int, list[int]] = {}
    sizes, prompt_lens = set(), []
    for tr in traces:
        for s in tr.steps:
            sizes.add(len(s.req_ids))
            if any(s.new):
                rows = zip(s.num_input, s.planned, s.new, strict=True)
                prompt_lens += [n - ell for n, ell, new in rows if new]
            else:
                shapes.setdefault(s.num_tokens, list(s.num_input))
    target, drafter = engine.target.model, engine.proposer.model
    context = int(np.mean(prompt_lens) + decoded)  # the traced requests' mean KV length
    bs = sorted(shapes)
    vt = [time_forward(target, shapes[b], context, repeats) for b in bs]
    n_max = max(sizes)
    ns = sorted({1, 2, 4, n_max} | {n for n in sizes if n <= 4})
    dt = [time_forward(drafter, [1] * n, context, repeats) for n in ns]
    b_max = max(bs) + 8
    verify = monotone(list(np.interp(np.arange(1, b_max + 1), bs, vt)))
    draft = monotone(list(np.interp(np.arange(1, n_max + 1), ns, dt)))
    cost = CostModel(f"local-{hardware_key()}", verify, draft, {"context": str(context)})
    counts = tuple(m for m in (1, 2, 4, 8, 16) if m <= n_max)
    return cost, profile_prefill(engine, cost, int(round(float(np.mean(prompt_lens)))), counts)


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
    engine = Engine(proposer="draft-model", policy="fixed", k=K)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8))  # warm-up

    # Held-out calibration of the per-step overhead: other prompts, other concurrencies.
    calib = []
    for i, n in enumerate((2, 8)):
        cpu_tok_s, _, trace = run_engine(engine, prompts[100 + 20 * i: 100 + 20 * i + 2 * n], n,
                                         a.max_tokens, runs / f"calib_{n}.trace.jsonl")
        with cpu_clock():
            calib.append((cpu_tok_s, trace, *local_profile(engine, [trace], a.max_tokens // 2)))
    overhead = fit_overhead(calib)
    logger.info("overhead: %.2f ms per step + %.3f ms per request", overhead[0] * 1e3,
                overhead[1] * 1e3)

    rows = []
    for n in (int(x) for x in a.in_flight.split(",")):
        runs_n = sorted((run_engine(engine, prompts[: a.per_slot * n], n, a.max_tokens,
                                    runs / f"measure_{n}_{i}.trace.jsonl")
                         for i in range(a.repeats)), key=lambda mt: mt[0])
        measured, wall, trace = runs_n[len(runs_n) // 2]
        t0 = time.perf_counter()
        with cpu_clock():
            cost, prefill = local_profile(engine, [trace], a.max_tokens // 2)
        cost.save(runs / f"cost_model_{n}.json")
        logger.info("profiled %d in flight in %.0f s", n, time.perf_counter() - t0)
        raw = predict(trace, cost, n, (0.0, 0.0), prefill)["throughput_tok_s"]
        pred = predict(trace, cost, n, overhead, prefill)
        rows.append({"in_flight": n, "measured_tok_s": measured,
                     "measured_runs_tok_s": [mt[0] for mt in runs_n],
                     "measured_wall_tok_s": wall,
                     "measured_wall_runs_tok_s": sorted(mt[1] for mt in runs_n),
                     "predicted_tok_s": pred["throughput_tok_s"],
                     "predicted_without_overhead_tok_s": raw,
                     "error": pred["throughput_tok_s"] / measured - 1,
                     "trace_busy_tok_s": trace.tokens_per_second(),
                     "steps_measured": len(trace.steps), "steps_simulated": pred["steps"],
                     "prefill_points": prefill})
    _print(rows, overhead)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_validation.json").write_text(json.dumps({
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/validate_simulator.py",
        "engine": "demo target, draft-model, fixed k=4; greedy, ignore_eos",
        "max_tokens": a.max_tokens,
        "cost_models": str(runs / "cost_model_<in flight>.json"),
        "overhead_s": {"per_step": overhead[0], "per_request": overhead[1]},
        "rows": rows}, indent=1) + "\n")
    _plot(rows, out / "sim_validation.png")
    print(f"wrote {out / 'sim_validation.json'} and {out / 'sim_validation.png'}")
    return 0


def _print(rows: list[dict], overhead: tuple[float, float]) -> None:
    print(f"\noverhead (held-out calibration): {overhead[1] * 1e3:.3f} ms per request per step")
    print("tokens/s per CPU second (wall-clock in brackets: the shared machine's noise)")
    print(f"{'in flight':>9} {'measured':>9} {'predicted':>10} {'error':>7} {'no-overhead':>12}"
          f"  {'wall-clock runs':<24}")
    for r in rows:
        walls = ", ".join(f"{w:.0f}" for w in r["measured_wall_runs_tok_s"])
        print(f"{r['in_flight']:>9} {r['measured_tok_s']:>9.1f} {r['predicted_tok_s']:>10.1f} "
              f"{r['error']:>+7.1%} {r['predicted_without_overhead_tok_s']:>12.1f}  [{walls}]")


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    x = np.arange(len(rows))
    ax.bar(x - 0.27, [r["measured_tok_s"] for r in rows], 0.27, label="measured (engine, CPU time)")
    ax.bar(x, [r["predicted_tok_s"] for r in rows], 0.27, label="simulated")
    ax.bar(x + 0.27, [r["predicted_without_overhead_tok_s"] for r in rows], 0.27,
           label="simulated, no CPU overhead")
    ax.set_xticks(x, [str(r["in_flight"]) for r in rows])
    ax.set_xlabel("requests in flight")
    ax.set_ylabel("output tokens per CPU second")
    ax.set_title("simulator vs engine (demo models, CPU, 1 thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
