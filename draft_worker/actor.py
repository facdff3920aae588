"""Draft workers behind Ray: named actors holding one proposer each, and the pool client.

`DraftActor` (named `draft-<i>` in namespace `dspark`) holds a proposer built by name
(`draft-model`, `ngram`, `dspark`) and serves many requests. `DraftPool` is what the coordinator
holds: it speaks the `Proposer` verbs and routes requests M:N over the actors, sticky per request
(a request's draft state lives on one actor from `add_request` to `release`):

- `add_request` assigns the request to the least-loaded actor (ties: the lowest index) in the
  `RoutingTable`, the one place that maps requests to actors;
- `commit` and `release` are queued per actor and travel with that actor's next `propose` call
  that drafts (or once MAX_QUEUED_VERBS wait, or on `flush`); Ray runs one caller's calls to an
  actor in order, so every actor sees its verbs in the coordinator's order;
- `propose` sends each actor its queries (and queued verbs) concurrently, waits for all, and
  merges the per-actor `Drafts` into one batch in the query order.

Faults (invariant 5: a draft-side failure changes speed, never output): when an actor dies (or
its proposer raises) in the middle of a call, its requests are marked lost and get no drafts
(plain decoding, counted in `faults` and logged); Ray restarts the actor (`max_restarts`) and a
readiness probe tells the pool when it serves again. `take_rebuildable()` hands the coordinator
the lost requests once some actor serves; the coordinator re-adds each (release, add_request,
committed tokens resent), so speculation resumes. Nothing the actor held was the truth.

Ray is imported lazily (see `dspark.target_worker.actor`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dspark import tensor_wire
from dspark.faults import first_line
from dspark.messages import DraftQuery, Drafts, NewRequest, RemoteDraftProbs
from dspark.models.device import resolve_device

logger = logging.getLogger(__name__)

NAMESPACE = "dspark"
PROPOSER_NAMES = ("draft-model", "ngram", "dspark", "none")

# A queued verb: ("add_request", NewRequest) | ("commit", (req_id, A)) | ("release", req_id)
Op = tuple[str, Any]
# Verbs wait for the actor's next drafting call, unless this many are queued: an actor whose
# requests do not draft (policy `off`, or K = 0 for a stretch) gets commits every step, and
# one call per step for them alone cost ~1-3 ms on the demo service.
MAX_QUEUED_VERBS = 64


def draft_actor_name(index: int) -> str:
    return f"draft-{index}"


def make_proposer(
    name: str,
    drafter_dir: str | Path | None,
    target_dir: str | Path | None,
    num_blocks: int = 2048,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Any:
    """A proposer by name: `draft-model` and `dspark` load `drafter_dir`; `ngram` and `none`
    (plain decoding) need nothing."""
    if name == "none":
        from dspark.draft_worker.proposer import NoProposer

        return NoProposer()
    if name == "ngram":
        from dspark.draft_worker.ngram import NgramProposer

        return NgramProposer()
    if drafter_dir is None:
        raise ValueError(f"proposer {name!r} needs a drafter directory")
    if name == "draft-model":
        from dspark.draft_worker.draft_model import DraftModelProposer

        return DraftModelProposer(drafter_dir, num_blocks, block_size, dtype, device)
    if name == "dspark":
        from dspark.draft_worker.dspark_proposer import DSparkProposer

        return DSparkProposer(drafter_dir, target_dir, num_blocks, block_size, dtype, device)
    raise ValueError(f"proposer={name!r}: choose one of {list(PROPOSER_NAMES)}")


class DraftActor:
    """One draft worker: a proposer serving the requests routed to it."""

    def __init__(
        self,
        proposer: str,
        drafter_dir: str | None,
        target_dir: str | None,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        num_threads: int = 1,
    ) -> None:
        torch.set_num_threads(num_threads)
        tensor_wire.install()  # this actor's results carry tensors as raw bytes
        device = resolve_device()
        self.proposer = make_proposer(
            proposer, drafter_dir, target_dir, num_blocks, block_size, dtype, device
        )
        self._requests: set[str] = set()
        self._served = 0  # requests ever added
        self._busy = {"calls": 0, "seconds": 0.0}  # time inside `step`, for the transport cost

    def info(self) -> dict[str, Any]:
        """The proposer's attributes the coordinator reads (`getattr` on the proposer)."""
        p = self.proposer
        return {
            "name": p.name,
            "vocab_size": getattr(p, "vocab_size", None),
            "max_model_len": getattr(p, "max_model_len", None),
            "hidden_layers": tuple(getattr(p, "hidden_layers", ())),
            "has_confidence_head": getattr(p, "has_confidence_head", False),
            "sequential_drafts": getattr(p, "sequential_drafts", False),
        }

    def step(self, ops: Sequence[Op], queries: list[DraftQuery] | None) -> Drafts | None:
        """Apply the queued verbs in order, then propose for `queries` (None: only apply)."""
        start = time.perf_counter()
        try:
            return self._step(ops, queries)
        finally:
            self._busy["calls"] += 1
            self._busy["seconds"] += time.perf_counter() - start

    def draft(
        self, ops: Sequence[Op], queries: list[DraftQuery]
    ) -> tuple[tuple[Drafts, bool], torch.Tensor | None]:
        """`step` for a call that drafts, as two Ray objects (`num_returns=2`): (the drafts
        without q, whether they have q), and q alone. The coordinator fetches the first and
        hands the second to the target's rank 0 by reference
        (`dspark.target_worker.draft_probs`)."""
        d = self.step(ops, queries)
        assert d is not None
        return (replace(d, probs=None), d.probs is not None), d.probs

    def _step(self, ops: Sequence[Op], queries: list[DraftQuery] | None) -> Drafts | None:
        p = self.proposer
        for verb, arg in ops:
            if verb == "add_request":
                p.add_request(arg)
                self._requests.add(arg.req_id)
                self._served += 1
            elif verb == "commit":
                p.commit(*arg)
            elif verb == "release":
                p.release(arg)
                self._requests.discard(arg)
            else:
                raise ValueError(f"unknown draft verb {verb!r}")
        return None if queries is None else p.propose(queries)

    def busy(self) -> dict[str, float]:
        """Calls of `step` and seconds spent inside them (the proposer's work)."""
        return dict(self._busy)

    def usage(self) -> dict[str, object]:
        return self.proposer.usage()

    def requests(self) -> dict[str, Any]:
        """The requests whose draft state lives here (sorted) and how many were ever added."""
        return {"held": sorted(self._requests), "served": self._served}

    def pid(self) -> int:
        """This actor's process id (fault-injection tests kill it)."""
        return os.getpid()


