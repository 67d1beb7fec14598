"""`aie serve` as a real process on a free loopback port, for the tests that talk to it over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class ServerProcess:
    """Starts ``aie serve --port 0 ARGS`` and waits until ``/health`` says 200; its stderr (the
    JSON log) goes to a file that ``logs()`` reads. ``stop()`` sends a signal and waits."""

    def __init__(self, args: list[str], log_file: Path, env: dict[str, str] | None = None, ready_s: float = 120.0):
        self.log_file = log_file
        self.process = subprocess.Popen(
            [sys.executable, "-m", "aie_lessons.cli", "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL, stderr=log_file.open("w"), env={**os.environ, **(env or {})})
        self.url = self._wait_for_url(ready_s)
        self._wait_healthy(ready_s)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = LISTENING.search(self.log_file.read_text())
            if found:
                return found.group(1)
            if self.process.poll() is not None:
                raise RuntimeError(f"aie serve exited with {self.process.returncode}:\n{self.log_file.read_text()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"aie serve did not listen within {timeout} s:\n{self.log_file.read_text()}")

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health").status_code == 200:
                return
            if self.process.poll() is not None:
                raise RuntimeError(f"aie serve exited with {self.process.returncode}:\n{self.log_file.read_text()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"aie serve was not healthy within {timeout} s:\n{self.log_file.read_text()}")

    def logs(self) -> list[dict]:
        """The JSON log lines so far (the one human line, 'listening on', is left out)."""
        return [json.loads(line) for line in self.log_file.read_text().splitlines() if line.startswith("{")]

    def metric(self, name: str, labels: str = "") -> float | None:
        from aie_lessons.server.metrics import metric_value

        return metric_value(httpx.get(self.url + "/metrics").text, name, labels)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def sse_payloads(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a streamed response, read as they arrive, up to ``[DONE]``."""
    payloads = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payloads.append(line[len("data: "):])
            if payloads[-1] == "[DONE]":
                break
    return payloads


def wait_until(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not hold within {timeout} s")
