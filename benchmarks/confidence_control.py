"""What `confidence`'s choices are worth: the policy against a control that keeps its work but
not its choices.

    python benchmarks/confidence_control.py --concurrency 1 --temperature 0 --rounds 48

The control arm is `confidence` with every plan forced to whole blocks (K = every admissible
slot, the round γ deep): it still reads stale rows, prices steps, corrects drift, fits step
times and measures K = 0 now and then, so `confidence` × control is the value of the budget's
decisions alone, and control × fixed k the cost of its work. The arms run the same closed
batches in the same interleaved rounds as `dspark bench-policies`, after its warm-up
(`dspark.bench.interleaved_runs`, `warm_up`); ratios are medians of per-round paired ratios with
95% bootstrap intervals. Each arm's step trace is written to `--out` (`dspark trace-summary`
splits it by budget). docs/scheduler.md, "What the budget's choices are worth at low
concurrency", has the figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dspark.bench import against_arm, traced_rounds
from dspark.coordinator.engine import Engine
from dspark.coordinator.scheduler import ConfidencePolicy


class WholeBlocks(ConfidencePolicy):
    """`confidence` with its budget before drafting replaced by every admissible slot."""

    name = "confidence-whole-blocks"

    def budget_before_drafting(self, req_ids: tuple[str, ...], limits: list[int]
                               ) -> tuple[int, int]:
        return sum(limits), max(limits, default=0)


def control_engine(conc: int, gamma: int) -> Engine:
    """A DSpark engine whose policy is `WholeBlocks`, built on the engine's own cost model and
    tracker as `make_policy` builds `confidence`."""
    engine = Engine(proposer="dspark", policy="confidence", k=gamma, max_num_seqs=conc)
    old = engine.policy
    assert isinstance(old, ConfidencePolicy)
    engine.policy = WholeBlocks(gamma, engine.cost_model, engine.tracker, old.a_priori,
                                old.sequential_drafts)
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--rounds", type=int, default=48)
    p.add_argument("--fixed", type=int, default=7, help="the fixed k beside them")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--out", default="runs/confidence_control")
    a = p.parse_args()
    torch.set_num_threads(1)
    conc, temp = a.concurrency, a.temperature
    engines = {
        "confidence": Engine(proposer="dspark", policy="confidence", k=a.gamma,
                             max_num_seqs=conc),
        "control": control_engine(conc, a.gamma),
        f"fixed k={a.fixed}": Engine(proposer="dspark", policy="fixed", k=a.fixed,
                                     max_num_seqs=conc),
    }
    out = Path(a.out)
    runs = traced_rounds(engines, conc, temp, a.max_tokens, a.rounds, out)
    results = against_arm(runs, "confidence")  # arm_x: confidence x this arm, paired
    print(f"{conc} in flight, T = {temp:g}, {a.rounds} rounds")
    for label, r in results.items():
        low, high = r["arm_x_ci"]
        print(f"  {label:20} {r['tokens_per_s']:7.1f} tok/s   confidence x this "
              f"{r['arm_x']:.3f} [{low:.3f}, {high:.3f}]")
    (out / "confidence_control.json").write_text(json.dumps(
        {"in_flight": conc, "temperature": temp, "rounds": a.rounds, "results": results},
        indent=2) + "\n")
    print(f"wrote {out / 'confidence_control.json'} and the arms' traces")


if __name__ == "__main__":
    main()
