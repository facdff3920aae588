"""Simulated request streams: when requests arrive and how long their prompts and outputs are.

Arrival processes:
- `batch`: every request at t = 0 (with a replica's `max_num_seqs` this is the engine's own
  `generate(prompts)`: a fixed number in flight, refilled as requests finish);
- `closed`: `clients` users, each sending its next request the moment the last one finished
  (a fixed concurrency, the form of a load test);
- `poisson`: exponential gaps at `rate` requests per second;
- `bursty`: a two-state modulated Poisson process: `burst_factor` times the rate for
  `burst_fraction` of the time, the rest lower, same mean rate; states last `burst_s` on average.

Lengths come from a log-normal with the given mean and coefficient of variation (clipped to
[1, max]), or are replayed from a trace's requests.

Example:
    >>> w = Workload(kind="poisson", num_requests=3, rate=10.0, prompt_mean=16, output_mean=8)
    >>> [r.output_len > 0 for r in w.requests(seed=0)]
    [True, True, True]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from dspark.coordinator.trace import Trace

Kind = Literal["batch", "closed", "poisson", "bursty"]


@dataclass(frozen=True)
class SimRequest:
    """One request of the simulated stream; `source` picks its acceptance behaviour (a traced
    request to replay, or a seed for the per-position model)."""

    index: int
    arrival: float  # seconds; closed loop: filled in when its client sends it
    prompt_len: int
    output_len: int
    source: int


@dataclass(frozen=True)
class Workload:
    kind: Kind = "poisson"
    num_requests: int = 1000
    rate: float = 10.0  # requests/s (poisson, bursty)
    clients: int = 1  # closed loop: users in flight
    prompt_mean: float = 512.0
    prompt_cv: float = 0.5
    output_mean: float = 256.0
    output_cv: float = 0.5
    max_len: int = 8192
    burst_factor: float = 4.0
    burst_fraction: float = 0.2
    burst_s: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in ("batch", "closed", "poisson", "bursty"):
            raise ValueError(f"kind={self.kind!r}: choose batch, closed, poisson or bursty")
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests}: must be >= 1")
        if self.kind in ("poisson", "bursty") and self.rate <= 0:
            raise ValueError(f"rate={self.rate}: must be > 0")
        if self.kind == "bursty" and not 0 < self.burst_fraction * self.burst_factor < 1:
            share = self.burst_factor * self.burst_fraction
            raise ValueError(f"burst_factor·burst_fraction={share}: must be in (0, 1) to keep "
                             "the quiet state's rate positive")

    def requests(self, seed: int = 0, trace: Trace | None = None) -> list[SimRequest]:
        """The stream, in arrival order (closed loop: arrival 0 for the first `clients`)."""
        rng = np.random.default_rng(seed)
        n = self.num_requests
        if trace is not None:
            traced = trace.requests()
            prompts = np.array([traced[i % len(traced)].prompt_len for i in range(n)])
            outputs = np.array([traced[i % len(traced)].output_len for i in range(n)])
        else:
            prompts = _lognormal(rng, self.prompt_mean, self.prompt_cv, n, self.max_len)
            outputs = _lognormal(rng, self.output_mean, self.output_cv, n, self.max_len)
        arrivals = self._arrivals(rng, n)
        return [SimRequest(i, float(arrivals[i]), int(prompts[i]), int(outputs[i]), i)
                for i in range(n)]

    def _arrivals(self, rng: np.random.Generator, n: int) -> np.ndarray:  # [n] seconds
        if self.kind in ("batch", "closed"):
            return np.zeros(n)
        if self.kind == "poisson":
            return np.cumsum(rng.exponential(1.0 / self.rate, n))
        # Bursty: alternate exponential sojourns in a burst and a quiet state.
        hi = self.rate * self.burst_factor
        lo = self.rate * (1 - self.burst_factor * self.burst_fraction) / (1 - self.burst_fraction)
        # One burst + one quiet period last 2·burst_s on average, a burst_fraction of it bursting.
        mean_hi = 2 * self.burst_s * self.burst_fraction
        mean_lo = 2 * self.burst_s * (1 - self.burst_fraction)
        out, t, burst = [], 0.0, False
        while len(out) < n:
            sojourn = rng.exponential(mean_hi if burst else mean_lo)
            rate = hi if burst else lo
            s = t + rng.exponential(1.0 / rate)
            while s < t + sojourn and len(out) < n:
                out.append(s)
                s += rng.exponential(1.0 / rate)
            t, burst = t + sojourn, not burst
        return np.array(out)


def _lognormal(rng: np.random.Generator, mean: float, cv: float, n: int, cap: int) -> np.ndarray:
    if cv <= 0:
        return np.full(n, max(1, int(round(mean))))
    sigma2 = np.log1p(cv * cv)
    mu = np.log(mean) - sigma2 / 2
    return np.clip(np.round(rng.lognormal(mu, np.sqrt(sigma2), n)), 1, cap).astype(int)
