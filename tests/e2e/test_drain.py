"""Graceful drain on SIGTERM (issue 7, item 5) of a real `dspark serve` subprocess.

SIGTERM while streams run: health turns NOT_SERVING, a new call is refused with UNAVAILABLE
(the server is draining), the streams in flight finish with exactly the in-process engine's
tokens, then the process exits 0. With a short grace, streams still running when it passes are
cancelled and the process still exits 0, promptly.

Reproduce: `OMP_NUM_THREADS=1 pytest tests/e2e/test_drain.py -q`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_serve_cli import ServeProcess

import dspark
from dspark import errors
from dspark.coordinator.engine import Engine
from dspark.sampling_params import SamplingParams

PROMPTS = ("import os\n", "def main():\n", "class Config:\n", "for i in range(10):\n")
LONG = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
# Near the demo models' 512-token context: ~1 s of decoding or more, far past a 0.2 s grace. (With
# 300 tokens and a 1 s grace, a fast machine finished the stream inside the grace.)
LONGEST = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)


def _serve(tmp_path: Path, grace: float) -> ServeProcess:
    args = "--in-process --port 0 --metrics-port -1 --proposer draft-model --policy fixed --k 4"
    return ServeProcess(
        [*args.split(), "--num-blocks", "1024", "--grace", str(grace)],
        tmp_path / "serve.log",
        start_timeout=120,
    )


class Stream(threading.Thread):
    """One stream read to its end on its own thread; `first` is set at its first chunk."""

    def __init__(self, address: str, prompt: str, params: SamplingParams = LONG) -> None:
        super().__init__(daemon=True)
        self.address, self.prompt, self.params = address, prompt, params
        self.first = threading.Event()
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: errors.DSparkError | None = None

    def run(self) -> None:
        try:
            with dspark.Client(self.address, timeout=120) as client:
                for chunk in client.stream(self.prompt, self.params):
                    self.tokens.extend(chunk.token_ids)
                    self.finish = chunk.finish_reason
                    self.first.set()
        except errors.DSparkError as e:
            self.error = e
        finally:
            self.first.set()


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(
            health_pb2.HealthCheckRequest(service="dspark.v1.DSpark"), timeout=5
        ).status


def test_sigterm_drains_in_flight_streams_and_refuses_new_calls(
    tmp_path: Path, engine_kwargs
) -> None:
    expected = Engine(**engine_kwargs).generate(list(PROMPTS), LONG)
    server = _serve(tmp_path, grace=60)
    try:
        assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING
        streams = [Stream(server.address, p) for p in PROMPTS]
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(60) and s.error is None
        server.proc.send_signal(15)  # SIGTERM
        deadline = time.monotonic() + 10
        while _health(server.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            time.sleep(0.05)
        assert any(s.is_alive() for s in streams), "streams ended before the drain was observed"
        with dspark.Client(server.address, timeout=10) as client:
            with pytest.raises(errors.Unavailable) as e:
                client.generate("import sys\n", {"max_tokens": 4})
        assert "draining" in e.value.details
        assert server._wait_for("dspark: stopping: draining", 10)
        for s in streams:
            s.join(120)
        for s, ref in zip(streams, expected, strict=True):
            assert s.error is None, f"{s.prompt!r}: {s.error}"
            assert tuple(s.tokens) == ref.token_ids and s.finish == ref.finish_reason
        assert server.proc.wait(60) == 0
        assert server._wait_for("dspark: stopped", 5)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_sigterm_cancels_streams_past_grace_and_exits_0(tmp_path: Path) -> None:
    server = _serve(tmp_path, grace=0.2)
    try:
        stream = Stream(server.address, PROMPTS[0], LONGEST)
        stream.start()
        assert stream.first.wait(60)
        start = time.monotonic()
        assert server.terminate(30) == 0
        took = time.monotonic() - start
        stream.join(30)
        assert not stream.is_alive()
        assert stream.error is not None and stream.error.code in ("CANCELLED", "UNAVAILABLE")
        assert len(stream.tokens) < LONGEST.max_tokens
        assert took < 15, f"exit took {took:.1f} s with a 0.2 s grace"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
