"""Overload (issue 7, item 5): a bounded admission queue and a load test on loopback.

- Beyond `max_in_flight` admitted requests a call is refused with RESOURCE_EXHAUSTED at once
  (not after waiting for a slot), and the slot frees when a request ends.
- Load: 128 greedy streams opened at once against a server admitting 48. Every admitted
  request completes with exactly the in-process engine's tokens; every other one got
  RESOURCE_EXHAUSTED; clients retry those with backoff until all 128 are served: none lost.
  Afterwards the engine's accounting shows nothing left anywhere.

Reproduce (prints the figures): `OMP_NUM_THREADS=1 pytest tests/e2e/test_load.py -q -s`.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator

import pytest
from leak_checks import IDLE, accounting_when_idle

import dspark
from dspark import errors
from dspark.coordinator.engine import Engine
from dspark.coordinator.limits import Limits
from dspark.coordinator.server import Server
from dspark.sampling_params import SamplingParams

# Larger runs: DSPARK_LOAD_STREAMS=512 DSPARK_LOAD_IN_FLIGHT=128 (CI keeps the defaults).
STREAMS = int(os.environ.get("DSPARK_LOAD_STREAMS", "128"))
MAX_IN_FLIGHT = int(os.environ.get("DSPARK_LOAD_IN_FLIGHT", "48"))
MAX_TOKENS = 24  # a prefix of the reference's 32 greedy tokens
CHANNELS = 4
LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(engine_kwargs) -> Iterator[Server]:
    limits = Limits(max_in_flight=MAX_IN_FLIGHT)
    srv = Server(Engine(**engine_kwargs), limits=limits, grace=1.0).start()
    yield srv
    srv.stop()


def test_full_server_refuses_at_once_then_admits_again(engine_kwargs) -> None:
    """Two long streams fill a server admitting two; a third call is refused within a fraction
    of a second (the streams have seconds left); once one stream ends, a call is served."""
    srv = Server(Engine(**engine_kwargs), limits=Limits(max_in_flight=2), grace=1.0).start()
    try:
        with dspark.Client(srv.address, timeout=60) as client:
            streams = [client.stream("import os\n", LONG) for _ in range(2)]
            for s in streams:
                assert next(s).token_ids  # admitted and running
            start = time.monotonic()
            with pytest.raises(errors.ResourceExhausted) as e:
                client.generate("a", {"max_tokens": 2})
            refused_in = time.monotonic() - start
            assert refused_in < 1.0, f"refusal took {refused_in:.2f} s: it waited for a slot"
            assert "max_in_flight 2" in e.value.details and e.value.code == "RESOURCE_EXHAUSTED"
            assert srv.servicer is not None and srv.servicer.in_flight == 2
            streams[0].close()  # cancel one: its slot frees
            deadline = time.monotonic() + 10
            while srv.servicer.in_flight > 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            out = client.generate("a", {"max_tokens": 2, "temperature": 0})
            assert len(out.token_ids) >= 1
            rest = list(streams[1])
            assert sum(len(c.token_ids) for c in rest) >= 1 and rest[-1].finish_reason == "length"
        assert accounting_when_idle(srv.loop) == IDLE
    finally:
        srv.stop()


def test_load_every_admitted_request_completes_none_lost(
    server: Server, prompts, reference, capsys
) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    jobs = [i % len(prompts) for i in range(STREAMS)]
    outcomes: dict[str, int] = {"completed": 0, "rejected": 0, "retried_ok": 0}
    peak = {"in_flight": 0}
    wrong: list[str] = []

    async def one(ac: dspark.AsyncClient, job: int, attempt: int) -> bool:
        """True once the request completed; False if it was refused for load."""
        try:
            out = await ac.generate(prompts[job], params)
        except errors.ResourceExhausted as e:
            assert "max_in_flight" in e.details
            outcomes["rejected"] += 1
            return False
        ref = reference[job]
        expected = ref.token_ids[:MAX_TOKENS]
        finish = "length" if len(ref.token_ids) > MAX_TOKENS else ref.finish_reason
        if out.token_ids != expected or out.finish_reason != finish:
            wrong.append(f"job {job}: {out.token_ids} != {expected}")
        outcomes["completed" if attempt == 0 else "retried_ok"] += 1
        return True

    async def client_task(ac: dspark.AsyncClient, job: int, rng: random.Random) -> int:
        attempt = 0
        while not await one(ac, job, attempt):
            attempt += 1
            # Exponential backoff with jitter, capped at 2 s (what well-behaved clients do).
            await asyncio.sleep(min(2.0, 0.05 * 2**attempt) * rng.uniform(0.5, 1.5))
        return attempt

    async def watch(stop: asyncio.Event) -> None:
        while not stop.is_set():
            assert server.servicer is not None
            peak["in_flight"] = max(peak["in_flight"], server.servicer.in_flight)
            await asyncio.sleep(0.01)

    async def run() -> list[int]:
        clients = [dspark.AsyncClient(server.address, timeout=120) for _ in range(CHANNELS)]
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        try:
            return await asyncio.wait_for(
                asyncio.gather(
                    *(
                        client_task(clients[i % CHANNELS], job, random.Random(i))
                        for i, job in enumerate(jobs)
                    )
                ),
                timeout=75 * max(1, STREAMS // 128),
            )
        finally:
            stop.set()
            await watcher
            for c in clients:
                await c.close()

    start = time.monotonic()
    attempts = asyncio.run(run())
    elapsed = time.monotonic() - start
    with capsys.disabled():
        print(
            f"\nload: {STREAMS} streams at once, max_in_flight {MAX_IN_FLIGHT}, {MAX_TOKENS} "
            f"tokens each: {outcomes['completed']} completed first time, "
            f"{outcomes['rejected']} RESOURCE_EXHAUSTED, {outcomes['retried_ok']} completed on "
            f"retry (most attempts {max(attempts) + 1}), peak in flight {peak['in_flight']}, "
            f"{elapsed:.1f} s, wrong outputs {len(wrong)}"
        )
    assert not wrong, wrong[:3]
    assert outcomes["completed"] + outcomes["retried_ok"] == STREAMS, "a request was lost"
    if STREAMS > 2 * MAX_IN_FLIGHT:
        assert outcomes["rejected"] > 0, "streams at once never hit the admission bound"
    assert outcomes["completed"] >= MAX_IN_FLIGHT
    assert peak["in_flight"] <= MAX_IN_FLIGHT
    assert server.loop.failure is None
    assert accounting_when_idle(server.loop) == IDLE
