"""The discrete-event simulation of a fleet: N target replicas, an optional shared draft pool.

Events are a lane beginning a step, its drafts arriving, and its verify pass ending (commit).
Resources are reserved first come, first served:
- each replica's GPU runs one forward at a time: colocated drafting and every verify pass
  (plus the per-step scheduling overhead, for an engine that does not hide it);
- a disaggregated draft pool has `workers` servers; a lane's drafting request travels one hop,
  waits for a free worker, runs, and travels one hop back.
Requests are routed on arrival to the lane with the fewest requests (running + queued), which
admits them at its next step up to `max_num_seqs`, as the engine does.

Example:
    >>> from dspark.coordinator.cost_model import CostModel
    >>> from dspark.coordinator.sim.acceptance import PositionModel
    >>> from dspark.coordinator.sim.workload import Workload
    >>> cfg = FleetConfig(cost=CostModel.linear(0.01, 0.0), policy="off", progress=False)
    >>> res = simulate(cfg, Workload(kind="batch", num_requests=4, prompt_cv=0, output_mean=10,
    ...                output_cv=0), PositionModel())
    >>> round(res.end_time, 6)  # 10 steps of 10 ms, every request in each step
    0.1
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field, replace

import numpy as np
from tqdm import tqdm

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.sim.lane import Lane, Live, StepOutcome, make_sim_policy
from dspark.coordinator.sim.workload import SimRequest, Workload

logger = logging.getLogger(__name__)

BEGIN, DRAFTED, COMMIT, ARRIVAL = 0, 1, 2, 3


@dataclass(frozen=True)
class DraftPool:
    """A shared, disaggregated pool of draft servers."""

    cost: CostModel  # its `draft` table: one draft forward over n requests
    workers: int = 1
    hop_s: float = 0.0  # one-way network latency, coordinator ↔ pool

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}: must be >= 1")
        if self.hop_s < 0:
            raise ValueError(f"hop_s={self.hop_s}: must be >= 0")


@dataclass(frozen=True)
class FleetConfig:
    cost: CostModel  # each replica's step-time curve (verify; draft if colocated)
    policy: str = "confidence"
    gamma: int = 7  # block size γ (ℓ for `fixed`)
    replicas: int = 1
    max_num_seqs: int = 256  # requests running per replica
    lanes: int = 1  # batch loops per replica sharing its GPU
    pool: DraftPool | None = None  # None: drafting on the replica's own GPU
    sequential_drafts: bool = False  # True: a draft model (the policies plan before drafting)
    # The drafter reads the target's hidden rows (DSpark): it drafts nothing for a request whose
    # prompt is in the step's pass, as in the engine
    drafts_from_target: bool = False
    confidence_head: bool = True  # False: confidences from the AcceptanceTracker (a priori)
    overhead_s: float = 0.0  # per step, serial with the GPU (the engine's Python)
    overhead_per_req_s: float = 0.0  # per step and running request
    # (prompt tokens, seconds) points: what a step's prefill costs beyond the verify curve of its
    # anchors and drafts (interpolated, extrapolated linearly). Empty: prompt tokens count as
    # verify tokens, which is right for a roofline but not for a CPU profile measured with a
    # context of 256 per verify token.
    prefill: tuple[tuple[int, float], ...] = ()
    duration_s: float | None = None  # stop at this simulated time; None: when all finish
    max_prefill_tokens: int | None = None  # prompt tokens admitted per step; None: all (engine)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("gamma", "replicas", "max_num_seqs", "lanes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.max_num_seqs < self.lanes:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: below lanes={self.lanes}")


@dataclass(frozen=True)
class RequestRecord:
    index: int
    arrival: float
    first_token: float
    finish: float
    prompt_len: int
    output_len: int


@dataclass
class SimResult:
    config: FleetConfig
    workload: Workload
    requests: list[RequestRecord] = field(default_factory=list)
    steps: list[StepOutcome] = field(default_factory=list)
    last_arrival: float = 0.0
    end_time: float = 0.0


class _Fleet:
    def __init__(self, cfg: FleetConfig, workload: Workload, acceptance) -> None:  # noqa: ANN001
        self.cfg, self.workload, self.acc = cfg, workload, acceptance
        self.rng = np.random.default_rng(cfg.seed)
        self.lanes: list[Lane] = []
        per_lane = cfg.max_num_seqs // cfg.lanes
        # The policies see the replica's verify curve and the drafting curve actually used.
        policy_cost = cfg.cost if cfg.pool is None else replace(
            cfg.pool.cost, key=cfg.cost.key, verify=cfg.cost.verify)
        for rep in range(cfg.replicas):
            for _ in range(cfg.lanes):
                tracker = AcceptanceTracker(max_draft=cfg.gamma)
                policy = make_sim_policy(cfg.policy, cfg.gamma, policy_cost, tracker,
                                         not cfg.confidence_head, cfg.sequential_drafts)
                self.lanes.append(Lane(len(self.lanes), rep, policy, tracker, cfg.gamma,
                                       per_lane, cfg.confidence_head,
                                       drafts_from_target=cfg.drafts_from_target))
        self.queues: list[list[SimRequest]] = [[] for _ in self.lanes]
        self.load = np.zeros(len(self.lanes), dtype=np.int64)
        self.gpu_free = np.zeros(cfg.replicas)
        self.pool_free = [0.0] * (cfg.pool.workers if cfg.pool else 0)
        self.events: list[tuple[float, int, int, int]] = []
        self._seq = 0

    def push(self, t: float, kind: int, arg: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, arg))

    def gpu(self, replica: int, now: float, seconds: float) -> float:
        """Reserve the replica's GPU from `now` (or when it frees); returns the end time."""
        start = max(now, self.gpu_free[replica])
        self.gpu_free[replica] = start + seconds
        return start + seconds

    def draft(self, lane: Lane, now: float, positions: int) -> float:
        """When the lane's drafts are ready (colocated: on its GPU; else on the pool)."""
        n = lane.drafting  # a probe's round drafts a few requests of the batch, not all
        if positions <= 0:
            return now
        # A round of `positions` as the cost model has it, as the policies price it: a draft
        # model's forward per position, a block drafter's block pass then a Markov-head step
        # per further position (`hardware.roofline_cost`).
        pool = self.cfg.pool
        if pool is None:
            return self.gpu(lane.replica, now, self.cfg.cost.draft_time(n, positions))
        at_pool = now + pool.hop_s
        worker = min(range(len(self.pool_free)), key=self.pool_free.__getitem__)
        start = max(at_pool, self.pool_free[worker])
        self.pool_free[worker] = start + pool.cost.draft_time(n, positions)
        return self.pool_free[worker] + pool.hop_s

    def route(self, req: SimRequest, now: float) -> None:
        i = int(np.argmin(self.load))
        self.load[i] += 1
        self.queues[i].append(req)
        lane = self.lanes[i]
        if not lane.busy:
            lane.busy = True
            self.push(now, BEGIN, i)


