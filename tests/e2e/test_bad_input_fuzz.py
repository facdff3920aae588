"""Bad input over gRPC, fuzzed (issue 7, item 1): every malformed or out-of-limit request gets
its precise status and a message naming the field and value; the server keeps serving (a
bystander client's greedy requests, sent back to back throughout, all come back exact).

Requests go out as raw bytes through a channel method with an identity serializer, so the fuzz
can send what the SDK never would: bad UTF-8, truncated messages, oversized ones. Each example
is one fault at most (or none), so the expected status is a function of the case alone:

| case | status | message names |
| --- | --- | --- |
| no prompt, empty text or ids | INVALID_ARGUMENT | GenerateRequest.prompt, .text, .token_ids.ids |
| token id outside [0, vocab) | INVALID_ARGUMENT | GenerateRequest.token_ids.ids[i]=v |
| SamplingParams outside its domain | INVALID_ARGUMENT | SamplingParams.<field>=<value> |
| stop token id outside the vocabulary | INVALID_ARGUMENT | SamplingParams.stop_token_ids |
| bad UTF-8 in text or a stop string | INVALID_ARGUMENT | GenerateRequest.text / .params.stop[i] |
| truncated message | INVALID_ARGUMENT | not a valid dspark.v1.GenerateRequest |
| more prompt tokens than max_prompt_tokens | OUT_OF_RANGE | GenerateRequest.<field> has N tokens |
| text over the byte bound (refused untokenised) | OUT_OF_RANGE | GenerateRequest.text has N bytes |
| max_tokens over the ceiling | OUT_OF_RANGE | SamplingParams.max_tokens=v |
| message over max_message_bytes | RESOURCE_EXHAUSTED | larger than max |
| a valid request | OK | (completes: 1 ≤ tokens ≤ max_tokens, a finish reason) |

Reproduce: `OMP_NUM_THREADS=1 pytest tests/e2e/test_bad_input_fuzz.py -q`.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from leak_checks import IDLE, accounting_when_idle

import dspark
from dspark import errors
from dspark.coordinator.engine import Engine
from dspark.coordinator.limits import Limits
from dspark.coordinator.server import Server
from dspark.protos import dspark_pb2 as pb
from dspark.sampling_params import MIN_TEMPERATURE, SamplingParams

VOCAB = 4096  # the demo target's
MAX_PROMPT_TOKENS = 128
MAX_TOKENS = 48
MAX_MESSAGE_BYTES = 48 * 1024


@dataclass(frozen=True)
class Case:
    data: bytes  # the request as sent
    code: grpc.StatusCode
    words: tuple[str, ...]  # each must appear in the status message
    max_tokens: int = 0  # OK cases: the request's max_tokens


@pytest.fixture(scope="module")
def server(engine_kwargs) -> Iterator[Server]:
    limits = Limits(
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_tokens=MAX_TOKENS,
        max_in_flight=64,
        max_message_bytes=MAX_MESSAGE_BYTES,
    )
    srv = Server(Engine(**engine_kwargs), limits=limits, grace=1.0).start()
    yield srv
    srv.stop()


class Bystander(threading.Thread):
    """A well-behaved client sending greedy requests back to back while the fuzz runs; each
    answer must be the in-process engine's."""

    def __init__(self, address: str, cases: list, params: SamplingParams) -> None:
        super().__init__(daemon=True)
        self.address, self.cases, self.params = address, cases, params
        self.stop = threading.Event()
        self.served = 0
        self.wrong: list[str] = []

    def run(self) -> None:
        with dspark.Client(self.address, timeout=60) as client:
            while not self.stop.is_set():
                prompt, ref = self.cases[self.served % len(self.cases)]
                try:
                    out = client.generate(prompt, self.params)
                except errors.DSparkError as e:
                    self.wrong.append(f"request {self.served}: {e}")
                    return
                if out.token_ids != ref.token_ids:
                    self.wrong.append(f"request {self.served}: {out.token_ids} != {ref.token_ids}")
                self.served += 1


