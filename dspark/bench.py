"""Benchmarks of the in-process engine (scripts that print tables and write JSON + PNG).

Arms are measured side by side in one run: every arm serves the same requests at the same
time, each stepping in turns of TURN_SECONDS (`stepwise_round`), so the machine's noise and
drift fall on all arms alike. An arm's speed is its output tokens per second of its own
engine calls.
"""

from __future__ import annotations

import gc
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dspark.coordinator.cost_model import hardware_key
from dspark.coordinator.engine import Engine
from dspark.coordinator.trace import TraceRecorder
from dspark.demo import heldout_prompts_path
from dspark.sampling_params import SamplingParams
from dspark.training.prompts import load_prompts

TURN_SECONDS = 0.02  # an arm's turn in `stepwise_round`: steps until it has run this long


@dataclass(frozen=True)
class Arm:
    label: str
    proposer: str
    policy: str
    k: int


CORE_ARMS = (
    Arm("off", "none", "off", 1),
    Arm("dspark k=3", "dspark", "fixed", 3),
    Arm("dspark k=7", "dspark", "fixed", 7),
    Arm("draft-model k=3", "draft-model", "fixed", 3),
    Arm("draft-model k=7", "draft-model", "fixed", 7),
    Arm("ngram k=3", "ngram", "fixed", 3),
    Arm("ngram k=7", "ngram", "fixed", 7),
)


def _measure(engines: dict[str, Engine], prompts: list[str], params: SamplingParams,
             desc: str) -> dict[str, dict[str, float]]:
    """One request in flight: each prompt served by every engine together (`stepwise_round`)."""
    totals = {label: {"tokens": 0, "seconds": 0.0, "passes": 0} for label in engines}
    for i, prompt in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        p = SamplingParams(**{**params.__dict__, "seed": None if params.greedy else i})
        for label, run in stepwise_round(engines, 1, [prompt], [p]).items():
            for key in totals[label]:
                totals[label][key] += run[key]
    return {
        label: {
            "tokens_per_s": t["tokens"] / t["seconds"],
            "mean_accepted_length": t["tokens"] / t["passes"],
            "tokens": t["tokens"],
            "seconds": round(t["seconds"], 3),
        }
        for label, t in totals.items()
    }


def run_core_bench(
    num_prompts: int = 8, max_tokens: int = 96, out_dir: Path = Path("runs/bench_core")
) -> dict:
    """Proposers side by side on the demo pair, one request in flight, T = 0 and T = 1."""
    prompts = load_prompts(heldout_prompts_path(), num_prompts)
    engines = {a.label: Engine(proposer=a.proposer, policy=a.policy, k=a.k) for a in CORE_ARMS}
    for e in engines.values():  # warm-up
        e.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=8))
    results = {}
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
        results[f"T={temperature:g}"] = _measure(engines, prompts, params, f"T={temperature:g}")
    _print_table(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_core.json").write_text(
        json.dumps(
            {"num_prompts": num_prompts, "max_tokens": max_tokens, "results": results}, indent=2
        )
        + "\n"
    )
    _plot(results, out_dir / "bench_core.png")
    print(f"wrote {out_dir / 'bench_core.json'} and {out_dir / 'bench_core.png'}")
    return results


def _print_table(results: dict[str, dict[str, dict[str, float]]]) -> None:
    print(f"\n{'setting':<8} {'arm':<18} {'tok/s':>8} {'x off':>6} {'tau':>6}")
    for setting, arms in results.items():
        base = arms["off"]["tokens_per_s"]
        for label, r in arms.items():
            print(f"{setting:<8} {label:<18} {r['tokens_per_s']:>8.1f} "
                  f"{r['tokens_per_s'] / base:>6.2f} {r['mean_accepted_length']:>6.2f}")


