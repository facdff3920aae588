"""Prometheus metrics of the serving coordinator, on its own registry and loopback HTTP endpoint.

Speculation counters follow vLLM's names (`vllm:spec_decode_*` becomes `dspark:spec_decode_*`;
prometheus_client exposes counters with a `_total` suffix, as vLLM's are), so dashboards built for
vLLM read them unchanged:

- num_drafts: request-steps that verified at least one draft (vLLM: one per draft sequence);
- num_draft_tokens: drafts admitted to verification, Σ ℓ_r (vLLM verifies every proposed draft,
  so its "draft tokens" are our verified ones; acceptance rate = accepted / draft tokens);
- num_accepted_tokens: Σ A_r; num_accepted_tokens_per_pos{position}: acceptances at draft slot
  position + 1 (position counts from 0, as vLLM's does).

Everything is updated from the StepStates the engine loop already holds and from host clocks:
observing never touches a device tensor, so it adds no synchronisation to the step.

Example:
    >>> m = ServeMetrics()
    >>> m.observe_queue(waiting=2, running=3)
    >>> b"dspark:num_requests_waiting 2.0" in m.exposition()
    True
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from dspark.messages import StepState

_COUNT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024)
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class ServeMetrics:
    """The coordinator's metrics. Observers are called from the engine-loop thread only."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter(
            "dspark:spec_decode_num_drafts",
            "Request-steps that verified at least one draft.",
            registry=r,
        )
        self.num_draft_tokens = Counter(
            "dspark:spec_decode_num_draft_tokens",
            "Draft tokens admitted to verification (Σ ℓ).",
            registry=r,
        )
        self.num_accepted_tokens = Counter(
            "dspark:spec_decode_num_accepted_tokens",
            "Draft tokens accepted by the target (Σ A).",
            registry=r,
        )
        self.accepted_per_pos = Counter(
            "dspark:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by draft position (0 = first draft).",
            ["position"],
            registry=r,
        )
        self.num_proposed_tokens = Counter(
            "dspark:spec_decode_num_proposed_tokens",
            "Draft tokens the proposer produced, verified or not (Σ γ).",
            registry=r,
        )
        self.budget = Histogram(
            "dspark:spec_decode_budget",
            "Verify budget K the policy chose per step.",
            buckets=_COUNT_BUCKETS,
            registry=r,
        )
        self.verify_length = Histogram(
            "dspark:spec_decode_verify_length",
            "Drafts verified per request per step (ℓ).",
            buckets=_COUNT_BUCKETS[:12],
            registry=r,
        )
        self.accepted_length = Histogram(
            "dspark:spec_decode_accepted_length",
            "Drafts accepted per request per step (A; A + 1 tokens commit).",
            buckets=_COUNT_BUCKETS[:12],
            registry=r,
        )
        self.step_latency = Histogram(
            "dspark:step_latency_seconds",
            "Wall time of one engine step (draft, verify, commit).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.num_waiting = Gauge(
            "dspark:num_requests_waiting",
            "Requests accepted but not yet in the running batch.",
            registry=r,
        )
        self.num_running = Gauge(
            "dspark:num_requests_running", "Requests in the running batch.", registry=r
        )
        self.ttft = Histogram(
            "dspark:time_to_first_token_seconds",
            "From arrival to the first committed token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "dspark:inter_token_latency_seconds",
            "Between successive committed tokens of a request after the first step; a step "
            "committing n tokens after an interval d counts n intervals of d / n.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "dspark:e2e_request_latency_seconds",
            "From arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "dspark:prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "dspark:generation_tokens", "Committed output tokens.", registry=r
        )
        self.request_success = Counter(
            "dspark:request_success",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.request_refused = Counter(
            "dspark:request_refused",
            "Generate calls refused before being served, by gRPC status code.",
            ["code"],
            registry=r,
        )
        self._http: object | None = None

    # --- observers (engine-loop thread) ---------------------------------------------------
    def observe_step(self, state: StepState, seconds: float) -> None:
        self.step_latency.observe(seconds)
        self.budget.observe(state.budget)
        per_pos: list[int] = []
        drafts = draft_tokens = accepted = proposed = generated = 0
        for s in state.requests:
            self.verify_length.observe(s.num_planned)
            proposed += s.num_drafted
            generated += len(s.committed)
            if s.num_planned == 0:
                continue
            self.accepted_length.observe(s.num_accepted)
            drafts += 1
            draft_tokens += s.num_planned
            accepted += s.num_accepted
            per_pos.extend([0] * (s.num_accepted - len(per_pos)))
            for j in range(s.num_accepted):
                per_pos[j] += 1
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(draft_tokens)
        self.num_accepted_tokens.inc(accepted)
        self.num_proposed_tokens.inc(proposed)
        self.generation_tokens.inc(generated)
        for j, n in enumerate(per_pos):
            self.accepted_per_pos.labels(position=str(j)).inc(n)

    def observe_queue(self, waiting: int, running: int) -> None:
        self.num_waiting.set(waiting)
        self.num_running.set(running)

    def observe_tokens(self, num_tokens: int, since_last: float, first: bool) -> None:
        """A request committed `num_tokens` after `since_last` seconds (since arrival if first)."""
        if num_tokens <= 0:
            return
        if first:
            # The other tokens of the first step have no interval of their own: not counted.
            self.ttft.observe(since_last)
            return
        for _ in range(num_tokens):
            self.inter_token.observe(since_last / num_tokens)

    def observe_refused(self, code: str) -> None:
        """A call answered with an error status before any token (server's asyncio loop)."""
        self.request_refused.labels(code=code).inc()

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, seconds: float) -> None:
        self.request_success.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.e2e_latency.observe(seconds)

    # --- exposition -----------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The text format a scrape returns."""
        return generate_latest(self.registry)

    def start_http(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve /metrics on host:port (port 0 picks a free one); returns the bound port."""
        assert self._http is None, "metrics endpoint already started"
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]
            self._http.server_close()  # type: ignore[attr-defined]
            self._http = None