def _fitting(prompts, reference) -> list:
    """(prompt, reference result) pairs whose prompt fits MAX_PROMPT_TOKENS."""
    fits = [
        (p, r)
        for p, r in zip(prompts, reference, strict=True)
        if len(r.prompt_ids) <= MAX_PROMPT_TOKENS
    ]
    assert len(fits) >= 3
    return fits


@pytest.fixture(scope="module")
def bystander(server: Server, prompts, reference, greedy) -> Iterator[Bystander]:
    b = Bystander(server.address, _fitting(prompts, reference), greedy)
    b.start()
    yield b
    b.stop.set()
    b.join(60)


@pytest.fixture(scope="module")
def raw_generate(server: Server, bystander: Bystander) -> Iterator:
    with grpc.insecure_channel(server.address) as channel:
        # No request serializer: the bytes go out exactly as the case made them.
        yield channel.unary_stream(
            "/dspark.v1.DSpark/Generate",
            request_serializer=None,
            response_deserializer=pb.GenerateChunk.FromString,
        )


# --- strategies ---------------------------------------------------------------------------------
WORDS = ("def", "return", "import", "self", "class", "for", "in", "x", "None", "(", ")", ":")
texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)
valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)


@st.composite
def valid_params(draw: st.DrawFn) -> pb.SamplingParams:
    msg = pb.SamplingParams(max_tokens=draw(st.integers(1, 4)))
    if draw(st.booleans()):
        msg.temperature = 0.0
    else:
        # Typical values and the extremes of each valid range: none may upset the engine.
        msg.temperature = draw(st.floats(0.1, 2.0) | st.floats(MIN_TEMPERATURE, 1e308))
        msg.top_k = draw(st.integers(0, 50) | st.integers(0, 2**63 - 1))
        msg.top_p = draw(st.floats(0.05, 1.0) | st.floats(5e-324, 1.0))
        msg.seed = draw(st.integers(0, 2**63 - 1))
    msg.ignore_eos = draw(st.booleans())
    return msg


@st.composite
def valid_request(draw: st.DrawFn) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(params=draw(valid_params()))
    if draw(st.booleans()):
        msg.text = draw(texts)
    else:
        msg.token_ids.ids.extend(draw(valid_ids))
    return msg


def _case(msg: pb.GenerateRequest, code: grpc.StatusCode, *words: str) -> Case:
    return Case(msg.SerializeToString(), code, words)


@st.composite
def ok_cases(draw: st.DrawFn) -> Case:
    msg = draw(valid_request())
    return Case(msg.SerializeToString(), grpc.StatusCode.OK, (), msg.params.max_tokens)


@st.composite
def empty_prompt_cases(draw: st.DrawFn) -> Case:
    msg = pb.GenerateRequest(params=draw(valid_params()))
    kind = draw(st.sampled_from(["none", "text", "ids"]))
    if kind == "text":
        msg.text = ""
        return _case(msg, grpc.StatusCode.INVALID_ARGUMENT, "GenerateRequest.text is empty")
    if kind == "ids":
        msg.token_ids.SetInParent()
        return _case(
            msg, grpc.StatusCode.INVALID_ARGUMENT, "GenerateRequest.token_ids.ids is empty"
        )
    return _case(msg, grpc.StatusCode.INVALID_ARGUMENT, "GenerateRequest.prompt is empty")


@st.composite
def invalid_id_cases(draw: st.DrawFn) -> Case:
    ids = draw(valid_ids)
    bad = draw(st.one_of(st.integers(-(2**63), -1), st.integers(VOCAB, 2**63 - 1)))
    at = draw(st.integers(0, len(ids)))
    ids.insert(at, bad)
    msg = pb.GenerateRequest(params=draw(valid_params()))
    msg.token_ids.ids.extend(ids)
    return _case(
        msg,
        grpc.StatusCode.INVALID_ARGUMENT,
        f"GenerateRequest.token_ids.ids[{at}]={bad}",
        f"outside the vocabulary [0, {VOCAB})",
    )


