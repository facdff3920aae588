"""Where an in-process engine step goes: drafting, the target's pass, acceptance, the policy.

    OMP_NUM_THREADS=1 python benchmarks/step_phases.py --policy confidence --concurrency 1

Runs the demo models in process on held-out prompts (`--concurrency` at a time, each to
`--max-tokens`, EOS ignored) and times each phase of `Engine.step` by wrapping the methods it
calls: the proposer's `propose`, the target's `verify` (and, inside it, `_accept`, the acceptance
step), the policy's verbs, the acceptance tracker's, commit and the engine's own bookkeeping.
Prints ms a step per phase, and the coordinator's own work (the step less drafting and the
target's pass), and writes the table as JSON. The wrappers add ~1 us a call.
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
from dspark.coordinator.engine import Engine
from dspark.demo import heldout_prompts_path
from dspark.sampling_params import SamplingParams
from dspark.training.prompts import load_prompts

POLICY_VERBS = ("draft_lengths", "choose_budget", "plan_verification", "observe", "observe_time")


def instrument(engine: Engine) -> dict[str, float]:
    """Wrap the step's phases in timers; returns the seconds each has taken so far."""
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
        (engine, "step", "step"),
        (engine.proposer, "propose", "draft"),
        (engine.target, "verify", "verify"),
        (engine.target, "_accept", "verify: accept"),
        *[(engine.tracker, verb, f"tracker.{verb}") for verb in ("fill", "observe")],
        *[(engine, verb, f"engine.{verb}") for verb in ("_plan", "_record", "_rollback")],
        *[(engine.policy, verb, f"policy.{verb}") for verb in POLICY_VERBS],
    ]
    for obj, name, label in targets:
        setattr(obj, name, timed(label, getattr(obj, name)))
    engine_module.commit = timed("commit", engine_module.commit)  # called by name in `step`
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--proposer", default=None, help="dspark (default), draft-model or ngram")
    ap.add_argument("--policy", default="confidence")
    ap.add_argument("--k", type=int, default=None, help="the proposer's default if not given")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batches", type=int, default=8, help="batches of --concurrency prompts")
    ap.add_argument("--out", default="runs/step_phases.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine = Engine(proposer=a.proposer, policy=a.policy, k=a.k)
    prompts = load_prompts(heldout_prompts_path(), a.concurrency * (a.batches + 1))
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True,
                            seed=1)
    engine.generate(prompts[: a.concurrency], params)  # warm-up (and the profile, if missing)
    seconds = instrument(engine)
    steps0 = engine.stats.steps
    for b in tqdm(range(1, a.batches + 1), desc="batches", unit="batch"):
        engine.generate(prompts[b * a.concurrency : (b + 1) * a.concurrency], params)
    steps = engine.stats.steps - steps0
    ms = {label: 1e3 * s / steps for label, s in seconds.items()}
    ms["coordinator (step - draft - verify)"] = ms["step"] - ms["draft"] - ms["verify"]
    print(f"{a.proposer or 'dspark'}, {a.policy} (k = {engine.max_k}), {a.concurrency} in flight, T = {a.temperature}: "
          f"{steps} steps")
    for label, value in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {label:38s} {value:8.3f} ms a step")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "steps": steps, "ms_per_step": ms}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