def _plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    settings = list(results)
    labels = list(next(iter(results.values())))
    width = 0.8 / len(settings)
    for metric, ax, title in (("tokens_per_s", axes[0], "output tokens/s (1 request)"),
                              ("mean_accepted_length", axes[1], "tokens per target pass (tau)")):
        for i, s in enumerate(settings):
            ax.bar([j + i * width for j in range(len(labels))],
                   [results[s][lab][metric] for lab in labels], width, label=s)
        ax.set_xticks([j + width / 2 for j in range(len(labels))], labels, rotation=20, fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_demo(num_prompts: int = 4, max_tokens: int = 64, in_process: bool = False) -> None:
    """The main job: the service on a local Ray instance with the demo models, requests through
    the gRPC SDK, then a speed summary: the same prompts in this process with the same proposer
    and policy, and with the target alone. Speculation's gain is the in-process pair's ratio
    (like for like); the service's figure adds what Ray calls and gRPC cost on this layout."""
    from concurrent.futures import ThreadPoolExecutor

    from dspark.client import Client
    from dspark.config import ServeConfig
    from dspark.coordinator.serve import start_service

    prompts = load_prompts(heldout_prompts_path(), num_prompts)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # Warm-up: one concurrent round, short. A fresh scheduler learns its layout's step costs
    # online in its first steps; the summary times each engine as it then runs.
    warm = SamplingParams(temperature=0, max_tokens=16)
    cfg = ServeConfig(port=0, metrics_port=-1, in_process=in_process)
    print(f"starting the service (local Ray instance, demo target, proposer {cfg.proposer}) ...",
          flush=True)
    service = start_service(cfg)
    try:
        print(f"serving on {service.address} ({service.mode})", flush=True)
        client = Client(service.address)
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: client.generate(p, warm), prompts))
            start = time.perf_counter()
            outs = list(pool.map(lambda p: client.generate(p, params), prompts))
        t_service = time.perf_counter() - start
    finally:
        service.stop()

    def timed(engine: Engine) -> tuple[list, float]:
        engine.generate(prompts, [warm] * len(prompts))
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        return results, time.perf_counter() - start

    live = service.config
    engine = Engine(proposer=live.proposer, policy=live.policy, k=live.k)
    local, t_local = timed(engine)
    refs, t_plain = timed(Engine(proposer="none"))
    for prompt, out in zip(prompts, outs, strict=False):
        print("=" * 72)
        print(prompt + "\033[1m" + out.text + "\033[0m")
    n_service = sum(len(o.token_ids) for o in outs)
    n_local = sum(len(o.token_ids) for o in local)
    n_plain = sum(len(o.token_ids) for o in refs)
    same = all(
        o.token_ids == r.token_ids == q.token_ids
        for o, q, r in zip(outs, local, refs, strict=False)
    )
    passes = sum(int(o.stats["target_passes"]) for o in outs)
    print("=" * 72)
    print(f"{len(prompts)} concurrent requests, greedy, {max_tokens} tokens max; "
          f"proposer {live.proposer}, policy {engine.policy.name}")
    print(f"service ({service.mode}, through the SDK): {n_service / t_service:.1f} tok/s, "
          f"{n_service / passes:.2f} tokens per target pass")
    print(f"in-process, same proposer and policy: {n_local / t_local:.1f} tok/s; "
          f"target alone: {n_plain / t_plain:.1f} tok/s")
    print(f"speculation, in-process: {n_local / t_local / (n_plain / t_plain):.2f}x the target "
          f"alone; the service runs at {n_service / t_service / (n_local / t_local):.2f}x the "
          f"in-process engine; outputs identical: {same}")


WARMUP_REQUESTS = 8  # per temperature, before any cell is measured

POLICY_ARMS = (
    ("off", "off", 1),
    ("fixed k=1", "fixed", 1),
    ("fixed k=3", "fixed", 3),
    ("fixed k=7", "fixed", 7),
    ("equal", "equal", 7),
    ("confidence-sync", "confidence-sync", 7),
    ("confidence", "confidence", 7),
)


def policy_engines(proposer: str, arms: tuple[str, ...] | None, max_num_seqs: int,
                   workers: tuple | None = None, device: str | None = None) -> dict[str, Engine]:
    """An engine per arm of POLICY_ARMS named in `arms` (None: all), in that order, drafting
    with `proposer` (`off` with none); ValueError naming any arm it does not know."""
    labels = [label for label, _, _ in POLICY_ARMS]
    unknown = sorted(set(arms or ()) - set(labels))
    if unknown:
        raise ValueError(f"arms={unknown}: choose from {labels}")
    return {label: Engine(proposer="none" if policy == "off" else proposer, policy=policy, k=k,
                          max_num_seqs=max_num_seqs, workers=workers, device=device)
            for label, policy, k in POLICY_ARMS if arms is None or label in arms}


