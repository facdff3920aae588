"""What pricing time by the queue is worth: `confidence` told how many requests wait, against
`confidence` that is not told (it then prices every step's time at the run's rate Θ*).

    python benchmarks/queue_pricing.py --concurrency 16 --temperature 1 --rounds 12

With requests waiting, both arms decide alike; with none waiting (a closed batch after its last
admission) the first maximises each decode step's own tokens a second (docs/scheduler.md, "One
step", 4). Both arms, fixed k = 3 and `off` serve the same closed batches in the same
interleaved rounds as `dspark bench-policies`, after its warm-up. Prints each arm's tokens/s,
the paired ratios (median, 95% bootstrap interval) and, from the arms' step traces, tokens a
ms before and after each round's last admission: the steps the change touches are the second.
Writes `queue_pricing.json` and the traces to `--out`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dspark.bench import against_arm, traced_rounds
from dspark.coordinator.engine import Engine
from dspark.coordinator.scheduler import ConfidencePolicy
from dspark.coordinator.trace import StepTrace


class QueueUnknown(ConfidencePolicy):
    """`confidence` never told the queue (`queued` = None: time always at Θ*)."""

    name = "confidence-queue-unknown"

    def draft_lengths(self, caps, req_ids, sampled=False, backlog=None,  # noqa: ANN001, ANN201
                      prompt_tokens=0, queued=None):
        return super().draft_lengths(caps, req_ids, sampled, backlog, prompt_tokens, None)


def engines_for(conc: int) -> dict[str, Engine]:
    """The four arms; `QueueUnknown` on the engine's own cost model and tracker."""
    told = Engine(proposer="dspark", policy="confidence", k=7, max_num_seqs=conc)
    blind = Engine(proposer="dspark", policy="confidence", k=7, max_num_seqs=conc)
    old = blind.policy
    assert isinstance(old, ConfidencePolicy)
    blind.policy = QueueUnknown(old.gamma, blind.cost_model, blind.tracker, old.a_priori,
                                old.sequential_drafts)
    return {"confidence": told, "queue unknown": blind,
            "fixed k=3": Engine(proposer="dspark", policy="fixed", k=3, max_num_seqs=conc),
            "off": Engine(proposer="dspark", policy="off", k=7, max_num_seqs=conc)}


def phase_rates(steps: list[StepTrace]) -> dict[str, float]:
    """Tokens a ms in each closed batch's steps up to its last admission and after it. A batch
    starts at a step whose requests are all new, so at 1 in flight every request starts one
    and the split says nothing there; read it at 4 or more."""
    starts = [i for i, s in enumerate(steps) if sum(s.new) == len(s.req_ids)] + [len(steps)]
    tokens, seconds = {"queued": 0, "after": 0}, {"queued": 0.0, "after": 0.0}
    for a, b in zip(starts, starts[1:], strict=False):
        batch = steps[a:b]
        last = max(i for i, s in enumerate(batch) if sum(s.new))
        for i, s in enumerate(batch):
            phase = "queued" if i <= last else "after"
            tokens[phase] += sum(s.committed)
            seconds[phase] += s.seconds
    return {p: tokens[p] / seconds[p] / 1e3 if seconds[p] else float("nan") for p in tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", default="runs/queue_pricing")
    a = p.parse_args()
    torch.set_num_threads(1)
    conc, temp = a.concurrency, a.temperature
    engines = engines_for(conc)
    out = Path(a.out)
    runs = traced_rounds(engines, conc, temp, a.max_tokens, a.rounds, out)
    results = against_arm(runs, "confidence")  # arm_x: confidence x this arm, paired
    print(f"{conc} in flight, T = {temp:g}, {a.rounds} rounds")
    for label, engine in engines.items():
        assert engine.trace is not None
        rates = phase_rates(engine.trace.steps)
        r = results[label]
        r["tokens_per_ms_queued"], r["tokens_per_ms_after"] = rates["queued"], rates["after"]
        low, high = r["arm_x_ci"]
        print(f"  {label:14} {r['tokens_per_s']:7.1f} tok/s  confidence x this "
              f"{r['arm_x']:.3f} [{low:.3f}, {high:.3f}]  tokens a ms: "
              f"{rates['queued']:.3f} queued, {rates['after']:.3f} after the last admission")
    (out / "queue_pricing.json").write_text(json.dumps(
        {"in_flight": conc, "temperature": temp, "rounds": a.rounds, "results": results},
        indent=2) + "\n")
    print(f"wrote {out / 'queue_pricing.json'} and the arms' traces")


if __name__ == "__main__":
    main()
