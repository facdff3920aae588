"""The front door's plain parts without a server: request limits, the lenient parser, token
checks, status mapping (issue 7; the e2e tier drives them over gRPC)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark import errors
from dspark.coordinator.auth import BearerTokenInterceptor, load_tokens
from dspark.coordinator.engine_loop import EngineLoop, Rejected
from dspark.coordinator.limits import Limits, RequestChecker, longest_token_bytes
from dspark.demo import demo_path
from dspark.models.tokenizer import Tokenizer
from dspark.protocol import MalformedMessage, lenient_parser
from dspark.protos import dspark_pb2 as pb
from dspark.sampling_params import SamplingParams

TOKENIZER = Tokenizer(demo_path("target"))
VOCAB = 4096


def _checker(max_prompt_tokens: int) -> RequestChecker:
    width = longest_token_bytes(TOKENIZER.decode, VOCAB)
    return RequestChecker(Limits(max_prompt_tokens=max_prompt_tokens), VOCAB, 512, width)


ALPHABETS = (
    "x",
    "ab é\n",
    "def return self\n    ",
    "".join(map(chr, range(32, 0x2FF))),
    "\U0001f600\u4e2d",
)


@st.composite
def texts(draw: st.DrawFn) -> str:
    """Texts of 1 to 1,500 characters (long ones are seeded, not drawn one by one)."""
    alphabet = draw(st.sampled_from(ALPHABETS))
    rng = random.Random(draw(st.integers(0, 2**32)))
    n = draw(st.integers(1, 1500))
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_byte_bound_never_refuses_a_text_that_fits() -> None:
    """A text refused by its size before tokenising really has more tokens than the limit (and
    the fuzz reaches both sides of the bound)."""
    checker = _checker(4)
    assert checker.max_prompt_bytes == 4 * longest_token_bytes(TOKENIZER.decode, VOCAB) * 2
    sides = set()

    @settings(max_examples=200, deadline=None, database=None)
    @given(text=texts())
    def check(text: str) -> None:
        try:
            checker.check_text(text)
            sides.add("tokenised")
        except errors.OutOfRange:
            assert len(TOKENIZER.encode(text)) > 4, text
            sides.add("refused by size")

    check()
    assert sides == {"tokenised", "refused by size"}


def test_limits_resolve_against_the_context() -> None:
    checker = RequestChecker(Limits(max_prompt_tokens=10_000), VOCAB, 512)
    assert checker.max_prompt_tokens == 511 and checker.max_tokens == 512
    assert checker.max_prompt_bytes is None  # unknown token width: no byte bound
    with pytest.raises(ValueError, match="Limits.max_in_flight=0"):
        Limits(max_in_flight=0)


@pytest.mark.parametrize(
    "params, error, words",
    [
        (SamplingParams(max_tokens=513), errors.OutOfRange, "SamplingParams.max_tokens=513"),
        (SamplingParams(stop_token_ids=(4096,)), errors.InvalidArgument, "4096 is outside"),
        (SamplingParams(stop=("x",) * 65), errors.OutOfRange, "SamplingParams.stop has 65"),
        (SamplingParams(stop=("x" * 1025,)), errors.OutOfRange, "stop[0] has 1025 characters"),
    ],
)
def test_param_limits(params: SamplingParams, error: type, words: str) -> None:
    with pytest.raises(error) as e:
        _checker(100).check_params(params)
    assert type(e.value) is error and words in e.value.details


def test_param_limits_accept_the_edges() -> None:
    _checker(100).check_params(
        SamplingParams(max_tokens=512, temperature=1e-6, stop_token_ids=(4095,), stop=("x",) * 64)
    )


def test_lenient_parser_names_the_bad_field() -> None:
    parse = lenient_parser(pb.GenerateRequest)
    ok = pb.GenerateRequest(text="hi", params=pb.SamplingParams(stop=["a", "QQ"]))
    assert parse(ok.SerializeToString()) == ok
    bad = parse(ok.SerializeToString().replace(b"QQ", b"Q\xff"))
    assert isinstance(bad, MalformedMessage)
    assert bad.message.startswith("GenerateRequest.params.stop[1] is not valid UTF-8")
    garbage = parse(b"\x0a\xff\xff\xff\x0f")
    assert isinstance(garbage, MalformedMessage) and "not a valid" in garbage.message


def test_engine_rejection_keeps_its_status_code() -> None:
    """An engine raising OutOfRange (a ValueError) is answered OUT_OF_RANGE, a plain
    ValueError INVALID_ARGUMENT."""

    class RefusingEngine:
        tokenizer = TOKENIZER

        def __init__(self, error: Exception) -> None:
            self.error = error

        def add_request(self, prompt: object, params: object = None) -> str:
            raise self.error

        def has_unfinished(self) -> bool:
            return False

    for error, code in (
        (errors.OutOfRange("prompt longer than the context"), "OUT_OF_RANGE"),
        (ValueError("prompt is empty"), "INVALID_ARGUMENT"),
    ):
        got: list = []
        loop = EngineLoop(RefusingEngine(error)).start()  # type: ignore[arg-type]
        try:
            loop.submit((1, 2), SamplingParams(), got.append)
            loop.call(lambda e: None, timeout=10)  # after the submit: it has been applied
        finally:
            loop.stop()
        assert got == [Rejected(error.details if code == "OUT_OF_RANGE" else str(error), code)]


def test_status_mapping_of_new_codes() -> None:
    for code, cls in (
        ("OUT_OF_RANGE", errors.OutOfRange),
        ("UNAUTHENTICATED", errors.Unauthenticated),
    ):
        e = errors.from_status(code, "why")
        assert type(e) is cls and e.code == code and e.details == "why"
    assert isinstance(errors.from_status("OUT_OF_RANGE", ""), errors.InvalidArgument)


def test_bearer_interceptor_matching() -> None:
    token = b"0123456789abcdef-token"
    auth = BearerTokenInterceptor(
        [b"another-token-000000", token], ["grpc.health.v1.Health", "/x.Y/Open"]
    )
    assert auth.authorized([("authorization", "Bearer 0123456789abcdef-token")])
    assert auth.authorized([("authorization", "bearer 0123456789abcdef-token")])  # scheme: any case
    for bad in ("Bearer 0123456789abcdef-toke", "0123456789abcdef-token", "Basic x", ""):
        assert not auth.authorized([("authorization", bad)])
    assert not auth.authorized([]) and not auth.authorized(None)
    assert auth.exempt("/grpc.health.v1.Health/Check") and auth.exempt("/x.Y/Open")
    assert not auth.exempt("/x.Y/Close") and not auth.exempt("/grpc.health.v1.HealthX/Check")
    assert not auth.exempt("/dspark.v1.DSpark/Generate")


def test_token_sources() -> None:
    env = {"DSPARK_AUTH_TOKEN": "  from-the-environment-01  "}
    assert load_tokens(None, "DSPARK_AUTH_TOKEN", env) == (
        (b"from-the-environment-01",),
        "environment variable DSPARK_AUTH_TOKEN",
    )
    assert load_tokens(None, "", env) == ((), "")
    assert load_tokens(None, "DSPARK_AUTH_TOKEN", {}) == ((), "")
    with pytest.raises(ValueError, match="ServeConfig.auth_token_env='T': a token must be"):
        load_tokens(None, "T", {"T": "short"})