class RoutingTable:
    """Which actor holds which request: assigned once, sticky until released.

    The one place routing lives (fault handling will reassign here).
    """

    def __init__(self, num_actors: int) -> None:
        if num_actors < 1:
            raise ValueError(f"num_actors={num_actors}: need at least one draft actor")
        self._actor_of: dict[str, int] = {}
        self._load = [0] * num_actors

    def assign(self, req_id: str, avoid: frozenset[int] = frozenset()) -> int:
        """Route a new request to the least-loaded actor not in `avoid` (ties: the lowest index;
        every actor avoided: the least-loaded of all)."""
        if req_id in self._actor_of:
            raise ValueError(f"request {req_id!r} is already routed to {self._actor_of[req_id]}")
        choices = [i for i in range(len(self._load)) if i not in avoid] or range(len(self._load))
        actor = min(choices, key=lambda i: (self._load[i], i))
        self._actor_of[req_id] = actor
        self._load[actor] += 1
        return actor

    def actor_of(self, req_id: str) -> int:
        return self._actor_of[req_id]

    def remove(self, req_id: str) -> int | None:
        actor = self._actor_of.pop(req_id, None)
        if actor is not None:
            self._load[actor] -= 1
        return actor

    def loads(self) -> list[int]:
        return list(self._load)

    def requests_of(self, actor: int) -> list[str]:
        return [r for r, a in self._actor_of.items() if a == actor]