def run_policy_bench(proposer: str = "dspark", concurrencies: tuple[int, ...] = (1, 4, 16, 64),
                     temperatures: tuple[float, ...] = (0.0, 1.0), max_tokens: int = 48,
                     out_dir: Path = Path("runs/bench_policies"), repeats: int = 3,
                     arms: tuple[str, ...] | None = None, trace_dir: Path | None = None,
                     workers: tuple | None = None, device: str | None = None) -> dict:
    """Policies side by side at several numbers of requests in flight (closed loop).

    Requests ask for `max_tokens` on average, each drawn (seeded, the same for every arm) from
    max_tokens/2 .. 3·max_tokens/2 (`output_lengths`). With one length for all, plain decoding
    runs in lockstep: the requests of a wave finish in the same step and the next wave's prompts
    are prefilled together, in a few large passes that a CPU runs per token at ~3/4 of the cost
    of many small ones; speculation scatters the finishing steps and loses that batching. That
    measured the workload, not the policy (16 in flight, T = 0: `off` prefilled in 8 passes of
    2,246 tokens, `confidence` in 25 of 730, and ran at 0.85x; 1.06x with spread lengths), and
    live traffic does not arrive in lockstep.

    Each cell runs `rounds_for(conc, repeats)` rounds, every arm serving each round's batch
    together in turns of TURN_SECONDS of its steps (`stepwise_round`), and reports the median
    tokens/s.
    "x off" is the median over rounds of each round's ratio to `off` (paired), with a 95%
    bootstrap interval for that median (`median_ci`): a shared machine's drift within a round
    falls on every arm alike, so what the interval holds is mostly the rounds' texts.

    With `trace_dir`, each arm's steps in each cell (warm-up excluded) are also written there as
    a step trace, `T<t>_c<in flight>_<arm>.jsonl` (`coordinator/trace.py`; summarised by
    `dspark trace-summary`): where an arm trails, its trace says in which steps.

    With `workers` (`build_ray_workers`' pools, of `proposer`), every arm runs over them, one
    whole run after another (their requests' names would collide in shared workers): the
    service's path, Ray calls included. `off` then keeps the drafter idle.
    Otherwise the engines run in process on `device` (`Engine`'s; None: CUDA if any)."""
    engines = policy_engines(proposer, arms, max(concurrencies), workers, device)
    prompts = load_prompts(heldout_prompts_path())
    served = warm_up(engines, prompts, temperatures, max_tokens, max(concurrencies))
    results: dict[str, dict] = {}
    cells = [(t, c) for t in temperatures for c in concurrencies]
    bar = tqdm(total=sum(rounds_for(c, repeats) for _, c in cells) * len(engines),
               desc="policies", unit="run")
    for temperature, conc in cells:
        row = results.setdefault(f"T={temperature:g}", {}).setdefault(str(conc), {})
        if trace_dir is not None:
            for label, engine in engines.items():
                engine.trace = TraceRecorder(meta={
                    "proposer": proposer, "arm": label, "temperature": temperature,
                    "in_flight": conc, "max_tokens": max_tokens})
        runs = interleaved_runs(engines, served, conc, temperature, max_tokens,
                                rounds_for(conc, repeats), bar.update,
                                None if workers is not None else TURN_SECONDS)
        if trace_dir is not None:
            for label, engine in engines.items():
                assert engine.trace is not None
                engine.trace.save(trace_dir / trace_name(temperature, conc, label))
                engine.trace = None
        for label in engines:
            row[label] = _merge_runs(runs[label])
            # Paired: each round ran every arm once, close in time; the median of the per-round
            # ratios cancels the machine's slow drifts that a ratio of medians keeps.
            off = runs.get("off", [])
            paired = paired_ratios(runs[label], off)
            row[label]["x_off"] = statistics.median(paired) if off else float("nan")
            row[label]["x_off_ci"] = median_ci(paired) if off else [float("nan")] * 2
            row[label]["x_off_full"] = statistics.median(
                _full_rate(r) / _full_rate(o) for r, o in zip(runs[label], off, strict=False)
            ) if off else float("nan")
        _against_best_fixed(row, runs)
    bar.close()
    _print_policy_table(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    hardware = ("ray workers" if workers is not None
                else hardware_key(next(iter(engines.values())).target.device))
    (out_dir / "bench_policies.json").write_text(json.dumps(
        {"proposer": proposer, "max_tokens": max_tokens, "hardware": hardware,
         "schedule": ("whole runs in turn" if workers is not None
                      else f"turns of {TURN_SECONDS * 1e3:g} ms"),
         "results": results}, indent=2) + "\n")
    _plot_policies(results, out_dir / "bench_policies.png")
    print(f"wrote {out_dir / 'bench_policies.json'} and {out_dir / 'bench_policies.png'}")
    return results


def warm_up(engines: dict[str, Engine], prompts: list[str], temperatures: tuple[float, ...],
            max_tokens: int, max_num_seqs: int) -> list[str]:
    """Each engine serves the last WARMUP_REQUESTS prompts at every temperature of the run
    (and profiles its cost model, once per machine), so what the scheduler learns online (the
    head's drift correction, the step-time fit) is measured in its steady state, as in a
    server that has been running, not in its first hundred steps. Returns the prompts left to
    serve."""
    warm = prompts[-WARMUP_REQUESTS:]
    for e in tqdm(engines.values(), desc="warm-up", unit="engine"):
        e.max_num_seqs = max_num_seqs
        for temperature in temperatures:
            e.generate(warm, [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                             ignore_eos=True, seed=10_000 + i)
                              for i in range(len(warm))])
    return prompts[:-WARMUP_REQUESTS]


