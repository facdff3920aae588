"""The serving layer's plain parts: wire conversions, incremental detokenisation, the serve
config, the error hierarchy (the e2e tier runs them behind a real server)."""

from __future__ import annotations

import argparse
import random

import pytest

from dspark import errors
from dspark.config import ServeConfig
from dspark.coordinator.detokenize import IncrementalDetokenizer
from dspark.coordinator.request import RequestStats
from dspark.demo import demo_path
from dspark.models.tokenizer import Tokenizer
from dspark.protocol import (
    Chunk,
    chunk_from_proto,
    chunk_to_proto,
    params_from_proto,
    params_to_proto,
    request_from_proto,
    request_to_proto,
)
from dspark.sampling_params import SamplingParams

TEXTS = [
    "def naïve(x):\n    return x * 2  # “quoted” — dash\n",
    "print('日本語のテキスト', 3.14)\n# emoji 🙂🙃 end\n",
    "import os\nimport sys\n\nclass A:\n    pass\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(demo_path("draft-model"))


def test_sampling_params_round_trip() -> None:
    for sp in [
        SamplingParams(),
        SamplingParams(
            temperature=0,
            top_k=5,
            top_p=0.5,
            max_tokens=7,
            stop_token_ids=(3, 4),
            stop=("\n\n", "x"),
            ignore_eos=True,
            seed=2**62,
        ),
    ]:
        assert params_from_proto(params_to_proto(sp)) == sp
    # Unset optional fields take SamplingParams' defaults, not proto zeros.
    assert params_from_proto(params_to_proto({"max_tokens": 9})) == SamplingParams(max_tokens=9)


def test_bad_params_named_by_the_server_side_decode() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p=1\.5"):
        params_from_proto(params_to_proto({"top_p": 1.5}))
    with pytest.raises(ValueError, match="no field 'tempreature'"):
        params_to_proto({"tempreature": 0.0})


def test_request_and_chunk_round_trip() -> None:
    prompt, sp = request_from_proto(request_to_proto([5, 6, 7], SamplingParams(max_tokens=3)))
    assert prompt == (5, 6, 7) and sp.max_tokens == 3
    assert request_from_proto(request_to_proto("", None))[0] == ""
    stats = RequestStats()
    stats.record(4, 3, 2)
    last = Chunk("req-1", (1, 2), "ab", "stop", stats.as_dict(), (9, 9))
    assert chunk_from_proto(chunk_to_proto(last)) == last
    mid = Chunk("req-1", (3,), "c")
    assert chunk_from_proto(chunk_to_proto(mid)) == mid


def _stream(
    tok: Tokenizer, ids: list[int], stop: tuple[str, ...], rng: random.Random
) -> tuple[str, str]:
    """Push ids in random chunks the way the engine commits them; returns (sent, final)."""
    detok = IncrementalDetokenizer(tok.decode, stop)
    sent, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunk, i = ids[i : i + n], i + n
        text = tok.decode(ids[:i])
        hits = [text.find(s) for s in stop if s in text]
        if hits or i >= len(ids):  # the engine finishes here: the final text is cut at the stop
            final = text[: min(hits)] if hits else text
            return sent + detok.finish(final), final
        delta = detok.push(chunk)
        sent += delta
        assert text.startswith(sent), "a delta ran ahead of the decoded text"
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seed", range(5))
def test_incremental_detokenizer_adds_up(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        sent, final = _stream(tokenizer, ids, (), rng)
        assert sent == final == tokenizer.decode(ids)


@pytest.mark.parametrize("seed", range(5))
def test_incremental_detokenizer_never_sends_a_stop_strings_start(
    tokenizer: Tokenizer, seed: int
) -> None:
    rng = random.Random(seed)
    for text, stop in [(TEXTS[0], ("return",)), (TEXTS[1], ("🙃",)), (TEXTS[2], ("\n\n", "zz"))]:
        ids = tokenizer.encode(text)
        sent, final = _stream(tokenizer, ids, stop, rng)
        assert sent == final == text[: text.find(stop[0])]


def test_serve_config_fields_and_flags() -> None:
    parser = argparse.ArgumentParser()
    ServeConfig.add_arguments(parser)
    cfg = ServeConfig.from_arguments(
        parser.parse_args(
            ["--port", "0", "--tp", "2", "--num-draft-actors", "3", "--policy", "equal", "--k", "5"]
        )
    )
    assert (cfg.port, cfg.tp, cfg.num_draft_actors, cfg.policy, cfg.k) == (0, 2, 3, "equal", 5)
    assert ServeConfig.from_arguments(parser.parse_args([])) == ServeConfig()
    assert ServeConfig().host == "127.0.0.1"
    with pytest.raises(SystemExit):
        parser.parse_args(["--proposer", "oracle"])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"port": -1}, "port"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"tp": 0}, "tp"),
        ({"num_draft_actors": 0}, "num_draft_actors"),
        ({"k": 0}, "k"),
        ({"policy": "greedy"}, "policy"),
        ({"dtype": "int8"}, "dtype"),
        ({"grace": -1.0}, "grace"),
        ({"host": ""}, "host"),
        ({"in_process": True, "tp": 2}, "tp"),
    ],
)
def test_serve_config_names_the_bad_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"ServeConfig\.{field}="):
        ServeConfig(**kwargs)


def test_error_hierarchy() -> None:
    e = errors.from_status("INVALID_ARGUMENT", "SamplingParams.top_p=2: must be in (0, 1]")
    assert isinstance(e, errors.InvalidArgument) and isinstance(e, ValueError)
    assert e.code == "INVALID_ARGUMENT" and "top_p" in e.details and "top_p" in str(e)
    assert isinstance(errors.from_status("DEADLINE_EXCEEDED", ""), TimeoutError)
    assert isinstance(errors.from_status("UNAVAILABLE", ""), ConnectionError)
    other = errors.from_status("PERMISSION_DENIED", "no")
    assert type(other) is errors.DSparkError and other.code == "PERMISSION_DENIED"