class DraftPool:
    """The coordinator's proposer over the draft actors (the `Proposer` verbs).

    Example (a running Ray instance; see `dspark.coordinator.ray_workers.build_ray_workers`):
        >>> target, pool = build_ray_workers(demo_path("target"), "ngram")  # doctest: +SKIP
        >>> pool.routes.loads()  # doctest: +SKIP
        [0, 0]
    """

    def __init__(
        self, actors: Sequence[Any], info: dict[str, Any], placement_group: Any = None
    ) -> None:
        self.actors = list(actors)
        self.placement_group = placement_group
        self.routes = RoutingTable(len(self.actors))
        self.name: str = info["name"]
        self.vocab_size: int | None = info["vocab_size"]
        self.max_model_len: int | None = info["max_model_len"]
        self.hidden_layers: tuple[int, ...] = info["hidden_layers"]
        self.has_confidence_head: bool = info["has_confidence_head"]
        self.sequential_drafts: bool = info["sequential_drafts"]
        self._ops: list[list[Op]] = [[] for _ in self.actors]
        self._down: dict[int, Any] = {}  # actor -> readiness probe (None: it will not return)
        self._lost: set[str] = set()  # requests whose draft state died with their actor
        self.timing = {"propose_calls": 0, "propose_seconds": 0.0}
        # actor_failures: calls lost to a dead or failing actor; actors_back: restarts that
        # serve again; undrafted_rows: query rows answered without drafts because of a fault.
        self.faults = {"actor_failures": 0, "actors_back": 0, "undrafted_rows": 0}

    def add_request(self, new: NewRequest) -> None:
        actor = self.routes.assign(new.req_id, avoid=frozenset(self._down))
        if actor in self._down:  # every actor is down: draft it once one serves again
            self._lost.add(new.req_id)
        else:
            self._ops[actor].append(("add_request", new))

    def commit(self, req_id: str, num_accepted: int) -> None:
        if req_id not in self._lost:
            self._ops[self.routes.actor_of(req_id)].append(("commit", (req_id, num_accepted)))

    def release(self, req_id: str) -> None:
        actor = self.routes.remove(req_id)
        if req_id in self._lost:
            self._lost.discard(req_id)  # its state is gone already
        elif actor is not None:
            self._ops[actor].append(("release", req_id))

    def take_rebuildable(self) -> list[str]:
        """Lost requests that can be drafted again now (some actor serves), sorted. The caller
        re-adds each one: `release`, then `add_request` with its committed tokens resent."""
        self._poll_down()
        if len(self._down) == len(self.actors):
            return []
        return sorted(self._lost)

    def propose(self, queries: list[DraftQuery]) -> Drafts:
        import ray

        start = time.perf_counter()
        self._poll_down()
        per_actor: dict[int, list[int]] = {}  # actor -> positions in `queries`
        for i, q in enumerate(queries):
            if q.req_id in self._lost:
                self.faults["undrafted_rows"] += 1
            elif q.num_drafts:
                # A query for no drafts carries nothing (`Engine.step` holds its tokens back), so
                # it gets no call: an idle step then costs no Ray call at all, ~1-3 ms a call on
                # the 2-core demo service, where a step takes ~20 ms.
                per_actor.setdefault(self.routes.actor_of(q.req_id), []).append(i)
        calls: list[tuple[int, Any]] = []
        for a, actor in enumerate(self.actors):
            rows = per_actor.get(a)
            if a in self._down or (rows is None and len(self._ops[a]) < MAX_QUEUED_VERBS):
                continue
            ops, self._ops[a] = self._ops[a], []
            if rows is None:
                calls.append((a, actor.step.remote(ops, None), None))
            else:
                calls.append((a, *actor.draft.options(num_returns=2).remote(
                    ops, [queries[i] for i in rows])))
        parts = []
        for a, ref, q_ref in calls:
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayError as e:
                self.faults["undrafted_rows"] += len(per_actor.get(a, ()))
                self._actor_failed(a, e)
                continue
            if answer is not None:
                d, has_q = answer
                parts.append((per_actor[a], d, q_ref if has_q else None))
        merged = merge_drafts(tuple(q.req_id for q in queries), parts, self.has_confidence_head)
        self.timing["propose_calls"] += 1
        self.timing["propose_seconds"] += time.perf_counter() - start
        return merged

    def _actor_failed(self, a: int, error: Exception) -> None:
        """Actor `a` died or raised mid-call: its requests' draft state is gone. A raising actor
        is restarted too, since its state may be half-updated."""
        import ray

        self.faults["actor_failures"] += 1
        lost = self.routes.requests_of(a)
        logger.warning(
            "draft actor %d failed (%s: %s); %d requests continue without drafts until it is "
            "replaced", a, type(error).__name__, first_line(error), len(lost),
        )
        if not isinstance(error, ray.exceptions.RayActorError):
            ray.kill(self.actors[a], no_restart=False)
        self._ops[a] = []
        self._lost.update(lost)
        self._down[a] = self.actors[a].info.remote()  # answers once Ray has restarted it

    def _poll_down(self) -> None:
        import ray

        for a, probe in list(self._down.items()):
            if probe is None or not ray.wait([probe], timeout=0)[0]:
                continue
            try:
                ray.get(probe)
            except ray.exceptions.ActorUnavailableError:  # still restarting: ask again
                self._down[a] = self.actors[a].info.remote()
                continue
            except ray.exceptions.RayError as e:
                logger.error("draft actor %d cannot be restarted (%s); routing around it", a, e)
                self._down[a] = None
                continue
            del self._down[a]
            self.faults["actors_back"] += 1
            logger.info("draft actor %d serves again", a)

    def _live(self) -> list[int]:
        return [a for a in range(len(self.actors)) if a not in self._down]

    def flush(self) -> None:
        """Send the queued verbs now (they otherwise travel with the next `propose` that drafts
        on their actor)."""
        import ray

        refs = []
        for a in self._live():
            if self._ops[a]:
                ops, self._ops[a] = self._ops[a], []
                refs.append(self.actors[a].step.remote(ops, None))
        ray.get(refs)

    def busy(self) -> list[dict[str, float]]:
        """Each actor's time inside its calls (the rest of `timing` is transport and waiting)."""
        import ray

        return ray.get([a.busy.remote() for a in self.actors])

    def usage(self) -> dict[str, object]:
        """Requests holding state on any serving draft actor and the KV blocks they use."""
        import ray

        self.flush()
        parts = ray.get([self.actors[a].usage.remote() for a in self._live()])
        held = sorted({r for p in parts for r in p["requests"]})
        return {"requests": held, "used_blocks": sum(p["used_blocks"] for p in parts)}

    def actor_requests(self) -> list[dict[str, Any]]:
        """Each actor's own account: requests held now (`held`) and ever added (`served`)."""
        import ray

        self.flush()
        return ray.get([a.requests.remote() for a in self.actors])


