"""The in-process engine: continuous batching around one speculative step loop (DESIGN.md §2).

    drafts = proposer.propose(queries)           # γ_r per request
    K      = policy.choose_budget(drafts)
    ℓ      = policy.plan_verification(drafts, K)
    result = target.verify(plan)                 # one varlen forward + acceptance
    state  = commit(...)                         # the only state change
    rollback both caches; release finished requests

Every step feeds each request's uncached committed tokens and its admitted drafts, so a new
request's prefill and a running request's verify block share the same batch.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from dspark.coordinator.commit import commit
from dspark.coordinator.confidence import AcceptanceTracker
from dspark.coordinator.cost_model import CostModel
from dspark.coordinator.policy import Policy
from dspark.coordinator.profiler import load_or_profile
from dspark.coordinator.request import GenerationResult, Request
from dspark.coordinator.scheduler import POLICY_NAMES, make_policy
from dspark.coordinator.stale_history import survivals_of
from dspark.coordinator.trace import TraceRecorder
from dspark.demo import demo_path
from dspark.draft_worker.draft_model import DraftModelProposer
from dspark.draft_worker.dspark_proposer import DSparkProposer
from dspark.draft_worker.ngram import NgramProposer
from dspark.draft_worker.proposer import NoProposer, Proposer
from dspark.faults import WorkerLost
from dspark.messages import DraftQuery, Drafts, NewRequest, StepState, VerifyPlan, VerifyResult
from dspark.models.config import ModelConfig
from dspark.models.device import resolve_device
from dspark.models.tokenizer import Tokenizer
from dspark.sampling_params import SamplingParams
from dspark.target_worker.runner import TargetRunner

logger = logging.getLogger(__name__)

PROPOSERS = ("dspark", "draft-model", "ngram", "none")
DEFAULT_PROPOSER = "dspark"  # the shipped DSpark drafter: highest τ of the demo drafters
# Drafts per request per step when k is not given: DSpark's one block pass costs the same for
# its whole block (γ = 7) as for fewer; a sequential draft model pays per position.
DEFAULT_K = {"dspark": 7}


def drafter_dir(proposer: str, drafter: str | Path | None) -> Path | None:
    """The checkpoint of a proposer that has one: `drafter`, else the shipped demo one."""
    if proposer not in ("dspark", "draft-model"):
        return None
    return Path(drafter) if drafter is not None else demo_path(proposer)


class TargetWorker(Protocol):
    """What the coordinator needs from the target side, local or behind Ray."""

    config: ModelConfig
    max_model_len: int
    num_blocks: int

    def add_request(self, new: NewRequest) -> None: ...

    def verify(self, plan: VerifyPlan) -> VerifyResult: ...

    def rollback(self, lengths: dict[str, int]) -> None: ...

    def release(self, req_id: str) -> None: ...

    def usage(self) -> dict[str, object]: ...

    def recover(self) -> None:
        """After `verify` raised WorkerLost: bring the workers back with no requests, or raise
        WorkersUnavailable."""


Prompt = str | Sequence[int]


@dataclass(frozen=True)
class StepRecord:
    """What the scheduler planned in one step and what the target then accepted."""

    step: int
    budget: int  # K
    planned: tuple[int, ...]  # ℓ_r
    predicted_accepted: float  # Σ_r Σ_{j≤ℓ_r} a_{r,j} from the confidences used to plan
    accepted: int  # Σ_r A_r


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0
    busy_seconds: float = 0.0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    predicted_accepted: float = 0.0
    recent: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=1024))

    def as_dict(self) -> dict[str, float]:
        return {
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "busy_seconds": round(self.busy_seconds, 4),
            "verified_tokens": self.verified_tokens,
            "accepted_tokens": self.accepted_tokens,
            "predicted_accepted": round(self.predicted_accepted, 3),
            "tokens_per_step": self.generated_tokens / max(1, self.steps),
        }


class Engine:
    """Lossless speculative decoding in one process.

    Example:
        >>> from dspark import Engine, SamplingParams
        >>> engine = Engine(proposer="ngram", policy="fixed", k=3)
        >>> out = engine.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=8))
        >>> len(out[0].token_ids) <= 8
        True
    """

    def __init__(
        self,
        target: str | Path | None = None,
        proposer: str | None = None,
        drafter: str | Path | None = None,
        policy: str | None = None,
        k: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        max_num_seqs: int = 64,
        num_blocks: int = 4096,
        block_size: int = 16,
        seed: int = 0,
        cost_model: CostModel | str | Path | None = None,
        profile_dir: str | Path | None = None,  # default: ~/.cache/dspark/cost, read per call
        workers: tuple[TargetWorker, Proposer] | None = None,
        trace: TraceRecorder | None = None,
        device: str | None = None,  # in-process workers: "cpu", "cuda[:N]"; None: CUDA if any
    ) -> None:
        target_dir = Path(target) if target is not None else demo_path("target")
        proposer = proposer or DEFAULT_PROPOSER
        if proposer not in PROPOSERS:
            raise ValueError(f"proposer={proposer!r}: choose one of {list(PROPOSERS)}")
        # `confidence` by default: on the demo models it is within a few percent of the best
        # fixed k where speculation pays and stops verifying where it does not (README).
        policy = policy or ("off" if proposer == "none" else "confidence")
        k = DEFAULT_K.get(proposer, 4) if k is None else k
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1")
        self.tokenizer = Tokenizer(target_dir)
        if workers is not None:
            # Remote workers (Ray actor pools) speak the same verbs as the local ones; each
            # actor takes the GPU its placement group gave it.
            if device is not None:
                raise ValueError(f"device={device!r}: remote workers choose their own device")
            self.target, self.proposer = workers
        else:
            device = resolve_device(device)
            self.proposer = self._make_proposer(
                proposer, drafter, target_dir, num_blocks, block_size, dtype, device
            )
            hidden_layers = tuple(getattr(self.proposer, "hidden_layers", ()))
            self.target = TargetRunner(
                target_dir, num_blocks, block_size, dtype, device, hidden_layers
            )
        self._check_vocab()
        self.tracker = AcceptanceTracker(max_draft=k)
        self.cost_model = self._cost_model(policy, cost_model, target_dir, drafter, profile_dir, k)
        self.policy: Policy = make_policy(
            policy, k, self.cost_model, self.tracker,
            a_priori=not getattr(self.proposer, "has_confidence_head", False),
            sequential_drafts=getattr(self.proposer, "sequential_drafts", False),
        )
        # The drafter reads the target's hidden rows of every committed position (DSpark): it
        # drafts nothing for a request until a target pass has taken in its prompt. Under `off`
        # nothing ever drafts, and rows kept for it would pile up until each request ends
        # (3 layers x 4,096 floats a token for a 7B-class target: 48 kB a token).
        self._drafts_from_target = (bool(getattr(self.proposer, "hidden_layers", ()))
                                    and self.policy.name != "off")
        self.max_k = k
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        self.max_model_len = self.target.max_model_len
        draft_len = getattr(self.proposer, "max_model_len", None)
        if draft_len is not None:
            self.max_model_len = min(self.max_model_len, draft_len)
        eos = set(self.target.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.stats = EngineStats()
        self.trace = trace  # optional step recorder (coordinator/trace.py)
        self._waiting: list[Request] = []
        self._running: dict[str, Request] = {}
        self._finished: dict[str, Request] = {}
        self._sent_to_drafter: dict[str, int] = {}
        self._pending_hidden: dict[str, list[torch.Tensor]] = {}
        self._ids = itertools.count()
        self._seeds = random.Random(seed)
        self._step_no = 0
        self._reserved_blocks = 0

    def _make_proposer(
        self, name: str, drafter: str | Path | None, target_dir: Path, num_blocks: int,
        block_size: int, dtype: torch.dtype, device: str,
    ) -> Proposer:
        if name == "none":
            return NoProposer()
        if name == "ngram":
            return NgramProposer()
        path = drafter_dir(name, drafter)
        assert path is not None, name
        if name == "dspark":
            return DSparkProposer(path, target_dir, num_blocks, block_size, dtype, device)
        return DraftModelProposer(path, num_blocks, block_size, dtype, device)

    def _cost_model(self, policy: str, given: CostModel | str | Path | None, target_dir: Path,
                    drafter: str | Path | None, profile_dir: str | Path | None, k: int
                    ) -> CostModel | None:
        if policy not in POLICY_NAMES:
            raise ValueError(f"policy={policy!r}: choose one of {list(POLICY_NAMES)}")
        if isinstance(given, CostModel):
            return given
        if given is not None:
            return CostModel.load(given)
        if policy in ("off", "fixed"):
            return None
        # The profile times the workers' own verbs, so remote pools are profiled with their
        # transport; the cache key tells the layouts apart.
        name = getattr(self.proposer, "name", "none")
        layout = f"{type(self.target).__name__}-tp{getattr(self.target, 'tp', 1)}"
        # An in-process runner's device names the hardware; remote pools are keyed by this
        # machine's, as before.
        device = self.target.device if isinstance(self.target, TargetRunner) else None
        return load_or_profile(target_dir, drafter_dir(name, drafter), self.target,
                               None if name == "none" else self.proposer,
                               profile_dir or Path.home() / ".cache" / "dspark" / "cost",
                               layout=layout, device=device, block=k)

    def _check_vocab(self) -> None:
        vocab = getattr(self.proposer, "vocab_size", None)
        if vocab is not None and vocab != self.target.config.vocab_size:
            raise ValueError(
                f"drafter vocab {vocab} != target vocab {self.target.config.vocab_size}"
            )

    # --- requests -------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> str:
        """Validate and queue one request; raises ValueError (and changes nothing) on bad input."""
        params = params or SamplingParams()
        ids = tuple(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else tuple(prompt)
        self._validate(ids)
        req_id = f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        self._waiting.append(Request(req_id, ids, params, seed))
        return req_id

    def _validate(self, ids: tuple[int, ...]) -> None:
        if not ids:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.target.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                "and generation needs at least one more"
            )

    def abort(self, req_id: str) -> None:
        """Drop a request wherever it is and free its caches."""
        self._waiting = [r for r in self._waiting if r.req_id != req_id]
        req = self._running.pop(req_id, None)
        if req is not None:
            self._free(req)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def accounting(self) -> dict[str, object]:
        """Where request state lives now: the coordinator's queues and reserved blocks, and each
        worker's own account (requests holding state, KV blocks in use). An idle engine with
        nothing leaked has zeros and empty lists everywhere."""
        return {
            "waiting": len(self._waiting),
            "running": len(self._running),
            "unclaimed": len(self._finished),  # finished, result not yet popped
            "reserved_blocks": self._reserved_blocks,
            "coordinator_requests": sorted(set(self._sent_to_drafter) | set(self._pending_hidden)),
            "target": self.target.usage(),
            "draft": self.proposer.usage(),
        }

    def pop_finished(self, req_id: str) -> Request:
        return self._finished.pop(req_id)

    # --- the step loop --------------------------------------------------------------------
    def _blocks_for(self, req: Request) -> int:
        most = min(
            len(req.prompt_ids) + req.params.max_tokens + self.max_k + 1,
            self.max_model_len + self.max_k,
        )
        return -(-most // self.block_size)

    def _admit(self) -> None:
        # Worst-case block accounting at admission: a running request never runs out of cache.
        capacity = self.target.num_blocks
        while self._waiting and len(self._running) < self.max_num_seqs:
            req = self._waiting[0]
            need = self._blocks_for(req)
            if self._reserved_blocks + need > capacity and self._running:
                break
            self._waiting.pop(0)
            self._reserved_blocks += need
            new = self._new_request(req)
            self.target.add_request(new)
            self.proposer.add_request(new)
            self._sent_to_drafter[req.req_id] = 0
            self._running[req.req_id] = req

    def _new_request(self, req: Request) -> NewRequest:
        # A rebuilt request's generators start a fresh stream: replaying the first seed would
        # reuse the uniforms that decided its earlier tokens and correlate the continuation.
        seed = req.seed if not req.rebuilds else (req.seed * 1_000_003 + req.rebuilds) % 2**63
        return NewRequest(req.req_id, req.prompt_ids, req.params, seed)

    # --- faults: rebuild worker state from committed tokens (DESIGN.md §4, invariant 1) -----
    def _rebuild(self, req: Request, target: bool) -> None:
        """Re-add `req` to the proposer (and the target, with `target`) as if newly admitted:
        the next step resends every committed token; a rebuilt target re-prefills them."""
        req.rebuilds += 1
        new = self._new_request(req)
        self.proposer.release(req.req_id)
        self.proposer.add_request(new)
        self._sent_to_drafter[req.req_id] = 0
        self._pending_hidden.pop(req.req_id, None)
        if target:
            self.target.release(req.req_id)
            self.target.add_request(new)
            req.target_length = 0  # the KV cache is empty: the next verify is a prefill

    def _rebuild_lost_drafts(self) -> None:
        take = getattr(self.proposer, "take_rebuildable", None)
        lost = take() if take is not None else ()
        # A drafter fed by target hidden states needs them for every committed position, which
        # only a target prefill gives back.
        for req_id in lost:
            self._rebuild(self._running[req_id], target=self._drafts_from_target)
        if lost:
            logger.info("rebuilt the draft state of %d requests", len(lost))

    def _recover_target(self, error: WorkerLost) -> None:
        """A target worker died mid-step (nothing was committed): rebuild the group, then every
        running request on both sides. Raises WorkersUnavailable when the group cannot return."""
        logger.warning("target worker lost (%s): rebuilding, %d requests re-prefill",
                       error, len(self._running))
        self.target.recover()
        for req in self._running.values():
            self._rebuild(req, target=True)

    def _draft_cap(self, req: Request) -> int:
        # A prompt (or a rebuilt context) in this step's pass has no hidden rows yet: a budget
        # for its drafts would price slots the drafter cannot fill.
        if self._drafts_from_target and req.uncached_tokens:
            return 0
        # Commit appends at most ℓ + 1 tokens: stay within max_tokens and the context.
        left = req.params.max_tokens - len(req.output_ids)
        return max(0, min(left - 1, self.max_model_len - req.num_tokens - 1))

    def step(self) -> StepState | None:
        """Run one speculative step over every running request; returns what commit decided."""
        self._admit()
        if not self._running:
            return None
        start = time.perf_counter()
        self._rebuild_lost_drafts()
        reqs = list(self._running.values())
        req_ids = tuple(r.req_id for r in reqs)
        sampled = any(r.params.temperature > 0 for r in reqs)
        backlog = [r.num_tokens - self._sent_to_drafter[r.req_id] for r in reqs]
        # The pass also carries every uncached committed token (prompts being prefilled).
        lengths = self.policy.draft_lengths([self._draft_cap(r) for r in reqs], req_ids, sampled,
                                            backlog, sum(r.uncached_tokens for r in reqs),
                                            queued=len(self._waiting))
        queries = []
        for r, n in zip(reqs, lengths, strict=True):
            if n == 0:
                # Nothing to draft: new tokens and hidden rows wait here and go out together
                # with the next query that drafts, so an idle drafter costs (almost) nothing.
                queries.append(DraftQuery(r.req_id, (), 0, None))
                continue
            sent = self._sent_to_drafter[r.req_id]
            rows = self._pending_hidden.pop(r.req_id, None)
            hidden = torch.cat(rows) if rows else None
            queries.append(DraftQuery(r.req_id, r.tokens_from(sent), n, hidden))
            self._sent_to_drafter[r.req_id] = r.num_tokens
        clock = time.perf_counter()
        drafts = self.proposer.propose(queries)
        draft_seconds = time.perf_counter() - clock
        drafts = self.tracker.fill(drafts, [self._running[i].params.temperature > 0
                                            for i in drafts.req_ids])
        budget = self.policy.choose_budget(drafts)
        planned = self.policy.plan_verification(drafts, budget)
        plan = self._plan(reqs, drafts, planned, budget)
        clock = time.perf_counter()
        try:
            result = self.target.verify(plan)
        except WorkerLost as e:
            self._recover_target(e)
            return None
        verify_seconds = time.perf_counter() - clock
        if result.hidden is not None and self._drafts_from_target:
            for req_id, rows in zip(result.req_ids, result.hidden, strict=True):
                self._pending_hidden.setdefault(req_id, []).append(rows)
        self._step_no += 1
        state = commit(
            self._step_no, self._running, drafts, plan, result, self.eos_ids, self.max_model_len,
            self.tokenizer.decode,
        )
        self._rollback(state)
        self.tracker.observe(state)
        self.policy.observe(state)
        self._record(state, drafts, planned, start)
        self.policy.observe_time(time.perf_counter() - start,
                                 sum(len(ids) for ids in plan.input_ids), draft_seconds,
                                 verify_seconds)
        return state

    def _record(self, state: StepState, drafts: Drafts, planned: list[int], start: float) -> None:
        conf = drafts.confidences
        predicted = 0.0
        if conf is not None and any(planned):
            rows = survivals_of(conf).tolist()  # [num_reqs][width]: plain floats, a few a request
            predicted = sum(sum(row[:n]) for row, n in zip(rows, planned, strict=True))
        accepted = sum(s.num_accepted for s in state.requests)
        st = self.stats
        st.steps += 1
        st.generated_tokens += sum(len(s.committed) for s in state.requests)
        st.busy_seconds += time.perf_counter() - start
        st.verified_tokens += sum(planned)
        st.accepted_tokens += accepted
        st.predicted_accepted += predicted
        st.recent.append(StepRecord(state.step, state.budget, tuple(planned), predicted, accepted))
        if self.trace is not None:
            self.trace.record(state, drafts, planned, start)

    def _plan(
        self, reqs: list[Request], drafts: Drafts, planned: list[int], budget: int
    ) -> VerifyPlan:
        assert sum(planned) <= budget or budget == 0 and not any(planned)
        width = max(planned, default=0)
        # One conversion each and one masked copy, not a few torch ops per request: at 16 in
        # flight the per-request ops cost ~0.1 ms a step.
        assert all(n <= d for n, d in zip(planned, drafts.num_drafts.tolist(), strict=True))
        drafted = drafts.token_ids[:, :width]  # [num_reqs, width]
        rows = drafted.tolist()
        past = (torch.arange(width, device=drafted.device)
                >= torch.tensor(planned, dtype=torch.int64, device=drafted.device)[:, None])
        token_ids = drafted.masked_fill(past, -1)  # -1 past each request's ℓ
        probs = drafts.probs  # q over Ray stays a reference: rank 0 cuts it to the plan's width
        if isinstance(probs, torch.Tensor):
            probs = probs[:, :width]
        return VerifyPlan(
            req_ids=tuple(r.req_id for r in reqs),
            starts=tuple(r.target_length for r in reqs),
            input_ids=tuple(
                r.tokens_from(r.target_length) + tuple(row[:n])
                for r, row, n in zip(reqs, rows, planned, strict=True)
            ),
            num_draft=tuple(planned),
            draft_token_ids=token_ids,
            draft_probs=probs,
            budget=budget,
        )

    def _rollback(self, state: StepState) -> None:
        self.target.rollback(
            {s.req_id: s.target_length for s in state.requests if s.finish_reason is None}
        )
        for s in state.requests:
            if s.finish_reason is None:
                self.proposer.commit(s.req_id, s.num_accepted)
            else:
                req = self._running.pop(s.req_id)
                self._free(req)
                self._finished[req.req_id] = req

    def _free(self, req: Request) -> None:
        self.target.release(req.req_id)
        self.proposer.release(req.req_id)
        self._sent_to_drafter.pop(req.req_id, None)
        self._pending_hidden.pop(req.req_id, None)
        self._reserved_blocks -= self._blocks_for(req)

    # --- convenience ----------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while any(i not in self._finished for i in ids):
            self.step()
        return [self.result(self._finished.pop(i)) for i in ids]

    def result(self, req: Request) -> GenerationResult:
        text = self.tokenizer.decode(req.output_ids)
        if req.stop_text_end is not None:
            text = text[: req.stop_text_end]
        return GenerationResult(
            req_id=req.req_id,
            prompt_ids=req.prompt_ids,
            token_ids=tuple(req.output_ids),
            text=text,
            finish_reason=req.finish_reason or "abort",
            stats=req.stats.as_dict(),
        )
