"""The gRPC service end to end on loopback: a real server (module fixture), the SDK, raw stubs.

Greedy output over gRPC is token- and text-identical to the in-process engine's; streams are
complete and in order; health and reflection answer; errors carry the right status codes;
cancellation and deadlines free the request; the metrics endpoint counts speculation.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import dspark
from dspark import errors
from dspark.coordinator.serve import Service
from dspark.protos import dspark_pb2 as pb
from dspark.protos import dspark_pb2_grpc as pb_grpc
from dspark.sampling_params import SamplingParams

LONG = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(service: Service) -> dspark.Client:
    with dspark.Client(service.address, timeout=60) as c:
        c.wait_ready(10)
        yield c


def _accounting(service: Service) -> tuple[bool, int, int]:
    """(has unfinished requests, reserved blocks, used KV blocks) read on the loop thread."""

    def read(engine) -> tuple[bool, int, int]:
        cache = engine.target.cache
        return (
            engine.has_unfinished(),
            engine._reserved_blocks,
            cache.num_blocks - cache.num_free_blocks,
        )

    return service.server.loop.call(read, timeout=30)


def _wait_idle(service: Service, timeout: float = 20.0) -> tuple[bool, int, int]:
    deadline = time.monotonic() + timeout
    state = _accounting(service)
    while state != (False, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
        state = _accounting(service)
    return state


def _scrape(service: Service) -> dict[str, float]:
    url = f"http://127.0.0.1:{service.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# --- output ---------------------------------------------------------------------------------
def test_greedy_over_grpc_identical_to_in_process(
    service: Service, prompts, reference, greedy
) -> None:
    """All prompts at once through the asyncio client: batched on the server, same output."""

    async def run() -> list[dspark.GenerationResult]:
        async with dspark.AsyncClient(service.address, timeout=120) as ac:
            return await asyncio.gather(*(ac.generate(p, greedy) for p in prompts))

    got = asyncio.run(run())
    assert len(got) == len(reference) >= 20
    for i, (g, r) in enumerate(zip(got, reference, strict=True)):
        assert g.token_ids == r.token_ids, f"prompt {i}: tokens differ"
        assert g.text == r.text, f"prompt {i}: text differs"
        assert g.finish_reason == r.finish_reason
        assert g.prompt_ids == r.prompt_ids
        assert set(g.stats) == set(r.stats)
        assert g.stats["target_passes"] >= 1
    assert isinstance(got[0], dspark.GenerationResult)
    assert sum(g.stats["accepted_tokens"] for g in got) > 0, "speculation never accepted a draft"


def test_stream_chunks_complete_and_in_order(
    client: dspark.Client, prompts, reference, greedy
) -> None:
    for prompt, ref in list(zip(prompts, reference, strict=True))[:4]:
        chunks = list(client.stream(prompt, greedy))
        assert all(not c.finished for c in chunks[:-1]) and chunks[-1].finished
        assert sum((c.token_ids for c in chunks), ()) == ref.token_ids
        assert "".join(c.text for c in chunks) == ref.text
        assert all(c.token_ids for c in chunks), "a chunk without tokens"
        assert len({c.request_id for c in chunks}) == 1
        last = chunks[-1]
        assert last.finish_reason == ref.finish_reason
        assert last.prompt_ids == ref.prompt_ids
        stats = last.stats
        assert stats is not None and stats["target_passes"] == len(chunks)
        assert stats["accepted_tokens"] + stats["target_passes"] >= len(ref.token_ids)
        assert len(stats["accepted_per_position"]) <= 4


def test_stop_strings_cut_as_the_engine_cuts(
    client: dspark.Client, service: Service, prompts, reference, engine_kwargs
) -> None:
    """Stream text never shows a stop string's start; the final text is the engine's."""
    from dspark.coordinator.engine import Engine

    cases = []
    for prompt, ref in zip(prompts, reference, strict=True):
        words = [w for w in ref.text.split() if len(w) >= 3]
        if len(words) >= 3:
            cases.append((prompt, SamplingParams(temperature=0, max_tokens=32, stop=(words[2],))))
        if len(cases) == 3:
            break
    expected = Engine(**engine_kwargs).generate([p for p, _ in cases], [sp for _, sp in cases])
    for (prompt, sp), ref in zip(cases, expected, strict=True):
        chunks = list(client.stream(prompt, sp))
        assert ref.finish_reason == "stop"
        assert "".join(c.text for c in chunks) == ref.text
        assert sum((c.token_ids for c in chunks), ()) == ref.token_ids
        assert chunks[-1].finish_reason == "stop"


def test_token_id_prompt_and_sampling_params_fields(client: dspark.Client, reference) -> None:
    ref = reference[0]
    out = client.generate(list(ref.prompt_ids), SamplingParams(temperature=0, max_tokens=5))
    assert out.token_ids == ref.token_ids[:5] and out.finish_reason == "length"
    stop_at = ref.token_ids[2]
    out = client.generate(
        list(ref.prompt_ids),
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(stop_at,)),
    )
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    # Seeded sampling is reproducible through the server.
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=12, seed=7)
    assert (
        client.generate("def f(x):\n", sp).token_ids == client.generate("def f(x):\n", sp).token_ids
    )


def test_model_info(client: dspark.Client, service: Service) -> None:
    info = client.model_info()
    cfg = service.engine.target.config
    assert info["vocab_size"] == cfg.vocab_size == 4096
    assert info["architecture"] == cfg.architecture
    assert info["max_model_len"] == service.engine.max_model_len
    assert info["proposer"] == "draft-model" and info["policy"] == "fixed" and info["k"] == 4
    assert info["tp"] == 1 and info["eos_token_ids"] == sorted(service.engine.eos_ids)


# --- standard services ----------------------------------------------------------------------
def test_health_serving(service: Service) -> None:
    with grpc.insecure_channel(service.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "dspark.v1.DSpark"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(service: Service) -> None:
    from google.protobuf import descriptor_pb2

    with grpc.insecure_channel(service.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="dspark.v1.DSpark"),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"dspark.v1.DSpark", "grpc.health.v1.Health"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    service_desc = [s for f in files for s in f.service if s.name == "DSpark"]
    assert service_desc and {m.name for m in service_desc[0].method} == {"Generate", "GetModelInfo"}


# --- errors ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, field",
    [
        ({"top_p": 2.0}, "top_p"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -3}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_invalid_argument(client: dspark.Client, params, field: str) -> None:
    """Sent unvalidated (a mapping): the server's SamplingParams check names the field."""
    with pytest.raises(errors.InvalidArgument) as e:
        client.generate("import os\n", params)
    assert e.value.code == "INVALID_ARGUMENT"
    assert f"SamplingParams.{field}=" in e.value.details
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "prompt, words",
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 5000], "outside"),
        ("x" * 20000, "context"),
    ],
)
def test_bad_prompt_invalid_argument(client: dspark.Client, prompt, words: str, greedy) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        client.generate(prompt, greedy)
    assert words in e.value.details


