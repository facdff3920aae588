"""How precisely a paired benchmark compares two arms here: two identical `off` engines (an
A/A test) serve the same rounds, one whole run after another and in turns
(`dspark.bench.interleaved_runs`, `stepwise_round`); every paired ratio should be 1.

    python benchmarks/pairing_noise.py --concurrency 4 --rounds 10

Two more pairings check what taking turns costs: `off` against an `off` whose every step is 4
of its steps (fewer, longer steps, as speculation takes), with turns of one step (it then
leaves the CPU's caches a quarter as often per token: a bias would show as a ratio above 1)
and with the benchmarks' turns of TURN_SECONDS (both leave them as often per second). Prints,
per pairing, the median ratio with its 95% bootstrap interval, the standard deviation, min and
max of the rounds' ratios, and writes `pairing_noise.json` to `--out`. `--ballast N` adds N
more `off` engines to every pairing, taking turns too: the CPU's caches then hold what a
7-arm `dspark bench-policies` cell holds (`--ballast 5`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.bench import TURN_SECONDS, interleaved_runs, median_ci, paired_ratios, warm_up
from dspark.coordinator.engine import Engine
from dspark.demo import heldout_prompts_path
from dspark.messages import StepState
from dspark.training.prompts import load_prompts

STEPS_IN_ONE = 4


class LongSteps(Engine):
    """An engine whose every step is up to STEPS_IN_ONE of its steps."""

    def step(self) -> StepState | None:
        state = super().step()
        for _ in range(STEPS_IN_ONE - 1):
            if not self.has_unfinished():
                break
            super().step()
        return state


def pairing(engines: dict[str, Engine], served: list[str], conc: int, rounds: int,
            turn_seconds: float | None, bar: tqdm) -> dict:
    """The second engine's paired ratios to the first's (`interleaved_runs`), summarised."""
    runs = interleaved_runs(engines, served, conc, 0.0, 32, rounds, bar.update, turn_seconds)
    first, second = list(engines)[:2]
    ratios = paired_ratios(runs[second], runs[first])
    return {"ratios": ratios, "median": statistics.median(ratios), "ci": median_ci(ratios),
            "sd": statistics.pstdev(ratios), "min": min(ratios), "max": max(ratios)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--ballast", type=int, default=0,
                   help="more `off` engines in every pairing (caches as full as a bench's)")
    p.add_argument("--out", default="runs/pairing_noise")
    a = p.parse_args()
    torch.set_num_threads(1)
    conc = a.concurrency

    def off(cls: type[Engine] = Engine) -> Engine:
        return cls(proposer="none", policy="off", max_num_seqs=conc)

    ballast = {f"ballast {i}": off() for i in range(a.ballast)}
    a_a = {"off": off(), "off again": off(), **ballast}
    long = {"off": a_a["off"], f"off, {STEPS_IN_ONE}-step steps": off(LongSteps), **ballast}
    served = warm_up({**a_a, **long}, load_prompts(heldout_prompts_path()), (0.0,), 32, conc)
    bar = tqdm(total=4 * a.rounds * (2 + a.ballast), desc="rounds", unit="run")
    ms = f"{TURN_SECONDS * 1e3:g} ms"
    table = {
        "A/A, whole runs in turn": pairing(a_a, served, conc, a.rounds, None, bar),
        f"A/A, turns of {ms}": pairing(a_a, served, conc, a.rounds, TURN_SECONDS, bar),
        f"{STEPS_IN_ONE}-step / 1, turns of a step": pairing(long, served, conc, a.rounds, 0.0,
                                                             bar),
        f"{STEPS_IN_ONE}-step / 1, turns of {ms}": pairing(long, served, conc, a.rounds,
                                                          TURN_SECONDS, bar),
    }
    bar.close()
    print(f"\n{conc} in flight, T = 0, {a.rounds} rounds, {a.ballast} more engines taking turns: "
          "the second engine / the first")
    print(f"{'pairing':<34} {'median':>7} {'95% CI':>15} {'sd':>6} {'min':>6} {'max':>6}")
    for label, r in table.items():
        lo, hi = r["ci"]
        print(f"{label:<34} {r['median']:7.3f}  [{lo:.3f},{hi:.3f}] {r['sd']:6.3f} "
              f"{r['min']:6.3f} {r['max']:6.3f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = {"concurrency": conc, "rounds": a.rounds, "ballast": a.ballast, "pairings": table}
    (out / "pairing_noise.json").write_text(json.dumps(saved, indent=1) + "\n")
    print(f"wrote {out / 'pairing_noise.json'}")


if __name__ == "__main__":
    main()