def interleaved_runs(engines: dict[str, Engine], served: list[str], conc: int,
                     temperature: float, max_tokens: int, rounds: int,
                     on_run: Callable[[], object] = lambda: None,
                     turn_seconds: float | None = TURN_SECONDS) -> dict[str, list[dict]]:
    """`rounds` rounds at `conc` in flight; each round serves its own closed batch
    (`round_workload`) once with every engine, and each round's runs are compared paired.
    The engines serve it together, in turns of `turn_seconds` (`stepwise_round`); with None,
    one whole run after another, in an order rotated from round to round (engines that share
    worker pools: their requests' names would collide in the workers). Returns each engine's
    runs (`_ArmRun.finish`'s fields), round by round."""
    labels = list(engines)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    for rep in range(rounds):
        batch, params = round_workload(served, max(2 * conc, 8), rep, temperature, max_tokens)
        order = labels[rep % len(labels):] + labels[: rep % len(labels)]
        if turn_seconds is None:
            done = {label: _policy_run(engines[label], conc, batch, params) for label in order}
        else:
            done = stepwise_round({label: engines[label] for label in order}, conc, batch,
                                  params, turn_seconds)
        for label in labels:
            runs[label].append(done[label])
            on_run()
    return runs


def stepwise_round(engines: dict[str, Engine], conc: int, batch: list[str],
                   params: list[SamplingParams], turn_seconds: float = TURN_SECONDS
                   ) -> dict[str, dict]:
    """One closed batch served by every engine at once, in turns: each engine steps until its
    turn has run `turn_seconds` (one step at least; the first engine rotating from turn to
    turn); each engine's time is the sum of its own calls (`_ArmRun`). Python's collector is
    held off during the round (run before it), so none of its pauses lands in one arm's step.

    A shared machine's speed drifts within a second (a round at 4 in flight lasts ~0.6 s): two
    identical `off` engines' paired ratios spread with a standard deviation of 0.07–0.11 over
    8–40 rounds at 1–16 in flight with one whole run after another, and of 0.016–0.024 in
    turns (medians 1.001–1.010; `benchmarks/pairing_noise.py`). Turns are of time, not of
    steps: an engine's weights and cache leave the CPU's caches while the others run, a cost
    per turn, which with a turn a step an arm taking fewer, longer steps (speculation) would
    pay less often per token than `off` (a lone request's first step in a turn took 0.66 ms
    more than its next ones with 7 engines taking turns, 0.31 with 2). Measured, an engine
    whose steps are 4 of its steps against an identical one: 0.95–1.04x in turns of a step;
    in turns of 20 ms 0.98–1.03x over seven runs at 1–64 in flight, with 2 engines or with 7
    (as many as a bench's arms), in both directions: no bias resolved beyond ±2%."""
    gc.collect()
    gc.disable()
    try:
        arms = {label: _ArmRun(engine, conc, batch, params) for label, engine in engines.items()}
        labels = list(arms)
        turn = 0
        while live := [label for label in labels if arms[label].live]:
            first = turn % len(live)
            for label in live[first:] + live[:first]:
                arm, spent = arms[label], 0.0
                while arm.live and (spent == 0.0 or spent < turn_seconds):
                    spent += arm.step()
            turn += 1
        return {label: arm.finish() for label, arm in arms.items()}
    finally:
        gc.enable()


