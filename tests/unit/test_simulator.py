"""The fleet simulator (coordinator/sim): cases with analytic answers, queueing laws, the
engine's own policies, trace replay, and the oracle bound. No wall-clock assertions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark.coordinator import policy as policy_module
from dspark.coordinator import scheduler
from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.engine import Engine
from dspark.coordinator.sim.acceptance import Block, PositionModel, TraceReplay
from dspark.coordinator.sim.fleet import DraftPool, FleetConfig, simulate
from dspark.coordinator.sim.hardware import roofline_cost
from dspark.coordinator.sim.lane import OraclePolicy, make_sim_policy
from dspark.coordinator.sim.report import littles_law, summarize, window
from dspark.coordinator.sim.workload import Workload
from dspark.coordinator.trace import TraceRecorder
from dspark.kernels.budget import allocate
from dspark.sampling_params import SamplingParams

STEP = 0.01  # seconds: a constant step time


def constant(step: float = STEP) -> CostModel:
    return CostModel.linear(step, 0.0)


def fixed_batch(n: int, output: int, prompt: int = 16) -> Workload:
    return Workload(kind="batch", num_requests=n, prompt_mean=prompt, prompt_cv=0,
                    output_mean=output, output_cv=0)


def test_off_with_constant_step_time_is_exact() -> None:
    # One token per request per step, all requests every step: L steps of STEP seconds.
    cfg = FleetConfig(cost=constant(), policy="off", max_num_seqs=8, progress=False)
    res = simulate(cfg, fixed_batch(4, 10), PositionModel())
    s = summarize(res)
    assert res.end_time == pytest.approx(10 * STEP)
    assert s["throughput_tok_s"] == pytest.approx(4 * 10 / (10 * STEP))
    assert s["ttft_s"]["p99"] == pytest.approx(STEP) and s["ttft_s"]["p50"] == pytest.approx(STEP)
    assert s["tpot_s"]["p50"] == pytest.approx(STEP) and s["tpot_s"]["p99"] == pytest.approx(STEP)
    assert s["tau"] == 1.0 and s["verified_per_request_step"] == 1.0


def test_second_wave_waits_for_the_first() -> None:
    # max_num_seqs = 2: requests 3 and 4 start when 1 and 2 finish, after 10 steps.
    cfg = FleetConfig(cost=constant(), policy="off", max_num_seqs=2, progress=False)
    res = simulate(cfg, fixed_batch(4, 10), PositionModel())
    assert res.end_time == pytest.approx(20 * STEP)
    ttfts = sorted(r.first_token - r.arrival for r in res.requests)
    assert ttfts == pytest.approx([STEP, STEP, 11 * STEP, 11 * STEP])


def test_fixed_policy_with_certain_acceptance_commits_k_plus_one() -> None:
    # c* = 1 everywhere: every verified draft is accepted, so each step commits k + 1 tokens.
    certain = PositionModel(gamma=3, base=(1.0, 1.0, 1.0), sigma_req=0, sigma_step=0,
                            sigma_head=0, has_head=False)
    cfg = FleetConfig(cost=constant(), policy="fixed", gamma=3, max_num_seqs=4, progress=False)
    res = simulate(cfg, fixed_batch(2, 9), certain)
    # Caps keep the last step within the output: 4 + 4 + 1 tokens, three steps.
    assert len(res.steps) == 3 and res.end_time == pytest.approx(3 * STEP)
    assert summarize(res)["tau"] == pytest.approx(3.0)


def test_littles_law_at_steady_state() -> None:
    cost = CostModel.linear(0.004, 0.0001)
    cfg = FleetConfig(cost=cost, policy="confidence", gamma=4, replicas=2, max_num_seqs=64,
                      progress=False)
    wl = Workload(kind="poisson", num_requests=1500, rate=150.0, prompt_mean=32,
                  output_mean=24)
    res = simulate(cfg, wl, PositionModel(gamma=4))
    t0, t1 = window(res, 0.2)
    occupancy, lam_w = littles_law(res, t0, t1)
    assert occupancy == pytest.approx(lam_w, rel=0.08)


def test_more_replicas_never_lower_throughput_at_saturation() -> None:
    cost = roofline_cost("a100")
    wl = Workload(kind="closed", clients=256, num_requests=512, prompt_mean=64, output_mean=32)
    tput = []
    for replicas in (1, 2, 4):
        cfg = FleetConfig(cost=cost, policy="confidence", gamma=5, replicas=replicas,
                          max_num_seqs=64, progress=False)
        tput.append(summarize(simulate(cfg, wl, PositionModel(gamma=5)))["throughput_tok_s"])
    assert tput[0] <= tput[1] <= tput[2]
    assert tput[2] > 2.5 * tput[0]  # 64 running per replica is far from 256 users: near-linear


@pytest.mark.parametrize("name, cls", [
    ("equal", scheduler.EqualPolicy), ("confidence-sync", scheduler.ConfidenceSyncPolicy),
    ("confidence", scheduler.ConfidencePolicy), ("off", policy_module.OffPolicy),
    ("fixed", policy_module.FixedPolicy),
])
def test_simulated_policies_are_the_engines_classes(name: str, cls: type) -> None:
    p = make_sim_policy(name, 4, constant(), AcceptanceTracker(4), True, False)
    assert type(p) is cls  # the scheduler's own class, not a copy
    cfg = FleetConfig(cost=constant(), policy=name, gamma=4, progress=False)
    from dspark.coordinator.sim.fleet import _Fleet

    assert all(type(lane.policy) is cls for lane in _Fleet(cfg, fixed_batch(1, 2), None).lanes)


def test_oracle_allocation_is_never_worse_for_the_same_budget() -> None:
    # Top-K of the true survivals maximises the expected accepted drafts for any K; the
    # confidence policy allocates by the head's noisy estimate instead.
    model = PositionModel(gamma=5, sigma_head=0.8)
    rng = np.random.default_rng(3)
    for _ in range(40):
        block = model.block([model.start(0, rng) for _ in range(6)], rng)
        limits = torch.full((6,), 5, dtype=torch.long)
        for k in (1, 4, 9, 17):
            est = allocate(torch.from_numpy(block.reported), limits, k).numpy()
            best = allocate(torch.from_numpy(block.true_c), limits, k).numpy()
            assert block.expected_accepted(best) >= block.expected_accepted(est) - 1e-12


@pytest.fixture(scope="module")
def engine_trace():
    rec = TraceRecorder(meta={"proposer": "ngram", "policy": "fixed", "k": 3})
    engine = Engine(proposer="ngram", policy="fixed", k=3, max_num_seqs=2, trace=rec)
    prompts = ["def f(x):\n    return x\n\ndef f(", "import os\nimport os\nimport ",
               "for i in range(10):\n    for i in range(", "class A:\n    pass\n\nclass "]
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return rec.trace()


def test_replaying_a_trace_with_its_policy_reproduces_the_run(engine_trace) -> None:
    n = len(engine_trace.requests())
    cfg = FleetConfig(cost=constant(), policy="fixed", gamma=3, max_num_seqs=2,
                      confidence_head=False, progress=False)
    res = simulate(cfg, Workload(kind="batch", num_requests=n), TraceReplay(engine_trace, 3),
                   trace=engine_trace)
    assert len(res.steps) == len(engine_trace.steps)
    assert [s.num_tokens for s in res.steps] == [s.num_tokens for s in engine_trace.steps]
    assert [s.accepted for s in res.steps] == [sum(s.accepted) for s in engine_trace.steps]
    assert [s.committed for s in res.steps] == [sum(s.committed) for s in engine_trace.steps]


def test_oracle_beats_confidence_on_the_same_replayed_trace(engine_trace) -> None:
    # Per verified draft, the oracle's plans are expected to be accepted at least as often.
    precision = {}
    for name in ("confidence", "oracle"):
        cfg = FleetConfig(cost=CostModel.linear(0.01, 0.002), policy=name, gamma=3,
                          max_num_seqs=4, confidence_head=False, progress=False)
        wl = Workload(kind="batch", num_requests=16)
        res = simulate(cfg, wl, TraceReplay(engine_trace, 3), trace=engine_trace)
        planned = sum(s.planned for s in res.steps)
        precision[name] = sum(s.expected_accepted for s in res.steps) / max(1, planned)
    assert precision["oracle"] >= precision["confidence"]
    assert isinstance(make_sim_policy("oracle", 3, constant(), AcceptanceTracker(3), False, False),
                      OraclePolicy)


def test_network_hop_adds_to_every_step() -> None:
    # Disaggregated drafting on one lane: each step waits two hops plus the pool's draft time.
    cost = CostModel.linear(STEP, 0.0, draft_fixed=0.002)
    base = FleetConfig(cost=cost, policy="fixed", gamma=2, max_num_seqs=4, progress=False)
    certain = PositionModel(gamma=2, base=(1.0, 1.0), sigma_req=0, sigma_step=0)
    wl = fixed_batch(1, 9)  # 3 steps of 3 tokens
    colocated = simulate(base, wl, certain).end_time
    pool = DraftPool(cost, workers=1, hop_s=0.005)
    remote = simulate(FleetConfig(**{**base.__dict__, "pool": pool}), wl, certain).end_time
    round_s = cost.draft_time(1, 2)  # two positions of 2 ms: a forward-only profile's round
    assert round_s == pytest.approx(0.004)
    assert colocated == pytest.approx(3 * (STEP + round_s))
    assert remote == pytest.approx(3 * (STEP + round_s + 2 * 0.005))


def test_block_accepts_the_leading_run_only() -> None:
    block = Block(true_c=np.array([[0.9, 0.9, 0.9]]), reported=None,
                  uniforms=np.array([[0.1, 0.95, 0.1]]))
    assert block.accepted(np.array([3])).tolist() == [1]
    assert block.accepted(np.array([0])).tolist() == [0]
    assert block.expected_accepted(np.array([2])) == pytest.approx(0.9 + 0.81)


def test_workload_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="kind"):
        Workload(kind="weekly")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rate"):
        Workload(kind="poisson", rate=0)
    # The bursty process keeps the mean rate (bursts of 2 s average out over seeds) ...
    runs = [Workload(kind="bursty", num_requests=20000, rate=50.0).requests(seed=s)
            for s in range(10)]
    assert np.mean([20000 / r[-1].arrival for r in runs]) == pytest.approx(50.0, rel=0.08)
    # ... and its gaps vary more than a Poisson process's (coefficient of variation 1).
    gaps = np.diff([r.arrival for r in runs[0]])
    assert gaps.std() / gaps.mean() > 1.1


def test_seeded_runs_are_deterministic() -> None:
    cfg = FleetConfig(cost=roofline_cost("h200"), policy="confidence", gamma=5, replicas=2,
                      max_num_seqs=32, seed=7, progress=False)
    wl = Workload(kind="poisson", num_requests=120, rate=200.0, prompt_mean=64, output_mean=32)
    a, b = (simulate(cfg, wl, PositionModel(gamma=5)) for _ in range(2))
    assert a.requests == b.requests
    assert [(s.end, s.planned, s.accepted) for s in a.steps] == [
        (s.end, s.planned, s.accepted) for s in b.steps]


def test_prefill_admission_limit_spreads_new_prompts_over_steps() -> None:
    # 4 prompts of 100 tokens, at most 250 prompt tokens admitted per step: 2 + 2 requests.
    cfg = FleetConfig(cost=constant(), policy="off", max_num_seqs=8, max_prefill_tokens=250,
                      progress=False)
    res = simulate(cfg, fixed_batch(4, 5, prompt=100), PositionModel())
    ttfts = sorted(r.first_token for r in res.requests)
    assert ttfts == pytest.approx([STEP, STEP, 2 * STEP, 2 * STEP])


def test_a_block_drafters_round_is_charged_as_the_policies_price_it() -> None:
    # Regression: the clock charged a DSpark round one block pass whatever its depth, while the
    # policies priced a forward per position (a roofline without `draft_first`), so simulated
    # `confidence` cut its blocks short where a deeper one was nearly free (0.78-0.89x fixed
    # k = 7 at 1-16 users on an H200).
    from dspark.coordinator.sim.hardware import DRAFT_DSPARK, GPUS, forward_time, markov_step_time

    cost = roofline_cost("h200", block_size=7)
    first, each = cost.draft_costs(16)
    h200 = GPUS["h200"]
    assert first == pytest.approx(forward_time(h200, DRAFT_DSPARK, 16 * 7)
                                  + markov_step_time(h200, 16))
    assert each == pytest.approx(markov_step_time(h200, 16)) and each < 0.1 * first
    # One request, every draft accepted: two steps of 8 tokens (16-token prompt), each paying
    # the round the cost model gives.
    certain = PositionModel(gamma=7, base=(1.0,) * 7, sigma_req=0, sigma_step=0, sigma_head=0,
                            has_head=False)
    cfg = FleetConfig(cost=cost, policy="fixed", gamma=7, max_num_seqs=4, progress=False)
    res = simulate(cfg, fixed_batch(1, 16), certain)
    assert len(res.steps) == 2
    assert res.end_time == pytest.approx(2 * cost.draft_time(1, 7) + cost.verify_time(16 + 7)
                                         + cost.verify_time(1 + 7))


def test_confidence_verifies_whole_blocks_where_they_are_nearly_free() -> None:
    # A memory-bound verify pass and a round whose further positions cost a Markov-head step
    # each: at 4 users the budget should verify about as deep as fixed k = 7 and run as fast.
    cost = roofline_cost("h200", block_size=7)
    wl = Workload(kind="closed", clients=4, num_requests=8, prompt_mean=64, output_mean=64)
    tput = {}
    for name in ("fixed", "confidence"):
        cfg = FleetConfig(cost=cost, policy=name, gamma=7, max_num_seqs=64, progress=False)
        s = summarize(simulate(cfg, wl, PositionModel(gamma=7)))
        tput[name] = s["throughput_tok_s"]
        if name == "confidence":
            assert s["verified_per_request_step"] > 7.0
    assert tput["confidence"] >= 0.97 * tput["fixed"]


def test_simulate_cli_takes_fixed_k_arms_and_refuses_others() -> None:
    import argparse

    from dspark.coordinator.sim.cli import configs

    a = argparse.Namespace(policy="off,fixed=1,fixed=3,fixed,confidence", gamma=7, load="1,64")
    arms, loads = configs(a)
    assert arms == [("off", "off", 7), ("fixed=1", "fixed", 1), ("fixed=3", "fixed", 3),
                    ("fixed", "fixed", 7), ("confidence", "confidence", 7)]
    assert loads == [1.0, 64.0]
    for bad in ("fixed=0", "fixed=8", "fixed=x", "equal=2", "greedy"):
        with pytest.raises(ValueError, match="policy="):
            configs(argparse.Namespace(policy=bad, gamma=7, load="1"))
