"""Where an in-process engine step goes, arms side by side: drafting, the target's pass,
acceptance, the policy.

    OMP_NUM_THREADS=1 python benchmarks/step_phases.py --arms 'fixed k=7,confidence' --concurrency 1

Runs the demo models in process on held-out prompts (`--concurrency` at a time, `--rounds`
closed batches of the policy benchmark's workload after its warm-up), every arm serving each
batch together in turns (`dspark.bench.interleaved_runs`, `stepwise_round`), and times each
phase of `Engine.step` by wrapping the methods it calls: the proposer's `propose`, the
target's `verify` (and, inside it, `_accept`, the acceptance step), the policy's verbs, the
acceptance tracker's, commit and the engine's own bookkeeping. Prints ms a step per phase and
arm, and the coordinator's own work (the step less drafting and the target's pass), and
writes the table as JSON. The wrappers add ~1 us a call.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import dspark.coordinator.engine as engine_module
from dspark.bench import interleaved_runs, policy_engines, warm_up
from dspark.coordinator.engine import Engine
from dspark.demo import heldout_prompts_path
from dspark.training.prompts import load_prompts

POLICY_VERBS = ("draft_lengths", "choose_budget", "plan_verification", "observe", "observe_time")


def instrument(engine: Engine, stepping: list[dict[str, float]]) -> dict[str, float]:
    """Wrap the step's phases in timers; returns the seconds each has taken so far. `commit`
    is called by name in `Engine.step`, one function for every engine: its wrapper
    (`time_commits`) books each call to the engine stepping, named in `stepping`."""
    seconds: dict[str, float] = defaultdict(float)

    def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
        return run

    targets = [
        (engine.proposer, "propose", "draft"),
        (engine.target, "verify", "verify"),
        (engine.target, "_accept", "verify: accept"),
        *[(engine.tracker, verb, f"tracker.{verb}") for verb in ("fill", "observe")],
        *[(engine, verb, f"engine.{verb}") for verb in ("_plan", "_record", "_rollback")],
        *[(engine.policy, verb, f"policy.{verb}") for verb in POLICY_VERBS],
    ]
    for obj, name, label in targets:
        setattr(obj, name, timed(label, getattr(obj, name)))
    step = timed("step", engine.step)

    def run_step() -> Any:
        stepping[:] = [seconds]  # whose step runs: `time_commits` books commit there
        return step()
    engine.step = run_step  # type: ignore[method-assign]
    return seconds


def time_commits(stepping: list[dict[str, float]]) -> None:
    """Wrap `engine.commit` (called by name in `Engine.step`) in a timer booked to the
    stepping engine's phases (`instrument`)."""
    fn = engine_module.commit

    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stepping[0]["commit"] += time.perf_counter() - start
    engine_module.commit = run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proposer", default="dspark", help="dspark, draft-model or ngram")
    ap.add_argument("--arms", default="off,confidence",
                    help="comma-separated arms of `dspark bench-policies`, e.g. "
                         "'fixed k=7,confidence'")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8,
                    help="closed batches, each served by every arm")
    ap.add_argument("--out", default="runs/step_phases.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    conc = a.concurrency
    try:
        engines = policy_engines(a.proposer, tuple(x.strip() for x in a.arms.split(",")), conc)
    except ValueError as e:
        ap.error(f"--arms: {e}")
    served = warm_up(engines, load_prompts(heldout_prompts_path()), (a.temperature,),
                     a.max_tokens, conc)
    stepping: list[dict[str, float]] = []
    seconds = {label: instrument(e, stepping) for label, e in engines.items()}
    time_commits(stepping)
    steps0 = {label: e.stats.steps for label, e in engines.items()}
    bar = tqdm(total=a.rounds * len(engines), desc="rounds", unit="run")
    interleaved_runs(engines, served, conc, a.temperature, a.max_tokens, a.rounds, bar.update)
    bar.close()
    table: dict[str, dict[str, float]] = {}
    for label, engine in engines.items():
        steps = engine.stats.steps - steps0[label]
        ms = {phase: 1e3 * s / steps for phase, s in seconds[label].items()}
        ms["coordinator (step - draft - verify)"] = (
            ms["step"] - ms.get("draft", 0.0) - ms["verify"])
        ms["steps"] = steps
        table[label] = ms
    print(f"{a.proposer}, {conc} in flight, T = {a.temperature}, {a.rounds} rounds: "
          "ms a step (steps: their number)")
    phases = sorted({p for ms in table.values() for p in ms} - {"steps"},
                    key=lambda p: -max(ms.get(p, 0.0) for ms in table.values()))
    print(f"  {'':38s}" + "".join(f"{label:>14s}" for label in table))
    for phase in ["steps", *phases]:
        print(f"  {phase:38s}" + "".join(f"{ms.get(phase, 0.0):14.3f}" for ms in table.values()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "ms_per_step": table}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
