"""`dspark serve` as a user runs it: a subprocess on loopback, found by the address it prints,
used through the SDK and `dspark generate --server`, stopped by SIGTERM.

The Ray case (tp = 2 gloo ranks, 2 draft actors) runs in its own process too, so its local
Ray instance never meets one that another test tier started in the test process.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dspark
from dspark.cli import main as cli_main
from dspark.coordinator.serve import ray_workers_module


class ServeProcess:
    def __init__(self, args: list[str], log: Path, start_timeout: float) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)  # a Ray instance of the test process is not ours to join
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dspark.cli", "serve", *args],
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.banner = self._wait_for("dspark: serving on ", start_timeout)
        self.address = self.banner.split()[3]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def _wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            if line.startswith(prefix):
                return line
        self.proc.kill()
        pytest.fail(f"no {prefix!r} line; server log:\n{self.log.read_text()[-4000:]}")

    def terminate(self, timeout: float) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture
def in_process_server(tmp_path: Path) -> Iterator[ServeProcess]:
    server = ServeProcess(
        [
            "--in-process",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--proposer",
            "draft-model",
            "--policy",
            "fixed",
            "--k",
            "4",
            "--num-blocks",
            "1024",
        ],
        tmp_path / "serve.log",
        start_timeout=120,
    )
    yield server
    server.terminate(30)


def test_serve_prints_address_and_serves(
    in_process_server: ServeProcess, prompts, reference, capsys, greedy
) -> None:
    banner = in_process_server.banner
    assert "in-process engine" in banner and in_process_server.address.startswith("127.0.0.1:")
    metrics_line = in_process_server._wait_for("dspark: metrics on http://127.0.0.1:", 10)
    assert metrics_line.endswith("/metrics")
    with dspark.Client(in_process_server.address, timeout=60) as client:
        out = client.generate(prompts[0], greedy)
    assert out.token_ids == reference[0].token_ids and out.text == reference[0].text
    # The CLI's client path prints the same result.
    rc = cli_main(
        [
            "generate",
            "--server",
            in_process_server.address,
            "--prompt",
            prompts[1],
            "--temperature",
            "0",
            "--max-tokens",
            str(greedy.max_tokens),
            "--json",
        ]
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and printed["token_ids"] == list(reference[1].token_ids)
    assert printed["text"] == reference[1].text and printed["stats"]["target_passes"] >= 1
    # A bad value exits 2 with the server's message.
    rc = cli_main(
        ["generate", "--server", in_process_server.address, "--prompt", "a", "--top-p", "0"]
    )
    assert rc == 2 and "top_p" in capsys.readouterr().err
    assert in_process_server.terminate(30) == 0


def test_generate_server_unreachable_exits_1(capsys) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli_main(["generate", "--server", f"127.0.0.1:{port}", "--prompt", "a", "--timeout", "5"])
    assert rc == 1 and "UNAVAILABLE" in capsys.readouterr().err


@pytest.mark.skipif(
    ray_workers_module() is None,
    reason="Ray worker pools missing: dspark.coordinator.ray_workers.build_ray_workers or ray "
    "cannot be imported",
)
def test_serve_on_ray_tp2_greedy_identical(tmp_path: Path, prompts, reference, greedy) -> None:
    """tp = 2 (gloo) and 2 draft actors on a local Ray instance: same greedy output over gRPC."""
    import asyncio

    server = ServeProcess(
        [
            "--port",
            "0",
            "--metrics-port",
            "-1",
            "--tp",
            "2",
            "--num-draft-actors",
            "2",
            "--proposer",
            "draft-model",
            "--policy",
            "fixed",
            "--k",
            "4",
            "--num-blocks",
            "1024",
        ],
        tmp_path / "serve-ray.log",
        start_timeout=240,
    )
    try:
        assert "ray engine" in server.banner

        async def run() -> tuple[list[dspark.GenerationResult], dict]:
            async with dspark.AsyncClient(server.address, timeout=300) as ac:
                outs = await asyncio.gather(*(ac.generate(p, greedy) for p in prompts))
                return outs, await ac.model_info()

        got, info = asyncio.run(run())
        assert info["tp"] == 2 and info["num_draft_actors"] == 2
        assert len(got) == len(reference) >= 20
        for i, (g, r) in enumerate(zip(got, reference, strict=True)):
            assert g.token_ids == r.token_ids, f"prompt {i}: tokens differ"
            assert g.text == r.text and g.finish_reason == r.finish_reason
            assert g.stats["target_passes"] >= 1
        assert sum(g.stats["accepted_tokens"] for g in got) > 0
    finally:
        rc = server.terminate(120)
    assert rc == 0, server.log.read_text()[-4000:]
