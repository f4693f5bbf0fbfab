"""``aioengine serve`` as a process, end to end: a subprocess on 127.0.0.1, its stderr read line by line.

Its start line (the host it binds by default, the models it names, the URL it answers at), its shutdown modes
on SIGTERM (``finish`` lets the running stream complete, ``abort`` ends it) and its exit status, and a port
already in use. Every wait is on the process (its start line, a stream's events, its exit), never on a fixed
sleep.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_support import (
    LONG,
    PROMPTS,
    SHORT,
    WAIT,
    Streamed,
    assert_aborted,
    assert_finished,
    greedy,
    streaming,
)

REPO = Path(__file__).resolve().parents[1]


# ==== `aioengine serve` as a process ====================================================================
DRAINED = 256
"""Tokens of the stream a "finish" shutdown lets complete: seconds of decoding, so the signal lands mid-stream."""
START_LINE = re.compile(r"aioengine: serving (?P<models>.+) at (?P<url>http://\S+)/v1 \(admin endpoints")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory, llama_ckpt: Path) -> Path:
    path = tmp_path_factory.mktemp("serve") / "serve.toml"
    path.write_text(
        "[server]\nport = 0\n\n"
        '[device]\ndevice = "cpu"\n\n[model]\ndtype = "float32"\n\n[cache]\nnum_blocks = 128\n\n'
        f"[models.tiny.model]\npath = {json.dumps(str(llama_ckpt))}\n"
    )
    return path


def serve_command(config: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "aioengine.cli", "serve", "--config", str(config), *flags]


class Served:
    """``aioengine serve`` in a subprocess; its stderr is read line by line in a thread (so it never blocks)."""

    def __init__(self, command: list[str]) -> None:
        self.process = subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def start_line(self, timeout: float = 120.0) -> re.Match[str]:
        """The line saying the server takes requests (fails if the process ends or stays silent first)."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if match := START_LINE.match(line):
                return match
        raise AssertionError(f"no start line (exit status {self.process.poll()}); stderr:\n{''.join(self.stderr)}")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


@contextlib.contextmanager
def served(config: Path, *flags: str) -> Iterator[tuple[Served, str]]:
    """The process and the URL of its start line; killed at the end whatever happened."""
    process = Served(serve_command(config, *flags))
    try:
        match = process.start_line()
        assert match["models"] == "tiny", match.group(0)
        yield process, match["url"]
    finally:
        process.kill()


def stream_then_terminate(process: Served, url: str, max_tokens: int) -> tuple[Streamed, float]:
    """Streams a completion, sends SIGTERM once it has a token, reads it to its end; returns it and the seconds
    from the signal to that end."""
    got, signalled = Streamed(), 0.0
    body = streaming(greedy(PROMPTS[1], max_tokens))
    with httpx.Client(base_url=url, timeout=WAIT) as client, client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if got.take(line) and not signalled:
                process.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
    assert signalled, "the stream never brought a token"
    return got, time.monotonic() - signalled


@pytest.fixture(scope="module")
def finishing(config_file: Path) -> Iterator[tuple[Served, str]]:
    """One process (``--shutdown finish``, no host given) for the start-line test, then the SIGTERM test that
    ends it: a start costs seconds of CPU kernels and engine set-up."""
    with served(config_file, "--shutdown", "finish") as process_and_url:
        yield process_and_url


def test_serve_starts_on_127_0_0_1_by_default_names_its_models_and_answers_at_its_url(
    finishing: tuple[Served, str],
) -> None:
    _, url = finishing
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
    with httpx.Client(base_url=url, timeout=WAIT) as client:
        models = client.get("/v1/models")
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"]
        answer = client.post("/v1/completions", json=greedy(PROMPTS[0], SHORT))
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == SHORT


def test_sigterm_with_shutdown_finish_lets_the_running_stream_complete_then_exits_0(
    finishing: tuple[Served, str],
) -> None:
    process, url = finishing
    got, _ = stream_then_terminate(process, url, DRAINED)
    assert_finished([got], DRAINED)
    assert process.process.wait(WAIT) == 0, "".join(process.stderr)


def test_sigterm_with_shutdown_abort_ends_the_running_stream_with_abort_and_exits_0(config_file: Path) -> None:
    with served(config_file, "--shutdown", "abort") as (process, url):
        got, seconds = stream_then_terminate(process, url, LONG)
        assert_aborted([got])
        assert seconds < WAIT / 2, f"the aborted stream took {seconds:.1f}s to end"
        assert process.process.wait(WAIT) == 0, "".join(process.stderr)


def test_serve_on_a_port_in_use_fails_with_a_clear_message_and_a_nonzero_status(config_file: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            serve_command(config_file, "--port", str(port)), cwd=REPO, capture_output=True, text=True, timeout=120
        )
    assert result.returncode != 0, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "in use" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