def test_raw_stub_status_codes(service: Service) -> None:
    with grpc.insecure_channel(service.address) as ch:
        stub = pb_grpc.DSparkStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(), timeout=10))  # no prompt at all
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in e.value.details()
        bad = pb.GenerateRequest(text="a", params=pb.SamplingParams(top_p=0.0))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()


def test_unknown_field_refused_locally(client: dspark.Client) -> None:
    with pytest.raises(ValueError, match="no field 'temp'"):
        client.generate("a", {"temp": 0})


def _num_finished(service: Service) -> float:
    """Requests the server ran to their end (any finish reason)."""
    return sum(
        v for k, v in _scrape(service).items() if k.startswith("dspark:request_success_total")
    )


def test_deadline_exceeded_aborts_the_request(client: dspark.Client, service: Service) -> None:
    finished = _num_finished(service)
    with pytest.raises(errors.DeadlineExceeded) as e:
        client.generate("import os\n", LONG, timeout=0.5)
    assert e.value.code == "DEADLINE_EXCEEDED" and isinstance(e.value, TimeoutError)
    assert _wait_idle(service) == (False, 0, 0)
    assert _num_finished(service) == finished, "the request ran on past its deadline"


def test_unavailable_without_server(greedy) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with dspark.Client(f"127.0.0.1:{port}", timeout=5) as c:
        with pytest.raises(errors.Unavailable) as e:
            c.generate("a", greedy)
    assert e.value.code == "UNAVAILABLE" and isinstance(e.value, ConnectionError)


# --- cancellation ---------------------------------------------------------------------------
def test_closing_a_stream_cancels_and_frees(client: dspark.Client, service: Service) -> None:
    finished = _num_finished(service)
    stream = client.stream("import os\n", LONG)
    first = next(stream)
    assert first.token_ids and not first.finished
    stream.close()  # cancels the call; the server aborts the request
    assert _wait_idle(service) == (False, 0, 0)
    assert _num_finished(service) == finished, (
        "the request ran to its end instead of being cancelled"
    )