def traced_rounds(engines: dict[str, Engine], conc: int, temperature: float, max_tokens: int,
                  rounds: int, out: Path) -> dict[str, list[dict]]:
    """The benchmarks' paired run of a few arms in one cell: `warm_up` on the held-out
    prompts, then `interleaved_runs` with a progress bar, each arm's step trace recorded and
    saved to `out` (`trace_name`). Returns the runs, round by round."""
    served = warm_up(engines, load_prompts(heldout_prompts_path()), (temperature,), max_tokens,
                     conc)
    for engine in engines.values():
        engine.trace = TraceRecorder(meta={"temperature": temperature, "in_flight": conc})
    bar = tqdm(total=rounds * len(engines), desc="rounds", unit="run")
    runs = interleaved_runs(engines, served, conc, temperature, max_tokens, rounds, bar.update)
    bar.close()
    out.mkdir(parents=True, exist_ok=True)
    for label, engine in engines.items():
        assert engine.trace is not None
        engine.trace.save(out / trace_name(temperature, conc, label))
    return runs


def trace_name(temperature: float, conc: int, label: str) -> str:
    """The file name of one arm's trace in one cell (`run_policy_bench`'s `trace_dir`).

    >>> trace_name(1.0, 16, "fixed k=3")
    'T1_c16_fixed-k3.jsonl'
    """
    return f"T{temperature:g}_c{conc}_{label.replace(' ', '-').replace('=', '')}.jsonl"


def rounds_for(conc: int, repeats: int) -> int:
    """Rounds a cell runs: `repeats`, more where runs are short. A round's paired ratio to
    `off` moves with its text (a few requests at 1–4 in flight: fixed k = 1 with the draft
    model, 4 in flight, spread with a standard deviation of ~0.05 over rounds served in turns,
    `stepwise_round`), so 1 and 4 in flight get 4x and 2x the rounds, and still take less time
    than a 64-in-flight cell's 5 (3 and 3.5 minutes against 7 here).

    >>> [rounds_for(c, 5) for c in (1, 4, 16, 64)]
    [20, 10, 5, 5]
    """
    return max(repeats, math.ceil(repeats * math.sqrt(16 / conc)))


def paired_ratios(runs: list[dict], base: list[dict]) -> list[float]:
    """Round by round, a run's tokens/s over `base`'s run of the same round."""
    return [_rate(r) / _rate(b) for r, b in zip(runs, base, strict=False)]


def against_arm(runs: dict[str, list[dict]], arm: str) -> dict[str, dict]:
    """Per arm of `runs` (`interleaved_runs`' result): its median tokens/s, and `arm`'s paired
    ratio to it (`arm_x`: the median over rounds, `arm_x_ci`: its 95% interval), as the
    benchmarks that pair one policy against its variants report them."""
    out = {}
    for label, arm_runs in runs.items():
        paired = paired_ratios(runs[arm], arm_runs)
        out[label] = {"tokens_per_s": statistics.median(_rate(r) for r in arm_runs),
                      "arm_x": statistics.median(paired), "arm_x_ci": median_ci(paired)}
    return out


def best_fixed(row: dict[str, dict]) -> str | None:
    """The fixed k of a cell with the highest `x off` (None if it ran none, or no `off`)."""
    fixed = [label for label in row if label.startswith("fixed") and
             not math.isnan(row[label]["x_off"])]
    return max(fixed, key=lambda label: row[label]["x_off"], default=None)


