"""The cost of the gRPC layer: the same workload in-process and through a loopback server.

    python benchmarks/grpc_overhead.py --num-prompts 32 --max-tokens 64 --repeats 3

Both arms run in this process on the demo target and draft model (greedy, fixed k = 4), each on
its own engine: `in-process` calls `Engine.generate` on the prompts; `grpc` sends the same
prompts through `AsyncClient` to a `Server` on 127.0.0.1. At concurrency N (all prompts in one
batch) and 1 (each request alone, so per-request costs - RPC set-up, hand-offs between the
event loop and the engine thread, chunk encoding - are not hidden by batching). The arms
alternate `--repeats` times and the best run of each is reported, since a shared machine's
load changes under a benchmark; CPU seconds of the whole process (every thread) are reported
beside wall time because they are less sensitive to that load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from dspark import AsyncClient
from dspark.coordinator.engine import Engine
from dspark.coordinator.metrics import ServeMetrics
from dspark.coordinator.server import Server
from dspark.demo import heldout_prompts_path
from dspark.sampling_params import SamplingParams
from dspark.training.prompts import load_prompts

ENGINE = dict(proposer="draft-model", policy="fixed", k=4)


def run_in_process(engine: Engine, prompts: list[str], params: SamplingParams) -> dict:
    steps0, busy0 = engine.stats.steps, engine.stats.busy_seconds
    wall0, cpu0 = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, params)
    return _measure(outs, wall0, cpu0, engine, steps0, busy0)


def run_grpc(
    server: Server, engine: Engine, prompts: list[str], params: SamplingParams, conc: int
) -> dict:
    async def run() -> dict:
        async with AsyncClient(server.address, timeout=600) as client:
            await client.model_info()  # channel set-up outside the timing
            gate = asyncio.Semaphore(conc)

            async def one(p: str):  # noqa: ANN202
                async with gate:
                    return await client.generate(p, params)

            steps0, busy0 = engine.stats.steps, engine.stats.busy_seconds
            wall0, cpu0 = time.perf_counter(), time.process_time()
            outs = await asyncio.gather(*(one(p) for p in prompts))
            return _measure(outs, wall0, cpu0, engine, steps0, busy0)

    return asyncio.run(run())


def _measure(
    outs: list, wall0: float, cpu0: float, engine: Engine, steps0: int, busy0: float
) -> dict:
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    # engine.stats is read after the run: between runs the loop thread is idle.
    steps, busy = engine.stats.steps - steps0, engine.stats.busy_seconds - busy0
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "cpu_ms_per_token": round(1000 * cpu / tokens, 3),
        "steps": steps,
        "step_ms": round(1000 * busy / max(1, steps), 2),
        "other_ms_per_step": round(1000 * (wall - busy) / max(1, steps), 2),
        "token_ids": [o.token_ids for o in outs],
    }


def bench(prompts: list[str], params: SamplingParams, conc: int, repeats: int) -> list[dict]:
    local = Engine(**ENGINE, max_num_seqs=conc)
    remote = Engine(**ENGINE, max_num_seqs=conc)
    local.generate(prompts[:2], params)  # warm-up both
    remote.generate(prompts[:2], params)
    best: dict[str, dict] = {}
    with Server(remote, metrics=ServeMetrics()) as server:
        for _ in range(repeats):
            for arm in ("in-process", "grpc"):
                row = (
                    run_in_process(local, prompts, params)
                    if arm == "in-process"
                    else run_grpc(server, remote, prompts, params, conc)
                )
                if arm not in best or row["wall_s"] < best[arm]["wall_s"]:
                    best[arm] = row
    assert best["grpc"]["token_ids"] == best["in-process"]["token_ids"], "gRPC output differs"
    return [{"arm": arm, "concurrency": conc, **row} for arm, row in best.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="runs/bench_grpc")
    a = ap.parse_args()
    prompts = load_prompts(heldout_prompts_path(), a.num_prompts)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    rows = bench(prompts, params, a.num_prompts, a.repeats) + bench(prompts, params, 1, a.repeats)
    for r in rows:
        r.pop("token_ids")
    head = (
        "arm",
        "conc",
        "tokens",
        "wall s",
        "tok/s",
        "cpu ms/tok",
        "steps",
        "step ms",
        "other ms/step",
    )
    keys = (
        "arm",
        "concurrency",
        "tokens",
        "wall_s",
        "tokens_per_s",
        "cpu_ms_per_token",
        "steps",
        "step_ms",
        "other_ms_per_step",
    )
    print(" ".join(f"{h:>13}" for h in head))
    for r in rows:
        print(" ".join(f"{r[k]!s:>13}" for k in keys))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grpc_overhead.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