def merge_drafts(req_ids: tuple[str, ...],
                 parts: Sequence[tuple[Sequence[int], Drafts, Any]],
                 with_confidences: bool) -> Drafts:
    """One `Drafts` in `req_ids` order from per-actor parts: (positions in `req_ids`, that
    actor's drafts without q, the Ray reference to its q or None: deterministic drafts).
    Requests in no part get no drafts.

    q stays where the actors left it: the batch carries the references (`RemoteDraftProbs`;
    None when no part has q), which the target's rank 0 fetches. Padding follows `Drafts`: token
    ids -1, and confidences zero past each row's drafts. `with_confidences`: the proposer has a
    confidence head, so the batch carries confidences as an in-process proposer's would, even
    with no part.
    """
    n = len(req_ids)
    width = max((d.token_ids.shape[1] for _, d, _ in parts), default=0)
    token_ids = torch.full((n, width), -1, dtype=torch.long)  # [num_reqs, max_draft]
    num_drafts = torch.zeros(n, dtype=torch.long)  # [num_reqs]
    assert all((d.confidences is not None) == with_confidences for _, d, _ in parts), (
        "a draft actor disagrees on confidences")
    # [num_reqs, max_draft]
    confidences = torch.zeros(n, width, dtype=torch.float64) if with_confidences else None
    for positions, d, _ in parts:
        rows = torch.tensor(list(positions), dtype=torch.long)
        assert tuple(req_ids[i] for i in positions) == d.req_ids, "actor answered other requests"
        w = d.token_ids.shape[1]
        token_ids[rows, :w] = d.token_ids
        num_drafts[rows] = d.num_drafts
        if confidences is not None and d.confidences is not None:
            confidences[rows, :w] = d.confidences
    remote = [(tuple(positions), ref) for positions, _, ref in parts if ref is not None]
    probs = None
    if remote:
        probs = RemoteDraftProbs(tuple(r for r, _ in remote), tuple(ref for _, ref in remote))
    return Drafts(req_ids, token_ids, num_drafts, probs, confidences)