def _against_best_fixed(row: dict[str, dict], runs: dict[str, list[dict]]) -> None:
    """Each arm that is not a fixed k against the cell's best fixed k (`best_fixed`), paired
    round by round as `x off` is: `x_best_fixed` (the median ratio), its 95% interval and
    `best_fixed` (the label). Dividing two arms' `x off` medians pairs neither with the other,
    and the arms' rounds drift together on a shared machine (at 1 in flight `off` ran from 242
    to 136 tokens/s within one cell)."""
    best = best_fixed(row)
    if best is None:
        return
    for label, r in row.items():
        if label != "off" and not label.startswith("fixed"):
            paired = paired_ratios(runs[label], runs[best])
            r["best_fixed"] = best
            r["x_best_fixed"] = statistics.median(paired)
            r["x_best_fixed_ci"] = median_ci(paired)


def median_ci(values: list[float], level: float = 0.95, resamples: int = 2000,
              seed: int = 0) -> list[float]:
    """[low, high]: a bootstrap percentile interval at `level` for the median of `values`
    (seeded, so a table is reproducible from its runs).

    >>> median_ci([1.0, 1.0, 1.0])
    [1.0, 1.0]
    """
    from scipy.stats import bootstrap

    if len(set(values)) == 1:  # no spread to resample (scipy warns on a degenerate sample)
        return [float(values[0])] * 2
    ci = bootstrap((np.asarray(values, dtype=np.float64),), np.median, confidence_level=level,
                   n_resamples=resamples, method="percentile",
                   random_state=np.random.default_rng(seed)
                   ).confidence_interval
    return [float(ci.low), float(ci.high)]


def round_workload(prompts: list[str], n: int, rep: int, temperature: float, max_tokens: int
                   ) -> tuple[list[str], list[SamplingParams]]:
    """Round `rep`'s closed batch of `n` requests: its own prompts (the next `n` of `prompts`,
    wrapping), seeds and lengths (`output_lengths`), served by every arm of the round alike.
    With one batch for every round a cell measured one text at every repeat: where `confidence`
    idled on a few hard requests it did so at each repeat (1 in flight, T = 1: the same 30-step
    idle stretch in every round), and the cell's figure was that text's, not the policy's."""
    batch = [prompts[(rep * n + i) % len(prompts)] for i in range(n)]
    params = [SamplingParams(temperature=temperature, max_tokens=length, ignore_eos=True,
                             seed=rep * n + i)
              for i, length in enumerate(output_lengths(n, max_tokens, seed=rep))]
    return batch, params


