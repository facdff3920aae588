"""What a drafting round costs: the shipped proposers' `propose` over batches and depths.

    python benchmarks/draft_rounds.py --proposer dspark --repeats 9 --out runs/draft_rounds

For each temperature (0 and 1), batch size n and depth d, n scratch requests with contexts of
100-349 committed tokens (random tokens and, for DSpark, random target hidden rows) draft d
positions after taking in two new rows each, as in a steady step. Batch sizes run in an
interleaved, rotated order `--repeats` times and the median is reported, so a load spike on a
shared machine hits one run, not a whole row. Beside the round, the table gives the target's
decode pass over the same n requests (one token each, the same contexts): the pass a round must
pay for. Writes `draft_rounds.json` and `draft_rounds.png` (round time against batch size).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dspark.coordinator.profiler import _plan
from dspark.demo import demo_path
from dspark.draft_worker.draft_model import DraftModelProposer
from dspark.draft_worker.dspark_proposer import DSparkProposer
from dspark.messages import DraftQuery, NewRequest
from dspark.sampling_params import SamplingParams
from dspark.target_worker.runner import TargetRunner

SIZES = (1, 4, 16, 64)
DEPTHS = (1, 3, 7)


def contexts(n: int) -> list[int]:
    """Context lengths of n requests: spread over 100..349, as the held-out prompts plus their
    outputs are (prompts of 36-307 tokens, outputs up to ~48)."""
    return [100 + (i * 37) % 250 for i in range(n)]


def make_proposer(name: str) -> DSparkProposer | DraftModelProposer:
    if name == "dspark":
        return DSparkProposer(demo_path("dspark"), demo_path("target"), 8192, 16, torch.float32)
    return DraftModelProposer(demo_path("draft-model"), 8192, 16, torch.float32)


def run(proposer_name: str, repeats: int, out: Path) -> dict:
    torch.manual_seed(0)
    proposer = make_proposer(proposer_name)
    target = TargetRunner(demo_path("target"), num_blocks=8192,
                          hidden_layers=tuple(getattr(proposer, "hidden_layers", ())))
    width = target.config.hidden_size * len(getattr(proposer, "hidden_layers", ()))
    rows = (lambda m: torch.randn(m, width)) if width else (lambda m: None)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature)
        batches = {}
        for n in SIZES:
            ids = [f"T{temperature:g}-n{n}-{i}" for i in range(n)]
            prompts = [tuple(torch.randint(1, 4000, (c,)).tolist()) for c in contexts(n)]
            for i, (r, p) in enumerate(zip(ids, prompts, strict=True)):
                proposer.add_request(NewRequest(r, (), params, seed=i))
                proposer.propose([DraftQuery(r, p, 0, rows(len(p) - 1))])
                target.add_request(NewRequest(r, p, params, seed=i))
            target.verify(_plan(ids, [0] * n, prompts, [0] * n))
            target.rollback({r: len(p) - 1 for r, p in zip(ids, prompts, strict=True)})
            batches[n] = (ids, prompts)
        times: dict[tuple[int, int], list[float]] = {}
        for rep in tqdm(range(repeats), desc=f"rounds T={temperature:g}", unit="repeat"):
            order = list(SIZES[rep % len(SIZES):] + SIZES[: rep % len(SIZES)])
            for n in order:
                ids, prompts = batches[n]
                for d in (0, *DEPTHS):
                    times.setdefault((n, d), []).append(
                        _round(proposer, target, ids, prompts, d, rows))
        row = results.setdefault(f"T={temperature:g}", {})
        for n in SIZES:
            cell = row.setdefault(str(n), {})
            cell["target_pass_ms"] = statistics.median(times[(n, 0)]) * 1e3
            for d in DEPTHS:
                cell[f"round_d{d}_ms"] = statistics.median(times[(n, d)]) * 1e3
        for ids, _ in batches.values():
            for r in ids:
                proposer.release(r)
                target.release(r)
    _print(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "draft_rounds.json").write_text(json.dumps(
        {"proposer": proposer_name, "repeats": repeats, "results": results}, indent=2) + "\n")
    _plot(results, proposer_name, out / "draft_rounds.png")
    print(f"wrote {out / 'draft_rounds.json'} and {out / 'draft_rounds.png'}")
    return results


def _round(proposer, target, ids, prompts, depth, rows) -> float:  # noqa: ANN001
    """Seconds of one drafting round of `depth` positions (0: the target's decode pass of one
    token a request instead), after two new committed tokens a request."""
    if depth == 0:
        plan = _plan(ids, [len(p) - 1 for p in prompts], [p[-1:] for p in prompts], [0] * len(ids))
        start = time.perf_counter()
        target.verify(plan)
        seconds = time.perf_counter() - start
        target.rollback({r: len(p) - 1 for r, p in zip(ids, prompts, strict=True)})
        return seconds
    queries = [DraftQuery(r, (5, 6), depth, rows(2)) for r in ids]
    start = time.perf_counter()
    proposer.propose(queries)
    seconds = time.perf_counter() - start
    for r in ids:
        proposer.commit(r, 0)
    return seconds


def _print(results: dict) -> None:
    print(f"{'T':4} {'n':>4} {'target pass':>12}" + "".join(f"{f'round d={d}':>12}" for d in DEPTHS)
          + "  (ms)")
    for temp, row in results.items():
        for n, cell in row.items():
            print(f"{temp:4} {n:>4} {cell['target_pass_ms']:12.1f}"
                  + "".join(f"{cell[f'round_d{d}_ms']:12.1f}" for d in DEPTHS))


def _plot(results: dict, proposer: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (temp, row) in zip(axes[0], results.items(), strict=True):
        sizes = [int(n) for n in row]
        ax.plot(sizes, [row[str(n)]["target_pass_ms"] for n in sizes], "k--",
                label="target decode pass")
        for d in DEPTHS:
            ax.plot(sizes, [row[str(n)][f"round_d{d}_ms"] for n in sizes], "o-",
                    label=f"{proposer} round, depth {d}")
        ax.set(xscale="log", xlabel="requests in the round", ylabel="ms", title=temp)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proposer", choices=["dspark", "draft-model"], default="dspark")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", type=Path, default=Path("runs/draft_rounds"))
    args = p.parse_args()
    torch.set_num_threads(1)
    run(args.proposer, args.repeats, args.out)


if __name__ == "__main__":
    main()
