"""Drafters side by side on held-out prompts: τ and per-position conditional acceptance.

    python benchmarks/drafters.py --num-prompts 48 --max-tokens 96 --out runs/bench_drafters

Every proposer drafts γ = 7 per step and every draft is verified (policy `fixed`, k = 7), at
T = 0 and T = 1, on the same prompts and seeds. From the engine's step states:
- τ: tokens committed per target pass (A + 1), over all passes;
- τ_spec: the same over passes that verified at least one draft (DSpark has none on a request's
  first pass, before the target has produced any hidden state);
- acceptance[j]: P(x_j accepted | x_1..x_{j−1} accepted and x_j verified).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark.coordinator.engine import Engine
from dspark.demo import heldout_prompts_path
from dspark.sampling_params import SamplingParams
from dspark.training.prompts import load_prompts

GAMMA = 7
ARMS = ("dspark", "draft-model", "ngram")


def measure(proposer: str, prompts: list[str], temperature: float, max_tokens: int) -> dict:
    engine = Engine(proposer=proposer, policy="fixed", k=GAMMA, max_num_seqs=8)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            prompt,
            SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i),
        )
    passes = spec_passes = committed = spec_committed = 0
    reached = [0] * GAMMA
    accepted = [0] * GAMMA
    while engine.has_unfinished():
        state = engine.step()
        assert state is not None
        for s in state.requests:
            passes += 1
            committed += s.num_accepted + 1
            if s.num_planned > 0:
                spec_passes += 1
                spec_committed += s.num_accepted + 1
            for j in range(min(s.num_planned, s.num_accepted + 1)):
                reached[j] += 1
                accepted[j] += int(j < s.num_accepted)
    return {
        "tau": committed / passes,
        "tau_spec": spec_committed / max(1, spec_passes),
        "acceptance": [
            a / r if r else float("nan") for a, r in zip(accepted, reached, strict=True)
        ],
        "passes": passes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", default="runs/bench_drafters")
    a = parser.parse_args()
    prompts = load_prompts(heldout_prompts_path())[-a.num_prompts :]  # the tests use the first ones
    results = {
        f"T={t:g}": {arm: measure(arm, prompts, t, a.max_tokens) for arm in ARMS}
        for t in (0.0, 1.0)
    }
    print(f"{a.num_prompts} held-out prompts × {a.max_tokens} tokens, γ = {GAMMA}, all verified")
    print(
        f"{'setting':<7} {'proposer':<12} {'tau':>6} {'tau_spec':>8}  acceptance at positions 1..7"
    )
    for setting, arms in results.items():
        for arm, r in arms.items():
            acc = " ".join(f"{x:.2f}" for x in r["acceptance"])
            print(f"{setting:<7} {arm:<12} {r['tau']:>6.3f} {r['tau_spec']:>8.3f}  {acc}")
        ratio = arms["dspark"]["tau"] / arms["draft-model"]["tau"]
        print(f"{setting:<7} dspark / draft-model τ = {ratio:.3f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_drafters.json").write_text(
        json.dumps(
            {
                "num_prompts": a.num_prompts,
                "max_tokens": a.max_tokens,
                "gamma": GAMMA,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    plot(results, out / "bench_drafters.png")
    print(f"wrote {out / 'bench_drafters.json'} and {out / 'bench_drafters.png'}")


def plot(results: dict, path: Path) -> None:
    """Conditional acceptance per draft position, one panel per temperature, τ in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), sharey=True)
    for ax, (setting, arms) in zip(axes, results.items(), strict=False):
        for arm, r in arms.items():
            ax.plot(range(1, GAMMA + 1), r["acceptance"], "o-", label=f"{arm} (τ {r['tau']:.2f})")
        ax.set_title(f"{setting}: acceptance per position")
        ax.set_xlabel("draft position j")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("P(x_j accepted | x_<j accepted)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
