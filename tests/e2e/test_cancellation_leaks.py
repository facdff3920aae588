"""Cancellation and deadlines at volume (issue 7): 1,000 requests end early over gRPC (the
client cancels before the first chunk, cancels after it, or lets a deadline pass) and afterwards
the engine's own accounting shows nothing held anywhere: no queued or running request, no
reserved or used KV block on the target or the drafter, no coordinator-side draft bookkeeping.
The server then still answers a normal request with the reference output."""

from __future__ import annotations

import asyncio
import random

import grpc
from leak_checks import IDLE, accounting_when_idle

from dspark.coordinator.serve import Service
from dspark.protocol import chunk_from_proto, request_to_proto
from dspark.protos import dspark_pb2_grpc as pb_grpc
from dspark.sampling_params import SamplingParams

NUM_REQUESTS = 1000
CONCURRENCY = 40
LONG = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)


async def _one(stub: pb_grpc.DSparkStub, prompt: str, how: str, rng: random.Random) -> str:
    """Start a long request and end it early; returns what the client saw."""
    timeout = rng.uniform(0.02, 0.3) if how == "deadline" else 60.0
    call = stub.Generate(request_to_proto(prompt, LONG), timeout=timeout)
    try:
        if how == "after_first_chunk":
            chunk = chunk_from_proto(await call.read())
            assert chunk.token_ids and not chunk.finished
        elif how == "at_once":
            await asyncio.sleep(rng.uniform(0.0, 0.02))
        else:
            async for _ in call:
                pass
            return "finished"  # the deadline did not pass first: allowed, but counted
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
        return "deadline"
    call.cancel()
    return "cancelled"


async def _storm(address: str, prompts: list[str]) -> dict[str, int]:
    rng = random.Random(0)
    kinds = ["after_first_chunk", "at_once", "deadline"]
    jobs = [(prompts[i % len(prompts)], kinds[i % 3]) for i in range(NUM_REQUESTS)]
    seen: dict[str, int] = {}
    sem = asyncio.Semaphore(CONCURRENCY)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.DSparkStub(channel)

        async def run(prompt: str, how: str) -> None:
            async with sem:
                outcome = await _one(stub, prompt, how, rng)
            seen[outcome] = seen.get(outcome, 0) + 1

        await asyncio.gather(*(run(p, h) for p, h in jobs))
    return seen


def test_thousand_cancelled_or_expired_requests_leak_nothing(
    service: Service, prompts, reference, greedy
) -> None:
    import dspark

    seen = asyncio.run(_storm(service.address, prompts))
    print("outcomes:", seen)
    assert sum(seen.values()) == NUM_REQUESTS
    assert seen.get("cancelled", 0) >= 600 and seen.get("deadline", 0) >= 250, seen
    assert accounting_when_idle(service.server.loop, timeout=60) == IDLE
    with dspark.Client(service.address, timeout=120) as client:
        out = client.generate(prompts[0], greedy)
    assert out.token_ids == reference[0].token_ids  # the server serves on, unharmed
    assert accounting_when_idle(service.server.loop, timeout=60) == IDLE
