"""The policy benchmark's workload: spread output lengths (`dspark.bench.output_lengths`), a new
batch each round (`round_workload`), and the steps with every slot busy."""

from __future__ import annotations

import json
import math

from dspark.bench import output_lengths, round_workload


def test_output_lengths_are_seeded_spread_around_the_mean() -> None:
    lengths = output_lengths(256, 32)
    assert lengths == output_lengths(256, 32)  # every arm of a cell serves the same requests
    assert lengths != output_lengths(256, 32, seed=1)
    assert min(lengths) == 16 and max(lengths) == 48  # mean/2 .. 3·mean/2, both ends reached
    assert abs(sum(lengths) / len(lengths) - 32) < 2  # the mean asked for
    assert output_lengths(3, 1) == [1, 1, 1]  # never below one token


def test_each_round_serves_its_own_prompts_seeds_and_lengths() -> None:
    prompts = [f"p{i}" for i in range(10)]
    first, again = round_workload(prompts, 4, 0, 1.0, 32), round_workload(prompts, 4, 0, 1.0, 32)
    assert first == again  # every arm of a round serves the same requests
    second = round_workload(prompts, 4, 1, 1.0, 32)
    assert first[0] == ["p0", "p1", "p2", "p3"] and second[0] == ["p4", "p5", "p6", "p7"]
    assert round_workload(prompts, 4, 2, 1.0, 32)[0] == ["p8", "p9", "p0", "p1"]  # wraps
    assert [p.seed for p in first[1]] == [0, 1, 2, 3]
    assert [p.seed for p in second[1]] == [4, 5, 6, 7]
    assert [p.max_tokens for p in second[1]] == output_lengths(4, 32, seed=1)
    assert all(p.temperature == 1.0 and p.ignore_eos for p in first[1] + second[1])


def test_full_steps_are_those_with_every_slot_busy(tiny_pair) -> None:
    from dspark.bench import _merge_runs, _policy_run
    from dspark.coordinator.engine import Engine
    from dspark.sampling_params import SamplingParams

    target, drafter = tiny_pair
    engine = Engine(target, proposer="draft-model", drafter=drafter, policy="fixed", k=3)
    prompts = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    # Lengths 4, 12, 20 at 2 in flight: the first two run together, the third joins when the
    # first ends, and it runs on alone once the second ends: full steps, then a drained tail.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 12, 20)]
    run = _policy_run(engine, 2, prompts, params)
    assert run["tokens"] == 36
    assert 0 < run["full_tokens"] < run["tokens"]  # the lone tail is not "2 in flight"
    assert 0 < run["full_seconds"] < run["seconds"]
    merged = _merge_runs([run])
    assert merged["tokens_per_s_full"] == run["full_tokens"] / run["full_seconds"]
    assert 0 < merged["full_share"] < 1
    alone = _policy_run(engine, 3, prompts[:1], params[:1])  # never full: no rate, not zero
    assert alone["full_tokens"] == 0 and math.isnan(_merge_runs([alone])["tokens_per_s_full"])


def test_cheap_cells_run_more_rounds() -> None:
    from dspark.bench import rounds_for

    assert [rounds_for(c, 5) for c in (1, 2, 4, 16, 64)] == [20, 15, 10, 5, 5]
    assert rounds_for(64, 3) == 3 and rounds_for(1, 1) == 4


def test_median_interval_covers_the_median_and_narrows_with_more_rounds() -> None:
    import numpy as np

    from dspark.bench import median_ci

    rng = np.random.default_rng(1)
    few = list(1.0 + 0.1 * rng.standard_normal(5))
    many = list(1.0 + 0.1 * rng.standard_normal(80))
    lo, hi = median_ci(few)
    assert lo <= float(np.median(few)) <= hi
    assert median_ci(few) == [lo, hi]  # seeded: a table is reproducible from its runs
    lo80, hi80 = median_ci(many)
    assert hi80 - lo80 < (hi - lo) / 2  # 16x the rounds: about a quarter of the width
    assert lo80 < 1.0 < hi80  # the true median, at this seed