def output_lengths(n: int, mean: int, seed: int = 0) -> list[int]:
    """`n` output lengths drawn uniformly from mean/2 .. 3·mean/2 (seeded): requests that do not
    all finish in the same step (`run_policy_bench`).

    >>> output_lengths(4, 32)
    [40, 42, 18, 32]
    """
    rng = random.Random(seed)
    return [rng.randint(max(1, mean // 2), max(1, mean * 3 // 2)) for _ in range(n)]


class _ArmRun:
    """One engine's run of a closed batch at `conc` in flight, step by step (`step` while
    `live`, then `finish`), timing only the engine's own calls: admitting the requests, each
    step, collecting the results. Apart, the steps that ran with every slot busy ("full"): a
    closed batch drains at its end (the last requests run with fewer in flight, ~25-30% of a
    run at 4 in flight), a phase a server under steady load does not have; the full steps
    measure what the heading "N in flight" says."""

    def __init__(self, engine: Engine, conc: int, batch: list[str],
                 params: list[SamplingParams]) -> None:
        self.engine, self.conc = engine, conc
        engine.max_num_seqs = conc
        self.before = engine.stats.as_dict()
        start = time.perf_counter()
        self.ids = [engine.add_request(p, sp) for p, sp in zip(batch, params, strict=False)]
        self.seconds = time.perf_counter() - start
        self.full_seconds, self.full_tokens = 0.0, 0

    @property
    def live(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> float:
        """One engine step; returns its seconds."""
        start = time.perf_counter()
        state = self.engine.step()
        seconds = time.perf_counter() - start
        self.seconds += seconds
        if state is not None and len(state.requests) == self.conc:
            self.full_seconds += seconds
            self.full_tokens += sum(len(s.committed) for s in state.requests)
        return seconds

    def finish(self) -> dict:
        """The run's seconds, tokens, full steps and the engine's counters over it."""
        engine = self.engine
        start = time.perf_counter()
        outs = [engine.result(engine.pop_finished(i)) for i in self.ids]
        self.seconds += time.perf_counter() - start
        after = engine.stats.as_dict()
        return {
            "seconds": self.seconds,
            "tokens": sum(len(o.token_ids) for o in outs),
            "full_seconds": self.full_seconds,
            "full_tokens": self.full_tokens,
            "passes": sum(int(o.stats["target_passes"]) for o in outs),
            **{k: after[k] - self.before[k] for k in
               ("steps", "verified_tokens", "accepted_tokens", "predicted_accepted")},
        }


def _policy_run(engine: Engine, conc: int, batch: list[str], params: list[SamplingParams]) -> dict:
    """One closed batch at `conc` in flight served by `engine` alone (`_ArmRun`)."""
    run = _ArmRun(engine, conc, batch, params)
    while run.live:
        run.step()
    return run.finish()


def _merge_runs(runs: list[dict]) -> dict:
    """Median tokens/s over the repeats (of the whole runs, and of their full steps); counts
    summed over them."""
    total = {k: sum(r[k] for r in runs) for k in runs[0]}
    return {
        "tokens_per_s": statistics.median(_rate(r) for r in runs),
        "tokens_per_s_runs": [_rate(r) for r in runs],
        "tokens_per_s_full": statistics.median(_full_rate(r) for r in runs),
        "full_share": total["full_seconds"] / total["seconds"],
        "mean_accepted_length": total["tokens"] / total["passes"],
        "verified_per_step": total["verified_tokens"] / total["steps"],
        "accepted": total["accepted_tokens"],
        "predicted_accepted": total["predicted_accepted"],
    }


def _rate(run: dict) -> float:
    """A run's tokens/s over the whole batch."""
    return run["tokens"] / run["seconds"]


def _full_rate(run: dict) -> float:
    """Tokens/s over a run's steps with every slot busy (nan if it had none)."""
    return run["full_tokens"] / run["full_seconds"] if run["full_seconds"] > 0 else float("nan")


def _print_policy_table(results: dict) -> None:
    """One line per cell and arm; `x best fixed` (paired, with its 95% interval) for the arms
    that are not a fixed k, against the best fixed k of the cell."""
    print(f"\n{'T':<6}{'reqs':>5} {'policy':<16}{'tok/s':>8}{'x off':>7}{'95% CI':>13}{'full':>8}"
          f"{'x off':>7}{'tau':>6}{'ver/step':>9}{'acc/pred':>9}  x best fixed")
    for setting, by_conc in results.items():
        for conc, arms in by_conc.items():
            for label, r in arms.items():
                ratio = (
                    r["accepted"] / r["predicted_accepted"]
                    if r["predicted_accepted"]
                    else float("nan")
                )
                lo, hi = r["x_off_ci"]
                print(f"{setting:<6}{conc:>5} {label:<16}{r['tokens_per_s']:>8.1f}"
                      f"{r['x_off']:>7.2f}{f'[{lo:.2f},{hi:.2f}]':>13}"
                      f"{r['tokens_per_s_full']:>8.1f}{r['x_off_full']:>7.2f}"
                      f"{r['mean_accepted_length']:>6.2f}"
                      f"{r['verified_per_step']:>9.1f}{ratio:>9.2f}{_vs_best(r)}")


def _vs_best(r: dict) -> str:
    if "x_best_fixed" not in r:
        return ""
    lo, hi = r["x_best_fixed_ci"]
    return f"  {r['x_best_fixed']:.2f} [{lo:.2f},{hi:.2f}] ({r['best_fixed']})"


def _plot_policies(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    rows = (("tokens_per_s", "output tokens/s (whole batch)"),
            ("tokens_per_s_full", "output tokens/s (every slot busy)"))
    for (metric, ylabel), ax_row in zip(rows, axes, strict=False):
        for ax, (setting, by_conc) in zip(ax_row, results.items(), strict=False):
            concs = list(by_conc)
            for label in next(iter(by_conc.values())):
                ax.plot([int(c) for c in concs], [by_conc[c][label][metric] for c in concs],
                        "o-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("requests in flight")
            ax.set_ylabel(ylabel)
            ax.set_title(setting)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