@st.composite
def long_prompt_cases(draw: st.DrawFn) -> Case:
    msg = pb.GenerateRequest(params=draw(valid_params()))
    n = draw(st.integers(MAX_PROMPT_TOKENS + 1, 4000))
    rng = random.Random(draw(st.integers(0, 2**32)))  # long lists: seeded, not drawn one by one
    msg.token_ids.ids.extend(rng.randrange(VOCAB) for _ in range(n))
    return _case(
        msg,
        grpc.StatusCode.OUT_OF_RANGE,
        f"GenerateRequest.token_ids.ids has {n} tokens",
        f"at most {MAX_PROMPT_TOKENS}",
    )


@st.composite
def long_text_cases(draw: st.DrawFn, tokenizer, max_prompt_bytes: int) -> Case:
    """Texts past the token limit: under the byte bound they are tokenised and counted, over
    it they are refused by size, untokenised (up to the message limit)."""
    msg = pb.GenerateRequest(params=draw(valid_params()))
    if draw(st.booleans()):
        rng = random.Random(draw(st.integers(0, 2**32)))
        n = draw(st.integers(MAX_PROMPT_TOKENS // 2, max_prompt_bytes // 8))
        msg.text = " ".join(rng.choice(WORDS) for _ in range(n))
        n = len(tokenizer.encode(msg.text))
        if n <= MAX_PROMPT_TOKENS:
            return Case(msg.SerializeToString(), grpc.StatusCode.OK, (), msg.params.max_tokens)
        return _case(msg, grpc.StatusCode.OUT_OF_RANGE, f"GenerateRequest.text has {n} tokens")
    size = draw(st.integers(max_prompt_bytes + 1, MAX_MESSAGE_BYTES - 1024))
    unit = draw(st.sampled_from(["x", "é", " def", "\U0001f600"]))
    msg.text = unit * -(-size // len(unit.encode()))
    nbytes = len(msg.text.encode())
    return _case(msg, grpc.StatusCode.OUT_OF_RANGE, f"GenerateRequest.text has {nbytes} bytes")


# (field, bad value, status, message words)
_NAN = float("nan")
BAD_PARAMS = st.one_of(
    st.tuples(st.just("temperature"), st.floats(max_value=-1e-9) | st.just(_NAN)),
    st.tuples(st.just("temperature"), st.sampled_from([math.inf, -math.inf])),
    st.tuples(st.just("top_k"), st.integers(-(2**63), -1)),
    st.tuples(
        st.just("top_p"), st.floats(min_value=1.0, exclude_min=True) | st.floats(max_value=0)
    ),
    st.tuples(st.just("top_p"), st.just(_NAN)),
    st.tuples(st.just("max_tokens"), st.integers(-(2**63), 0)),
    st.tuples(st.just("seed"), st.integers(-(2**63), -1)),
)


@st.composite
def bad_param_cases(draw: st.DrawFn) -> Case:
    msg = draw(valid_request())
    name, value = draw(BAD_PARAMS)
    setattr(msg.params, name, value)
    return _case(msg, grpc.StatusCode.INVALID_ARGUMENT, f"SamplingParams.{name}=")


@st.composite
def other_bad_param_cases(draw: st.DrawFn) -> Case:
    msg = draw(valid_request())
    kind = draw(st.sampled_from(["tiny temperature", "empty stop", "stop id <0", "stop id >V"]))
    if kind == "tiny temperature":
        msg.params.temperature = draw(st.floats(min_value=1e-320, max_value=MIN_TEMPERATURE / 2))
        words = ("SamplingParams.temperature=", f">= {MIN_TEMPERATURE}")
    elif kind == "empty stop":
        msg.params.stop.extend(["ok", ""])
        words = ("SamplingParams.stop=",)
    elif kind == "stop id <0":
        msg.params.stop_token_ids.append(draw(st.integers(-(2**63), -1)))
        words = ("SamplingParams.stop_token_ids=",)
    else:
        bad = draw(st.integers(VOCAB, 2**63 - 1))
        msg.params.stop_token_ids.extend([1, bad])
        words = ("SamplingParams.stop_token_ids=", f"{bad} is outside the vocabulary")
    return _case(msg, grpc.StatusCode.INVALID_ARGUMENT, *words)


@st.composite
def absurd_max_tokens_cases(draw: st.DrawFn) -> Case:
    msg = draw(valid_request())
    msg.params.max_tokens = draw(st.integers(MAX_TOKENS + 1, 2**63 - 1))
    return _case(
        msg,
        grpc.StatusCode.OUT_OF_RANGE,
        f"SamplingParams.max_tokens={msg.params.max_tokens}",
        f"ceiling {MAX_TOKENS}",
    )


BAD_UTF8 = st.sampled_from(
    [
        b"\xff",
        b"\x80",
        b"\xc3",
        b"\xc3(",
        b"\xed\xa0\x80",
        b"\xf8\x88\x80\x80\x80",
        b"\xc0\xaf",
        b"\xf4\x90\x80\x80",
    ]
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2), built by hand: no UTF-8 check on the way out."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


@st.composite
def bad_utf8_cases(draw: st.DrawFn) -> Case:
    payload = draw(st.text(max_size=8)).encode() + draw(BAD_UTF8) + draw(texts).encode()
    params = draw(valid_params())
    if draw(st.booleans()):  # field 1: text
        data = _field(1, payload) + _field(3, params.SerializeToString())
        return Case(
            data, grpc.StatusCode.INVALID_ARGUMENT, ("GenerateRequest.text is not valid UTF-8",)
        )
    good = draw(st.lists(st.text(min_size=1, max_size=4), max_size=2))
    stops = b"".join(_field(6, s.encode()) for s in good) + _field(6, payload)  # field 6: stop
    data = _field(1, b"def f():") + _field(3, params.SerializeToString() + stops)
    return Case(
        data,
        grpc.StatusCode.INVALID_ARGUMENT,
        (f"GenerateRequest.params.stop[{len(good)}] is not valid UTF-8",),
    )


@st.composite
def truncated_cases(draw: st.DrawFn) -> Case:
    msg = draw(valid_request())
    msg.text = "def main():\n    return 0\n"
    data = msg.SerializeToString()
    cut = draw(st.integers(3, len(msg.text)))  # inside the text's payload: it runs past the end
    text_end = data.index(b"return 0\n") + len(b"return 0\n")
    return Case(
        data[: text_end - cut],
        grpc.StatusCode.INVALID_ARGUMENT,
        ("not a valid dspark.v1.GenerateRequest",),
    )


@st.composite
def oversized_cases(draw: st.DrawFn) -> Case:
    msg = pb.GenerateRequest(params=draw(valid_params()))
    if draw(st.booleans()):
        msg.text = "x" * draw(st.integers(MAX_MESSAGE_BYTES, 3 * MAX_MESSAGE_BYTES))
    else:
        n = draw(st.integers(MAX_MESSAGE_BYTES // 2, MAX_MESSAGE_BYTES))
        msg.token_ids.ids.extend([VOCAB - 1] * n)  # 2 bytes each
    return _case(msg, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max")


def case_kinds(tokenizer, max_prompt_bytes: int) -> dict[str, st.SearchStrategy[Case]]:
    return {
        "ok": ok_cases(),
        "empty prompt": empty_prompt_cases(),
        "invalid id": invalid_id_cases(),
        "long prompt": long_prompt_cases(),
        "long text": long_text_cases(tokenizer, max_prompt_bytes),
        "bad params": bad_param_cases(),
        "other bad params": other_bad_param_cases(),
        "absurd max_tokens": absurd_max_tokens_cases(),
        "bad utf-8": bad_utf8_cases(),
        "truncated": truncated_cases(),
        "oversized": oversized_cases(),
    }


KINDS = list(case_kinds(None, 0))
EXAMPLES_PER_KIND = 14


# --- tests ---------------------------------------------------------------------------------------
def _send(raw_generate, case: Case) -> tuple[grpc.StatusCode, str, list[pb.GenerateChunk]]:
    chunks: list[pb.GenerateChunk] = []
    try:
        for chunk in raw_generate(case.data, timeout=60):
            chunks.append(chunk)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", chunks
    return grpc.StatusCode.OK, "", chunks


@pytest.mark.parametrize("kind", KINDS)
def test_fuzzed_requests_get_precise_statuses(server: Server, raw_generate, kind: str) -> None:
    assert server.checker.max_prompt_bytes is not None
    strategy = case_kinds(server.loop.engine.tokenizer, server.checker.max_prompt_bytes)[kind]
    codes: set[str] = set()

    @settings(
        max_examples=EXAMPLES_PER_KIND,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(case=strategy)
    def check(case: Case) -> None:
        code, details, chunks = _send(raw_generate, case)
        assert code == case.code, f"{case.code.name} expected, got {code.name}: {details!r}"
        for word in case.words:
            assert word in details, f"{word!r} not in {details!r}"
        if code == grpc.StatusCode.OK:
            tokens = sum(len(c.token_ids) for c in chunks)
            assert chunks and chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
            assert 1 <= tokens <= case.max_tokens
        else:
            assert not chunks
        codes.add(code.name)

    check()
    assert codes, "no example ran"


def test_server_serves_correctly_after_the_fuzz(
    server: Server, bystander: Bystander, prompts, reference, greedy
) -> None:
    """Runs after the fuzz (same module server): the bystander was served correctly all
    along, output is still the in-process engine's, health SERVING, the engine never failed,
    and no request left state anywhere."""
    bystander.stop.set()
    bystander.join(60)
    assert not bystander.is_alive() and not bystander.wrong, bystander.wrong[:3]
    assert bystander.served >= 3, f"only {bystander.served} bystander requests during the fuzz"
    fits = _fitting(prompts, reference)[:3]
    with dspark.Client(server.address, timeout=60) as client:
        outs = [client.generate(p, greedy) for p, _ in fits]
        info = client.model_info()
    for out, (_, ref) in zip(outs, fits, strict=True):
        assert out.token_ids == ref.token_ids and out.text == ref.text
    assert info["max_prompt_tokens"] == MAX_PROMPT_TOKENS and info["max_tokens_limit"] == MAX_TOKENS
    assert info["max_message_bytes"] == MAX_MESSAGE_BYTES and info["max_in_flight"] == 64
    assert server.loop.failure is None
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert accounting_when_idle(server.loop) == IDLE


def test_malformed_model_info_request_is_invalid_argument(server: Server) -> None:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(
            "/dspark.v1.DSpark/GetModelInfo",
            request_serializer=None,
            response_deserializer=pb.ModelInfo.FromString,
        )
        with pytest.raises(grpc.RpcError) as e:
            call(b"\xff\xff\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid dspark.v1.GetModelInfoRequest" in e.value.details()


def test_sdk_maps_out_of_range(server: Server) -> None:
    """The SDK raises OutOfRange (an InvalidArgument, so a ValueError) for limits."""
    with dspark.Client(server.address, timeout=30) as client:
        with pytest.raises(errors.OutOfRange) as e:
            client.generate([1] * (MAX_PROMPT_TOKENS + 1), {"max_tokens": 2})
        assert e.value.code == "OUT_OF_RANGE" and isinstance(e.value, ValueError)
        with pytest.raises(errors.OutOfRange, match="max_tokens=1000000"):
            client.generate("a", {"max_tokens": 10**6})