def simulate(cfg: FleetConfig, workload: Workload, acceptance, trace=None) -> SimResult:  # noqa: ANN001
    """Run the simulation to completion (or `cfg.duration_s`); see the module docstring."""
    fleet = _Fleet(cfg, workload, acceptance)
    stream = workload.requests(seed=cfg.seed, trace=trace)
    res = SimResult(cfg, workload)
    closed = workload.kind == "closed"
    first = stream[: workload.clients] if closed else stream
    next_idx = len(first)
    for req in first:
        fleet.push(req.arrival, ARRIVAL, req.index)
    arrivals: dict[int, SimRequest] = {r.index: r for r in first}
    res.last_arrival = max((r.arrival for r in first), default=0.0)
    bar = tqdm(total=len(stream), desc=f"simulate {cfg.policy}", unit="req",
               disable=not cfg.progress, leave=False)

    def start_state(req: SimRequest) -> object:
        return acceptance.start(req.source, fleet.rng)

    def block_of(states: list) -> object:
        return acceptance.block(states, fleet.rng)

    now = 0.0
    while fleet.events:
        now, _, kind, arg = heapq.heappop(fleet.events)
        if cfg.duration_s is not None and now > cfg.duration_s:
            now = cfg.duration_s
            break
        if kind == ARRIVAL:
            fleet.route(arrivals.pop(arg), now)
            continue
        lane = fleet.lanes[arg]
        if kind == BEGIN:
            lane.admit(fleet.queues[arg], start_state, cfg.max_prefill_tokens)
            if not lane.running:
                lane.busy = False
                continue
            lane.began = now
            positions = lane.begin(block_of, len(fleet.queues[arg]))
            fleet.push(fleet.draft(lane, now, positions), DRAFTED, arg)
        elif kind == DRAFTED:
            lane.drafted_at = now
            seconds = (step_compute(cfg, lane.verify_tokens(), lane.prefill_tokens) + cfg.overhead_s
                       + cfg.overhead_per_req_s * lane.batch_size)
            fleet.push(fleet.gpu(lane.replica, now, seconds), COMMIT, arg)
        else:
            out = lane.commit(now)
            res.steps.append(out)
            for live in out.finished:
                fleet.load[arg] -= 1
                res.requests.append(_record(live, now))
                bar.update()
                if closed and next_idx < len(stream):
                    nxt = SimRequest(next_idx, now, *_lengths(stream[next_idx]))
                    next_idx += 1
                    res.last_arrival = now
                    fleet.route(nxt, now)
            fleet.push(now, BEGIN, arg)
    bar.close()
    res.end_time = now
    logger.info("simulated %d requests, %d steps, %.2f s", len(res.requests), len(res.steps), now)
    return res


def step_compute(cfg: FleetConfig, num_tokens: int, prefill_tokens: int) -> float:
    """GPU seconds of a verify pass of `num_tokens` (B), `prefill_tokens` of them prompt tokens
    beyond each new request's first."""
    if not cfg.prefill or prefill_tokens <= 0:
        return cfg.cost.verify_time(num_tokens)
    xs = np.array([0.0] + [p for p, _ in cfg.prefill])
    ys = np.array([0.0] + [t for _, t in cfg.prefill])
    if prefill_tokens <= xs[-1]:
        extra = float(np.interp(prefill_tokens, xs, ys))
    else:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        extra = float(ys[-1] + slope * (prefill_tokens - xs[-1]))
    return cfg.cost.verify_time(num_tokens - prefill_tokens) + extra


def _lengths(req: SimRequest) -> tuple[int, int, int]:
    return req.prompt_len, req.output_len, req.source


def _record(live: Live, now: float) -> RequestRecord:
    assert live.first_token is not None
    return RequestRecord(live.req.index, live.req.arrival, live.first_token, now,
                         live.req.prompt_len, live.req.output_len)
