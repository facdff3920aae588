"""The target model behind Ray: one actor per tensor-parallel rank, and the client the coordinator
holds (`TargetGroup`, the engine's `TargetWorker` protocol).

Each rank is a `TargetActor` (named `target-<rank>` in namespace `dspark`) running a
`TPTargetRunner` over its shard; the ranks are joined by torch.distributed (NCCL on CUDA, gloo on
CPU) and talk to each other only by collectives. The coordinator talks to them only by Ray calls,
and every rank receives the same calls in the same order:

- `add_request`, `rollback` and `release` are queued in the client and travel with the next
  `verify` (one Ray call per rank per step; Ray runs one caller's calls to an actor in order);
- `verify` sends the queued verbs and the plan to every rank at once, waits for all of them and
  returns rank 0's result after checking that every rank took the same decision (invariant 6).

Ray itself is imported lazily: the actor class is a plain class until `ray.remote` wraps it in
`dspark.coordinator.ray_workers`, so a process decides how Ray starts before Ray is imported.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch

from dspark import tensor_wire
from dspark.faults import WorkerLost, WorkersUnavailable, first_line
from dspark.messages import NewRequest, RemoteDraftProbs, VerifyPlan, VerifyResult
from dspark.models.config import ModelConfig
from dspark.models.device import resolve_device
from dspark.target_worker.draft_probs import fetch_draft_probs

logger = logging.getLogger(__name__)

NAMESPACE = "dspark"

# One queued verb: ("add_request", NewRequest) | ("rollback", {req_id: length}) | ("release", id)
Op = tuple[str, Any]


STEP_TIMEOUT_S = 300.0  # a verify step longer than this counts as a lost rank
MAX_RECOVERIES = 3  # group rebuilds in a row (no successful verify between) before giving up


def target_actor_name(rank: int) -> str:
    return f"target-{rank}"


class RankDivergenceError(RuntimeError):
    """Tensor-parallel ranks returned different decisions: invariant 6 is broken."""


class TargetActor:
    """One tensor-parallel rank: joins the process group, then runs the runner's verbs.

    Life cycle: construct (cheap), `address()` on rank 0 (where the group meets), `setup(...)` on
    every rank at once (it blocks until all ranks have joined), then `step(ops, plan)` each step.
    """

    def __init__(self, rank: int, world_size: int, num_threads: int = 1) -> None:
        torch.set_num_threads(num_threads)
        tensor_wire.install()  # this actor's results carry tensors as raw bytes
        self.rank, self.world_size = rank, world_size
        self.runner: Any = None  # TargetRunner (tp = 1) or TPTargetRunner
        self._busy = {"calls": 0, "seconds": 0.0}  # time inside `step`, for the transport cost

    def address(self) -> tuple[str, int]:
        """An address of this node and a free TCP port on it, for the process group to meet at."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def setup(
        self,
        master: tuple[str, int],
        target_dir: str,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        hidden_layers: tuple[int, ...],
    ) -> dict[str, Any]:
        """Join the group, load this rank's shard; returns what the coordinator needs to know."""
        from dspark.target_worker.runner import TargetRunner
        from dspark.target_worker.tensor_parallel import TPGroup, TPTargetRunner

        device = resolve_device()
        if self.world_size == 1:
            self.runner = TargetRunner(
                target_dir, num_blocks, block_size, dtype, device, hidden_layers
            )
        else:
            import torch.distributed as dist

            backend = "nccl" if device == "cuda" else "gloo"
            if device == "cuda":
                torch.cuda.set_device(0)  # Ray gives each rank one GPU, visible as cuda:0
            host, port = master
            if backend == "gloo" and host.startswith("127."):
                # Gloo otherwise binds to the address the hostname resolves to; a local instance
                # keeps every socket on loopback.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(
                backend, init_method=f"tcp://{host}:{port}", rank=self.rank,
                world_size=self.world_size, timeout=timedelta(minutes=5),
            )
            tp = TPGroup(self.rank, self.world_size)
            self.runner = TPTargetRunner(
                target_dir, tp, num_blocks, block_size, dtype, device, hidden_layers
            )
        return {
            "config": self.runner.config,
            "max_model_len": self.runner.max_model_len,
            "num_blocks": self.runner.num_blocks,
            "device": device,
        }

    def step(self, ops: Sequence[Op], plan: VerifyPlan | None) -> VerifyResult | None:
        """Apply the queued verbs in order, then verify `plan` (None: only apply)."""
        start = time.perf_counter()
        try:
            return self._step(ops, plan)
        finally:
            self._busy["calls"] += 1
            self._busy["seconds"] += time.perf_counter() - start

    def _step(self, ops: Sequence[Op], plan: VerifyPlan | None) -> VerifyResult | None:
        for verb, arg in ops:
            if verb == "add_request":
                self.runner.add_request(arg)
            elif verb == "rollback":
                self.runner.rollback(arg)
            elif verb == "release":
                self.runner.release(arg)
            else:
                raise ValueError(f"unknown target verb {verb!r}")
        if plan is None:
            return None
        unjudged: frozenset[int] = frozenset()
        if isinstance(plan.draft_probs, RemoteDraftProbs):  # rank 0 alone reads q
            q, unjudged = fetch_draft_probs(
                plan.draft_probs, plan.draft_token_ids, self.runner.config.vocab_size
            )
            plan = replace(plan, draft_probs=q)
        result = self.runner.verify(plan, unjudged)
        # Only rank 0's hidden rows are used: the others send their decision alone.
        if self.rank != 0 and result.hidden is not None:
            result = VerifyResult(result.req_ids, result.num_accepted, result.output_tokens)
        return result

    @torch.inference_mode()
    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Logits of every position of each prompt in one varlen pass (scratch cache entries).

        Every rank must be called with the same prompts: the pass runs the group's collectives.
        """
        runner = self.runner
        ids = [f"__prefill-{i}" for i in range(len(prompts))]
        lens = [len(p) for p in prompts]
        try:
            for r, n in zip(ids, lens, strict=True):
                runner.cache.reserve(r, n)
            meta = runner.cache.metadata(ids, [0] * len(ids), lens)
            flat = torch.tensor([t for p in prompts for t in p], device=runner.device)
            rows = torch.arange(flat.shape[0], device=runner.device)
            logits = runner.model.forward_paged(flat, meta, runner.cache, rows).logits.cpu()
        finally:
            for r in ids:
                runner.cache.release(r)
        return list(logits.split(lens))

    def busy(self) -> dict[str, float]:
        """Calls of `step` and seconds spent inside them (model, acceptance, collectives)."""
        return dict(self._busy)

    def usage(self) -> dict[str, object]:
        return self.runner.usage()

    def pid(self) -> int:
        """This rank's process id (fault-injection tests kill it)."""
        return os.getpid()

    def decision_digest(self) -> tuple[int, str]:
        """(decisions taken, their sha256) on this rank; tp = 1 has nothing to compare."""
        digest = getattr(self.runner, "decision_digest", None)
        return digest() if digest is not None else (0, "")


