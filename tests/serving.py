"""The real `swarmctl serve` as a process on a loopback port, shared by the API's test modules
(OpenAI's and Anthropic's): with no swarm joined it starts a local swarm (host + 2 trunk processes
over QUIC) behind it. Import ``served`` into a test module to use it there (module-scoped: one
server per module)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

API_KEY = "test-key-0123456789"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
STARTUP_TIMEOUT = 120


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`swarmctl serve --port 0 --api-key ...` with no swarm joined: a local swarm behind it."""
    root = tmp_path_factory.mktemp("serve")
    env = {**os.environ, "SWARMCTL_HOME": str(root / "no-swarm-here")}
    out, err = root / "stdout", root / "stderr"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "-v", "--port", "0", "--api-key",
                                    API_KEY], env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
    try:
        starting = _poll_while_starting(process, out, err)
        match = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", out.read_text())
        yield Served(match[1], process, err, starting)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        assert process.returncode == 0, err.read_text()  # SIGTERM stops it cleanly, local swarm and all


def _poll_while_starting(process: subprocess.Popen, out: Path, err: Path) -> list[tuple[int, str | None]]:
    """Wait for "serving ... at URL", asking GET /v1/models with the key meanwhile, as a script
    polling for readiness does (issue 29, item 14): the (status, Retry-After) answers it got
    before the line. The port comes from the "listening at" line that -v logs at once."""
    answers: list[tuple[int, str | None]] = []
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while not re.search(r"serving .* at http://", out.read_text()):
        assert process.poll() is None, f"serve exited: {err.read_text()}"
        assert time.monotonic() < deadline, "serve did not start"
        listening = re.search(r"listening at (http://127\.0\.0\.1:\d+)", err.read_text())
        if listening:
            request = urllib.request.Request(listening[1] + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
            try:
                with urllib.request.urlopen(request, timeout=2) as response:
                    answers.append((response.status, None))
            except urllib.error.HTTPError as e:
                answers.append((e.code, e.headers.get("Retry-After")))
                e.read()
            except OSError as e:  # a client that gives up: what made the server log a 500 before
                answers.append((0, type(e).__name__))
        time.sleep(0.1)
    return answers


@dataclass
class Served:
    base_url: str
    process: subprocess.Popen
    stderr: Path
    starting: list[tuple[int, str | None]]  # what a client polling during start-up got

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=kwargs.pop("api_key", API_KEY), max_retries=0,
                             timeout=120, **kwargs)


def raw_request(base_url: str, path: str, body: bytes | None, headers: dict[str, str] | None = None,
                method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(base_url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