def test_async_cancel_frees(service: Service) -> None:
    finished = _num_finished(service)

    async def run() -> None:
        async with dspark.AsyncClient(service.address, timeout=60) as ac:
            stream = ac.stream("def main():\n", LONG)
            async for chunk in stream:
                assert chunk.token_ids
                break
            await stream.aclose()

    asyncio.run(run())
    assert _wait_idle(service) == (False, 0, 0)
    assert _num_finished(service) == finished, (
        "the request ran to its end instead of being cancelled"
    )


# --- metrics --------------------------------------------------------------------------------
def test_metrics_counters_move(client: dspark.Client, service: Service, prompts, greedy) -> None:
    """One request's scrape deltas equal its own stats: the counters count exactly it."""
    before = _scrape(service)
    chunks = list(client.stream(prompts[0], greedy))
    after = _scrape(service)
    stats = chunks[-1].stats
    tokens = sum(len(c.token_ids) for c in chunks)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert stats["accepted_tokens"] > 0, "the workload must exercise speculation"
    # vLLM's counters: drafts = request-steps with a verified draft (= admissions at position 1).
    assert delta("dspark:spec_decode_num_drafts_total") == stats["verified_per_position"][0]
    assert delta("dspark:spec_decode_num_draft_tokens_total") == stats["verified_tokens"]
    assert delta("dspark:spec_decode_num_accepted_tokens_total") == stats["accepted_tokens"]
    for j, n in enumerate(stats["accepted_per_position"]):
        assert delta(f"dspark:spec_decode_num_accepted_tokens_per_pos_total{{position={j}}}") == n
    assert delta("dspark:spec_decode_num_proposed_tokens_total") == stats["drafted_tokens"]
    assert delta("dspark:generation_tokens_total") == tokens
    assert delta("dspark:step_latency_seconds_count") == stats["target_passes"]
    assert delta("dspark:spec_decode_budget_count") == stats["target_passes"]
    assert delta("dspark:spec_decode_verify_length_count") == stats["target_passes"]
    assert delta("dspark:time_to_first_token_seconds_count") == 1
    assert delta("dspark:inter_token_latency_seconds_count") == tokens - len(chunks[0].token_ids)
    assert delta("dspark:e2e_request_latency_seconds_count") == 1
    assert delta(f"dspark:request_success_total{{finish_reason={chunks[-1].finish_reason}}}") == 1
    assert after["dspark:num_requests_running"] == 0 and after["dspark:num_requests_waiting"] == 0


def test_refused_calls_are_counted_by_status(client: dspark.Client, service: Service) -> None:
    """Calls answered with an error before any token count in `request_refused` by code, and
    nowhere in the served-request counters."""
    before = _scrape(service)
    with pytest.raises(dspark.errors.InvalidArgument):
        client.generate("import os\n", {"temperature": -1.0, "max_tokens": 4})
    with pytest.raises(dspark.errors.OutOfRange):
        client.generate([1] * 100_000, {"max_tokens": 4})
    after = _scrape(service)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("dspark:request_refused_total{code=INVALID_ARGUMENT}") == 1
    assert delta("dspark:request_refused_total{code=OUT_OF_RANGE}") == 1
    assert delta("dspark:e2e_request_latency_seconds_count") == 0


# --- shutdown -------------------------------------------------------------------------------
def test_stop_finishes_in_flight_calls_within_grace_then_refuses(engine_kwargs) -> None:
    """A call in flight when stop() begins completes (grace 30 s); a later one is refused."""
    import threading

    from dspark.coordinator.engine import Engine
    from dspark.coordinator.server import Server

    server = Server(Engine(**engine_kwargs), grace=30.0).start()
    with dspark.Client(server.address, timeout=60) as c:
        stream = c.stream("import os\n", {"temperature": 0, "max_tokens": 120, "ignore_eos": True})
        first = next(stream)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        rest = list(stream)
        stopper.join(60)
        assert not stopper.is_alive()
        assert rest and rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(ch.token_ids) for ch in rest) == 120
        with pytest.raises(errors.Unavailable):
            c.generate("a", {"max_tokens": 2}, timeout=5)


def test_stop_cancels_calls_past_grace_and_frees(engine_kwargs) -> None:
    from dspark.coordinator.engine import Engine
    from dspark.coordinator.server import Server

    engine = Engine(**engine_kwargs)
    server = Server(engine, grace=0.2).start()
    with dspark.Client(server.address, timeout=60) as c:
        stream = c.stream("import os\n", LONG)
        next(stream)
        server.stop()
        with pytest.raises(errors.DSparkError) as e:
            list(stream)
    assert e.value.code in ("CANCELLED", "UNAVAILABLE")
    # The loop thread has ended: the engine may be read directly now.
    assert not engine.has_unfinished() and engine._reserved_blocks == 0
    assert engine.target.cache.num_free_blocks == engine.target.cache.num_blocks