class TargetGroup:
    """The coordinator's handle on the target ranks: the engine's `TargetWorker` protocol.

    Example (a running Ray instance; see `dspark.coordinator.ray_workers.build_ray_workers`):
        >>> target, drafts = build_ray_workers(demo_path("target"), "ngram", tp=2)  # doctest: +SKIP
        >>> Engine(workers=(target, drafts)).generate("def f(x):")  # doctest: +SKIP
    """

    def __init__(self, actors: Sequence[Any], info: dict[str, Any], placement_group: Any = None,
                 max_model_len: int | None = None) -> None:
        self.actors = list(actors)  # rank order
        self.placement_group = placement_group
        self.config: ModelConfig = info["config"]
        self.max_model_len: int = min(info["max_model_len"], max_model_len or info["max_model_len"])
        self.num_blocks: int = info["num_blocks"]
        self.device: str = info["device"]
        self._ops: list[Op] = []
        self.timing = {"verify_calls": 0, "verify_seconds": 0.0}
        # Fault handling: `rebuild(old)` starts a fresh group in place of `old` (set by
        # `dspark.coordinator.ray_workers`; None: this group cannot be rebuilt). A step that does
        # not finish within `step_timeout` seconds counts as a lost worker.
        self.rebuild: Callable[[TargetGroup], TargetGroup] | None = None
        self.step_timeout = STEP_TIMEOUT_S
        self.max_recoveries = MAX_RECOVERIES  # in a row, without a verify that succeeded
        self.recoveries = 0  # in all
        self._failed_in_a_row = 0
        # unjudged_rows: rows whose drafts rank 0 could not judge (their q was lost).
        self.faults = {"unjudged_rows": 0}

    @property
    def tp(self) -> int:
        return len(self.actors)

    def add_request(self, new: NewRequest) -> None:
        self._ops.append(("add_request", new))

    def rollback(self, lengths: dict[str, int]) -> None:
        if lengths:
            self._ops.append(("rollback", dict(lengths)))

    def release(self, req_id: str) -> None:
        self._ops.append(("release", req_id))

    def verify(self, plan: VerifyPlan) -> VerifyResult:
        start = time.perf_counter()
        ops, self._ops = self._ops, []
        # Only rank 0 decides acceptance, so only it reads q (the bulk of a sampled plan, or
        # the references to it: `dspark.target_worker.draft_probs`).
        lean = plan if plan.draft_probs is None else replace(plan, draft_probs=None)
        results = self._gather([a.step.remote(ops, plan if rank == 0 else lean)
                                for rank, a in enumerate(self.actors)])
        self._failed_in_a_row = 0
        self.timing["verify_calls"] += 1
        self.timing["verify_seconds"] += time.perf_counter() - start
        first = results[0]
        if first.unjudged:
            self.faults["unjudged_rows"] += len(first.unjudged)
        for rank, other in enumerate(results[1:], start=1):
            decision = (other.num_accepted, other.output_tokens)
            if decision != (first.num_accepted, first.output_tokens):
                raise RankDivergenceError(f"rank {rank} decided differently from rank 0")
        return first

    def flush(self) -> None:
        """Send the queued verbs now (they otherwise travel with the next `verify`)."""
        ops, self._ops = self._ops, []
        if ops:
            self._gather([a.step.remote(ops, None) for a in self.actors])

    def _gather(self, refs: list[Any]) -> list[Any]:
        """Every rank's answer; WorkerLost as soon as one rank is dead or the step times out.

        A rank's exception is a bug unless a rank died (a dead peer fails the others'
        collectives): then it is WorkerLost too. The caller never waits on a dead group.
        """
        import ray

        pending, deadline = list(refs), time.monotonic() + self.step_timeout
        try:
            while pending:
                done, pending = ray.wait(
                    pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
                )
                if not done:
                    raise WorkerLost(f"a target rank did not answer within {self.step_timeout:g}s")
                ray.get(done[0])
        except ray.exceptions.RayActorError as e:
            raise WorkerLost(f"a target rank died: {first_line(e)}") from e
        except ray.exceptions.RayTaskError as e:
            dead = self._dead_ranks()
            if dead:
                raise WorkerLost(f"target ranks {dead} died: {first_line(e)}") from e
            raise
        return ray.get(refs)

    def _dead_ranks(self) -> list[int]:
        import ray

        dead = []
        for rank, actor in enumerate(self.actors):
            try:
                ray.get(actor.busy.remote(), timeout=10.0)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                dead.append(rank)
        return dead

    def recover(self) -> None:
        """Replace every rank with a fresh group holding no requests (the coordinator re-adds
        and re-prefills them). Raises WorkersUnavailable when that is not possible."""
        self._failed_in_a_row += 1
        if self.rebuild is None:
            raise WorkersUnavailable("the target group lost a rank and cannot be rebuilt")
        if self._failed_in_a_row > self.max_recoveries:
            raise WorkersUnavailable(
                f"the target group failed {self._failed_in_a_row} times in a row; giving up"
            )
        try:
            fresh = self.rebuild(self)
        except Exception as e:  # noqa: BLE001 - any failure to start is the same to callers
            raise WorkersUnavailable(f"could not rebuild the target group: {e}") from e
        self.actors, self.placement_group = fresh.actors, fresh.placement_group
        self._ops = []
        self.recoveries += 1
        logger.warning("target group rebuilt (%d ranks, recovery %d)", self.tp, self.recoveries)

    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Rank 0's logits of every position of each prompt (all ranks run the pass)."""
        import ray

        self.flush()
        return ray.get([a.prefill_logits.remote(prompts) for a in self.actors])[0]

    def usage(self) -> dict[str, object]:
        """Requests holding state on any rank and the most KV blocks any rank uses."""
        import ray

        self.flush()
        parts = ray.get([a.usage.remote() for a in self.actors])
        held = sorted({r for p in parts for r in p["requests"]})
        return {"requests": held, "used_blocks": max(p["used_blocks"] for p in parts)}

    def busy(self) -> list[dict[str, float]]:
        """Each rank's time inside its calls (the rest of `timing` is transport and waiting)."""
        import ray

        return ray.get([a.busy.remote() for a in self.actors])

    def decision_digests(self) -> list[tuple[int, str]]:
        """Each rank's (decisions, sha256 of them), rank order."""
        import ray

        return ray.get([a.decision_digest.remote() for a in self.actors])

