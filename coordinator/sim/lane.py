"""One simulated batch loop (a lane of a target replica), driven by the engine's own policies.

A lane is what `Engine.step` is, minus the models: admit, ask the policy for draft lengths, draft
(on the replica's GPU, or on the shared draft pool behind a network hop), let the policy choose K
and ℓ from `Drafts` built like the engine's (confidences from the head, else the engine's
`AcceptanceTracker`), verify B = Σ (uncached + ℓ_r) tokens, commit A_r + 1 tokens per request,
feed a `StepState` back to the tracker and the policy. The policy objects are
`dspark.coordinator.scheduler.make_policy`'s, so the simulator schedules exactly as the engine
does; `oracle` (below) is the one policy only the simulator has.

A replica normally has one lane. With a disaggregated draft pool it can run two: while one lane
waits for its drafts, the other verifies, so the GPU is not idle during the network hop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.policy import Policy
from dspark.coordinator.scheduler import ConfidencePolicy, make_policy
from dspark.coordinator.sim.acceptance import Block
from dspark.coordinator.sim.workload import SimRequest
from dspark.coordinator.stale_history import survivals_of
from dspark.kernels.budget import allocate
from dspark.messages import Drafts, RequestStep, StepState

SIM_POLICIES = ("off", "fixed", "equal", "confidence-sync", "confidence", "oracle")


class OraclePolicy(ConfidencePolicy):
    """The bound: K and the allocation both from the *true* survivals, known before drafting.

    The simulator hands it c* (not the head's estimate) as confidences. It is not lossless in a
    real engine (it would need the target's verdict in advance); it measures how much expected
    acceptance `confidence` leaves on the table with stale K and noisy confidences.
    """

    name = "oracle"

    def draft_lengths(self, caps: list[int], req_ids: tuple[str, ...], sampled: bool = False,
                      backlog: list[int] | None = None, prompt_tokens: int = 0,
                      queued: int | None = None) -> list[int]:
        self._planned = None
        return [min(self.gamma, c) for c in caps]

    def plan_from(self, req_ids, confidences, limits, budget=None):  # noqa: ANN001, ANN201
        k = self.best_budget(survivals_of(confidences), limits)
        counts = allocate(confidences, torch.tensor(limits, dtype=torch.long), k)
        return k, counts.tolist()


def make_sim_policy(name: str, gamma: int, cost: CostModel, tracker: AcceptanceTracker,
                    a_priori: bool, sequential_drafts: bool) -> Policy:
    """The engine's policy of that name (`make_policy`), or `oracle`."""
    if name == "oracle":
        return OraclePolicy(gamma, cost, tracker, False, sequential_drafts)
    return make_policy(name, gamma, cost, tracker, a_priori=a_priori,
                       sequential_drafts=sequential_drafts)


@dataclass
class Live:
    """A request running in a lane."""

    req: SimRequest
    rid: str
    acc_state: object
    output: int = 0
    prefilled: bool = False
    first_token: float | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What one lane step did (the simulator's step record)."""

    end: float
    replica: int
    num_reqs: int
    num_tokens: int  # B
    planned: int  # Σ ℓ_r
    accepted: int  # Σ A_r
    committed: int  # tokens appended
    expected_accepted: float  # Σ a*_{r,j} over the plan (true survivals)
    budget: int
    finished: tuple[Live, ...]


@dataclass
class Lane:
    """Mutable per-lane state; the simulator calls `begin`, `verify`, `commit` in turn."""

    index: int
    replica: int
    policy: Policy
    tracker: AcceptanceTracker
    gamma: int
    max_num_seqs: int
    confidence_head: bool
    # The drafter reads the target's hidden rows (DSpark): like the engine (`Engine._draft_cap`),
    # it drafts nothing for a request whose prompt is in this step's pass
    drafts_from_target: bool = False
    running: dict[str, Live] = field(default_factory=dict)
    busy: bool = False
    # Between begin and commit:
    _reqs: list[Live] = field(default_factory=list)
    _lengths: list[int] = field(default_factory=list)
    _block: Block | None = None
    _planned: list[int] | None = None
    _budget: int = 0
    _num_tokens: int = 0
    prefill_tokens: int = 0  # of the step's pass (`begin`): prompt tokens past each new one's first
    began: float = 0.0  # simulated time the step under way began (`begin`)
    drafted_at: float = 0.0  # ... and its drafts were ready

    @property
    def batch_size(self) -> int:
        """Requests in the step under way (between `begin` and `commit`)."""
        return len(self._reqs)

    def admit(self, queue: list[SimRequest], start_state,  # noqa: ANN001
              max_prefill: int | None = None) -> None:
        """Start queued requests up to `max_num_seqs`; with `max_prefill`, only as many new
        prompts as fit that many tokens (at least one): chunked prefill, roughly."""
        budget = max_prefill
        admitted = 0
        while queue and len(self.running) < self.max_num_seqs:
            if budget is not None and admitted and queue[0].prompt_len > budget:
                break
            req = queue.pop(0)
            admitted += 1
            if budget is not None:
                budget -= req.prompt_len
            rid = f"r{req.index}"
            self.running[rid] = Live(req, rid, start_state(req))

    @property
    def drafting(self) -> int:
        """Requests of the step under way that draft (after `begin`)."""
        return sum(1 for n in self._lengths if n > 0)

    def begin(self, block_of, queued: int | None = None) -> int:  # noqa: ANN001
        """Plan drafting for the running requests, `queued` more waiting for a place (as the
        engine tells its policy); returns the round's depth (positions)."""
        self._reqs = list(self.running.values())
        ids = tuple(x.rid for x in self._reqs)
        caps = [0 if self.drafts_from_target and not x.prefilled
                else max(0, x.req.output_len - x.output - 1) for x in self._reqs]
        # As the engine does, the policy learns what the pass carries beyond one token a
        # request: the prompts being prefilled (their time is paid whatever it plans).
        self.prefill_tokens = sum(x.req.prompt_len - 1 for x in self._reqs if not x.prefilled)
        self._lengths = self.policy.draft_lengths(caps, ids, prompt_tokens=self.prefill_tokens,
                                                  queued=queued)
        self._block = block_of([x.acc_state for x in self._reqs])
        if self._block.max_drafts is not None:
            caps = self._block.max_drafts.tolist()
            self._lengths = [min(n, m) for n, m in zip(self._lengths, caps, strict=True)]
        self._planned = None
        if isinstance(self.policy, OraclePolicy):
            # The oracle knows c* before drafting: it drafts only what it will verify.
            self._plan(ids)
            self._lengths = list(self._planned)
        return max(self._lengths, default=0)

    def _drafts(self, ids: tuple[str, ...]) -> Drafts:
        n, width = len(ids), max(self._lengths, default=0)
        assert self._block is not None
        if isinstance(self.policy, OraclePolicy):
            conf = torch.from_numpy(self._block.true_c[:, :width])
        elif self.confidence_head and self._block.reported is not None:
            conf = torch.from_numpy(self._block.reported[:, :width])
        else:
            conf = None
        drafts = Drafts(ids, torch.zeros(n, width, dtype=torch.long),
                        torch.tensor(self._lengths, dtype=torch.long), None, conf)
        return self.tracker.fill(drafts)

    def _plan(self, ids: tuple[str, ...]) -> None:
        drafts = self._drafts(ids)
        self._budget = self.policy.choose_budget(drafts)
        self._planned = list(self.policy.plan_verification(drafts, self._budget))

    def verify_tokens(self) -> int:
        """Plan verification (K, ℓ) after drafting; returns B, the verify pass's tokens."""
        if self._planned is None:
            self._plan(tuple(x.rid for x in self._reqs))
        assert self._planned is not None
        self._num_tokens = sum((1 if x.prefilled else x.req.prompt_len) + ell
                               for x, ell in zip(self._reqs, self._planned, strict=True))
        return self._num_tokens

    def commit(self, now: float) -> StepOutcome:
        """Apply the target's verdict: A_r + 1 tokens each, never past the output length."""
        assert self._block is not None and self._planned is not None
        planned = np.asarray(self._planned, dtype=int)
        accepted = self._block.accepted(planned)
        expected = self._block.expected_accepted(planned)
        steps, finished, committed_total = [], [], 0
        rows = zip(self._reqs, self._lengths, self._planned, accepted.tolist(), strict=True)
        for x, drafted, ell, a in rows:
            committed = min(a + 1, x.req.output_len - x.output)
            x.output += committed
            committed_total += committed
            if x.first_token is None:
                x.first_token = now
            x.prefilled = True
            done = x.output >= x.req.output_len
            steps.append(RequestStep(x.rid, drafted, ell, a, (0,) * committed, 0,
                                     "length" if done else None))
            if done:
                finished.append(self.running.pop(x.rid))
        state = StepState(0, self._budget, tuple(steps))
        self.tracker.observe(state)
        self.policy.observe(state)
        # The step's simulated times, as the engine times its own (the policy's online fit of
        # step times and its price of time read them)
        self.policy.observe_time(now - self.began, self._num_tokens, self.drafted_at - self.began,
                                 now - self.drafted_at)
        out = StepOutcome(now, self.replica, len(self._reqs), self._num_tokens, int(planned.sum()),
                          int(accepted.sum()), committed_total, expected, self._budget,
                          tuple(finished))
        self._reqs, self._block, self._planned = [], None, None
        return out
