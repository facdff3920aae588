"""Simulated acceptance: how many of a request's verified drafts the target keeps.

Every step, a model gives each request a `Block`: the true conditional acceptance
probabilities c*_{r,j}, the confidences a drafter's head would report, and the uniforms
that decide the outcome. Accepted drafts for a plan ℓ_r are the leading run of u_{r,j} < c*_{r,j}
(j ≤ ℓ_r), so the outcome of a block is fixed before any policy looks at it: two policies
planning the same block meet the same target (common random numbers), and `oracle` can plan
from c* itself.

- `PositionModel`: c*_{r,j} = σ(logit(base_j) + u_r + ε_{r,j}) with a per-request difficulty
  u_r ~ N(0, σ_req²) (chat vs code) and per-step noise ε ~ N(0, σ_step²); the head reports
  σ(logit(c*) + η), η ~ N(0, σ_head²), i.e. calibrated on average but noisy.
- `TraceReplay`: request i replays traced request i mod n step by step: A = min(A_rec, ℓ) where
  the recorded step settles it (ℓ ≤ ℓ_rec, or a rejection was seen); past a fully accepted
  recorded prefix, positions are drawn from the trace's per-position conditional rates.

Example:
    >>> m = PositionModel(gamma=3)
    >>> rng = np.random.default_rng(0)
    >>> b = m.block([m.start(0, rng)], rng)
    >>> b.true_c.shape, int(b.accepted(np.array([0]))[0])
    ((1, 3), 0)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark.coordinator.trace import RequestTrace, Trace

DSPARK_LIKE = (0.85, 0.82, 0.8, 0.78, 0.76, 0.74, 0.72)  # flat-ish, as the paper's DSpark curves


@dataclass(frozen=True)
class Block:
    """One step's acceptance for a batch."""

    true_c: np.ndarray  # [num_reqs, γ] true conditional acceptance probabilities
    reported: np.ndarray | None  # [num_reqs, γ] what a confidence head reports; None: no head
    uniforms: np.ndarray  # [num_reqs, γ] the draws that decide acceptance
    max_drafts: np.ndarray | None = None  # [num_reqs] drafts the proposer has (replay); None: γ

    def accepted(self, planned: np.ndarray) -> np.ndarray:  # [num_reqs] int
        """A_r: the leading run of accepted positions within the first ℓ_r (planned: [num_reqs])."""
        ok = self.uniforms < self.true_c
        run = np.cumprod(ok, axis=1).sum(axis=1)
        return np.minimum(run, planned).astype(int)

    def expected_accepted(self, planned: np.ndarray) -> float:
        """Σ_r Σ_{j≤ℓ_r} a*_{r,j}: the true expectation of the plan (planned: [num_reqs])."""
        surv = np.cumprod(self.true_c, axis=1)
        mask = np.arange(surv.shape[1])[None, :] < planned[:, None]
        return float((surv * mask).sum())


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


@dataclass(frozen=True)
class PositionModel:
    gamma: int = 7
    base: tuple[float, ...] = DSPARK_LIKE
    sigma_req: float = 1.0
    sigma_step: float = 0.7
    sigma_head: float = 0.5
    has_head: bool = True

    def __post_init__(self) -> None:
        if len(self.base) < self.gamma:
            raise ValueError(f"base has {len(self.base)} rates; gamma={self.gamma} needs as many")

    def start(self, source: int, rng: np.random.Generator) -> float:
        """Per-request state: its difficulty offset u_r."""
        return float(rng.normal(0.0, self.sigma_req))

    def block(self, states: list, rng: np.random.Generator) -> Block:
        n, g = len(states), self.gamma
        base = _logit(np.asarray(self.base[:g]))[None, :]
        z = base + np.asarray(states, dtype=float)[:, None] + rng.normal(0, self.sigma_step, (n, g))
        true_c = _sigmoid(z)
        reported = _sigmoid(z + rng.normal(0, self.sigma_head, (n, g))) if self.has_head else None
        return Block(true_c, reported, rng.random((n, g)))


@dataclass
class _Cursor:
    req: RequestTrace
    step: int = 0


@dataclass
class TraceReplay:
    """Acceptance replayed from a recorded trace (see the module docstring)."""

    trace: Trace
    gamma: int
    has_head: bool = False
    requests: list[RequestTrace] = field(init=False)
    rates: np.ndarray = field(init=False)  # [γ] per-position conditional rates of the trace
    max_drafted: int = field(init=False)  # the most drafts any traced step had

    def __post_init__(self) -> None:
        self.requests = self.trace.requests()
        if not self.requests:
            raise ValueError("trace has no steps to replay")
        reached, accepted = np.zeros(self.gamma), np.zeros(self.gamma)
        for r in self.requests:
            for ell, a in zip(r.planned, r.accepted, strict=True):
                for j in range(min(ell, a + 1, self.gamma)):
                    reached[j] += 1
                    accepted[j] += j < a
        self.rates = (accepted + 1.0) / (reached + 2.0)  # Laplace: an unseen position is 1/2
        self.max_drafted = max(max(r.drafted) for r in self.requests)

    def start(self, source: int, rng: np.random.Generator) -> _Cursor:
        return _Cursor(self.requests[source % len(self.requests)])

    def block(self, states: list, rng: np.random.Generator) -> Block:
        n, g = len(states), self.gamma
        true_c = np.tile(self.rates, (n, 1))
        uniforms = rng.random((n, g))
        reported = np.tile(self.rates, (n, 1)) if self.has_head else None
        max_drafts = np.full(n, g)
        for i, cur in enumerate(states):
            s = cur.step % len(cur.req.planned)
            cur.step += 1
            ell, a = min(cur.req.planned[s], g), min(cur.req.accepted[s], g)
            if cur.req.drafted[s] < self.max_drafted:
                # The proposer had fewer drafts than usual (an n-gram miss): so does the replay.
                max_drafts[i] = cur.req.drafted[s]
            true_c[i, :a] = 1.0
            uniforms[i, :a] = 0.5
            if a < ell:  # the recorded rejection settles position a + 1 and everything after
                true_c[i, a:] = 0.0
                uniforms[i, a:] = 0.5
            conf = cur.req.confidences[s]
            if reported is not None and conf is not None:
                width = min(len(conf), g)
                reported[i, :width] = conf[:width]
        return Block(true_c, reported, uniforms, max_drafts)