def test_arms_are_compared_with_the_best_fixed_k_round_by_round() -> None:
    from dspark.bench import _against_best_fixed, best_fixed

    def runs(rates: list[float]) -> list[dict]:
        return [{"tokens": 100 * r, "seconds": 100.0} for r in rates]

    # The machine slows down over the rounds; every arm's rate moves with it.
    drift = [2.0, 1.5, 1.0, 0.8, 0.6]
    versus_k3 = [1.1, 0.9, 0.92, 1.0, 0.95]  # confidence / fixed k = 3, round by round
    rates = {"off": list(drift), "fixed k=3": [1.2 * d for d in drift],
             "fixed k=7": [1.1 * d for d in drift],
             "confidence": [1.2 * d * v for d, v in zip(drift, versus_k3, strict=True)]}
    row = {label: {"x_off": 1.0 if label == "off" else r[0] / rates["off"][0]}
           for label, r in rates.items()}
    cell = {label: runs(r) for label, r in rates.items()}
    assert best_fixed(row) == "fixed k=3"
    _against_best_fixed(row, cell)
    assert row["confidence"]["best_fixed"] == "fixed k=3"
    # Paired: the median of the rounds' ratios, 0.95; the arms' median rates, unpaired, give
    # 1.104 / 1.2 = 0.92.
    assert math.isclose(row["confidence"]["x_best_fixed"], 0.95)
    lo, hi = row["confidence"]["x_best_fixed_ci"]
    assert lo <= 0.95 <= hi and 0.9 <= lo and hi <= 1.1
    assert "x_best_fixed" not in row["fixed k=7"] and "x_best_fixed" not in row["off"]
    # Without `off` (x off unknown) there is no best fixed k to compare with.
    assert best_fixed({"fixed k=3": {"x_off": math.nan}}) is None


def test_policy_bench_writes_each_arms_trace_per_cell_without_the_warm_up(tmp_path) -> None:
    from dspark.bench import output_lengths, rounds_for, run_policy_bench, trace_name
    from dspark.coordinator.trace import read_trace, steps_by_budget

    arms = ("off", "fixed k=3")
    run_policy_bench(concurrencies=(1,), temperatures=(0.0,), max_tokens=4, repeats=1,
                     arms=arms, out_dir=tmp_path, trace_dir=tmp_path / "traces")
    assert json.loads((tmp_path / "bench_policies.json").read_text())["schedule"] == (
        "turns of 20 ms")  # in process: the arms serve each round together
    served = sum(sum(output_lengths(8, 4, seed=rep)) for rep in range(rounds_for(1, 1)))
    for label in arms:
        trace = read_trace(tmp_path / "traces" / trace_name(0.0, 1, label))
        assert trace.meta["arm"] == label and trace.meta["in_flight"] == 1
        assert sum(sum(s.committed) for s in trace.steps) == served  # warm-up left out
        kinds = {r.kind for r in steps_by_budget(trace)}
        if label == "off":
            assert kinds == {"prefill", "K=0"}
        else:  # k = 3, fewer only where a request has fewer tokens left
            assert "K=3" in kinds and kinds <= {"prefill", "K=0", "K=1", "K=2", "K=3"}


def test_arms_of_a_round_take_steps_in_turn_and_serve_what_they_serve_alone(tiny_pair) -> None:
    import time

    from dspark.bench import _policy_run, stepwise_round
    from dspark.coordinator.engine import Engine
    from dspark.sampling_params import SamplingParams

    target, drafter = tiny_pair

    def engines() -> dict[str, Engine]:
        return {"off": Engine(target, proposer="none", policy="off"),
                "k=3": Engine(target, proposer="draft-model", drafter=drafter, policy="fixed",
                              k=3)}

    prompts = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate((4, 12, 20))]
    together = engines()
    calls: list[str] = []
    for label, engine in together.items():
        def step(engine: Engine = engine, label: str = label) -> object:
            calls.append(label)
            return type(engine).step(engine)
        engine.step = step  # type: ignore[method-assign]
    start = time.perf_counter()
    runs = stepwise_round(together, 2, prompts, params, turn_seconds=0.0)  # a step a turn
    wall = time.perf_counter() - start
    alone = {label: _policy_run(e, 2, prompts, params) for label, e in engines().items()}
    for label, run in runs.items():
        # Taking turns changes no engine's work: the same steps, tokens and passes (sampled,
        # seeded: the same draws) as the engine serving the batch alone.
        for key in ("tokens", "steps", "passes", "verified_tokens", "accepted_tokens"):
            assert run[key] == alone[label][key], (label, key)
        assert 0 < run["seconds"]
    assert sum(r["seconds"] for r in runs.values()) <= wall  # each counts its own calls only
    # While both are live they alternate, the first of each turn rotating; `off`, with more
    # steps to take, finishes alone.
    both = 2 * runs["k=3"]["steps"]
    assert calls[:both:2] == ["off", "k=3"] * (both // 4) + ["off"] * (both // 2 % 2)
    assert all(calls[i] != calls[i + 1] for i in range(0, both, 2))
    assert calls[both:] == ["off"] * (runs["off"]["steps"] - runs["k=3"]["steps"])
    # A turn lasts `turn_seconds` of the engine's own steps: one longer than any run is a
    # whole run, the first engine's first.
    calls.clear()
    runs = stepwise_round(together, 2, prompts, params, turn_seconds=3600.0)
    assert calls == ["off"] * runs["off"]["steps"] + ["k=3"] * runs["k=3"]["steps"]


def test_an_unknown_arm_is_named_before_any_engine_is_built() -> None:
    import pytest

    from dspark.bench import policy_engines

    with pytest.raises(ValueError, match=r"arms=\['fixed k=9'\]: choose from \['off'"):
        policy_engines("dspark", ("off", "fixed k=9"), 4)
