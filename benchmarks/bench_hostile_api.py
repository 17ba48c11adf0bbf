"""Hostile requests against `swarmctl serve` (issue 43 items 1-3), and how long its event loop
stalls meanwhile; prints JSON.

    python benchmarks/bench_hostile_api.py [--repo DIR] [--out FILE]

Starts `swarmctl serve --transport inproc` (keyless, loopback: the default a browser can reach),
and sends, one after another: structured-output schemas that crashed it or blocked it
(``maxLength`` 20,000; a pattern ``^a{0,100000}$``; the same through a required tool call; a
100,000-value enum, 1.1 MB), what a web page of another origin can send (a form posting
``text/plain``, a no-cors fetch, a JSON request with a foreign ``Origin``, a DNS-rebinding
``Host``), and two heavy schemas within the limits, sampled (a 1,000-value enum; a pattern of a
quantified group in a quantified group). Meanwhile a thread asks ``GET /v1/models`` every 50 ms
on its own connection: the longest answer during each request is how long the event loop could
not answer anyone (a loop that never stalls answers in about a millisecond). After each request
it checks serve is alive; a serve that died is restarted, so every request is measured on its own.

``--repo`` runs another checkout's serve (e.g. the code before the fix, from ``git archive``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct.Q4_1"
PING_EVERY_S = 0.05
REQUEST_TIMEOUT_S = 180
EVIL = "http://evil.example"


def chat(schema: dict | None = None, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    return body


def tool_call(parameters: dict) -> dict:
    return chat(tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}],
                tool_choice="required")


JSON = {"Content-Type": "application/json"}
HOSTILE: list[tuple[str, dict, dict]] = [  # name, body, headers
    ("maxLength 20000", chat({"type": "string", "maxLength": 20000}), JSON),
    ("pattern ^a{0,100000}$", chat({"type": "string", "pattern": "^a{0,100000}$"}), JSON),
    ("tool maxLength 20000", tool_call({"type": "object", "properties": {"x": {"type": "string", "maxLength": 20000}}}),
     JSON),
    ("form post text/plain", chat(), {"Content-Type": "text/plain", "Origin": EVIL}),
    ("no-cors fetch", chat(), {"Content-Type": "text/plain;charset=UTF-8", "Origin": EVIL,
                               "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Site": "cross-site"}),
    ("foreign Origin, JSON", chat(), {**JSON, "Origin": EVIL}),
    ("DNS rebinding Host", chat(), {**JSON, "Host": "evil.example:{port}"}),
    ("enum 100000 values", chat({"enum": [f"v{i}" for i in range(100_000)]}), JSON),
    ("enum 1000 values, sampled", chat({"enum": [f"value-{i:04d}" for i in range(1000)]}, temperature=1.0,
                                       seed=1, max_tokens=8), JSON),
    ("pattern (a{0,30}){0,33}, sampled", chat({"type": "string", "pattern": "^(a{0,30}){0,33}$"}, temperature=1.0,
                                              seed=1, max_tokens=16), JSON),
]


class Serve:
    def __init__(self, repo: Path) -> None:
        self.home = tempfile.mkdtemp(prefix="bench-hostile-")
        env = {**os.environ, "SWARMCTL_HOME": self.home, "PYTHONPATH": str(repo)}
        self.process = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--transport", "inproc",
                                         "--port", "0", "--threads", "1"], cwd=repo, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        match = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
        if not match:
            raise SystemExit(f"serve did not start: {line!r} {self.process.stderr.read()[-2000:]}")
        self.port = int(match[1])
        threading.Thread(target=self.process.stderr.read, daemon=True).start()  # (never blocks on a full pipe)

    def alive(self) -> bool:
        if self.process.poll() is not None:
            return False
        try:
            return request(self.port, "GET", "/v1/models", None, {}, timeout=30)[0] == 200
        except OSError:
            return False

    def exit_status(self) -> str:
        code = self.process.poll()
        if code is None:
            return "running"
        return f"signal {-code}" if code < 0 else f"exit {code}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def request(port: int, method: str, path: str, body: bytes | None, headers: dict[str, str],
            timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        host = headers.get("Host")
        conn.putrequest(method, path, skip_host=host is not None)
        for name, value in headers.items():
            conn.putheader(name, value.format(port=port))
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Pinger:
    """GET /v1/models every PING_EVERY_S on one kept-alive connection; the longest answer since
    ``mark``."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.longest = 0.0
        self.failures = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def mark(self) -> None:
        self.longest, self.failures = 0.0, 0

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        while not self.stopped.is_set():
            t0 = time.perf_counter()
            try:
                conn.request("GET", "/v1/models")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                self.failures += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
                self.stopped.wait(PING_EVERY_S)
                continue
            self.longest = max(self.longest, time.perf_counter() - t0)
            self.stopped.wait(max(0.0, PING_EVERY_S - (time.perf_counter() - t0)))
        conn.close()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(REQUEST_TIMEOUT_S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose serve runs (default this one)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    serve = Serve(args.repo)
    pinger = Pinger(serve.port)
    rows = []
    try:
        request(serve.port, "POST", "/v1/chat/completions", json.dumps(chat()).encode(), JSON, REQUEST_TIMEOUT_S)
        time.sleep(1.0)  # (a first request warms the chat template up)
        pinger.mark()
        time.sleep(2.0)
        idle = pinger.longest
        for name, body, headers in HOSTILE:
            data = json.dumps(body).encode()
            pinger.mark()
            t0 = time.perf_counter()
            try:
                status, reply = request(serve.port, "POST", "/v1/chat/completions", data, headers, REQUEST_TIMEOUT_S)
                try:
                    error = json.loads(reply).get("error") or {}
                except ValueError:
                    error = {"message": reply[:200].decode(errors="replace")}
            except (OSError, http.client.HTTPException) as e:
                status, error = None, {"message": f"{type(e).__name__}: {e}"}
            elapsed = time.perf_counter() - t0
            time.sleep(0.2)  # a ping after the answer: a loop still busy with this request shows here
            alive = serve.alive()
            row = {"request": name, "body_bytes": len(data), "status": status, "code": error.get("code"),
                   "message": (error.get("message") or "")[:240], "seconds": round(elapsed, 3),
                   "longest_ping_s": round(pinger.longest, 3), "failed_pings": pinger.failures,
                   "serve_alive_after": alive, "serve": serve.exit_status()}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if not alive:  # measure the next request on a fresh serve
                pinger.stop()
                serve.stop()
                serve = Serve(args.repo)
                pinger = Pinger(serve.port)
                time.sleep(1.0)
    finally:
        pinger.stop()
        serve.stop()
    emit_json({"repo": str(args.repo), "ping_every_s": PING_EVERY_S, "idle_longest_ping_s": round(idle, 4),
               "longest_ping_s": max(r["longest_ping_s"] for r in rows),
               "all_alive": all(r["serve_alive_after"] for r in rows), "requests": rows}, args.out)


if __name__ == "__main__":
    main()
