"""Soak: minutes of mixed load against a real swarm of separate processes, with faults; prints JSON.

    python benchmarks/soak.py [--minutes 10] [--out FILE] [--seed 1] [--deadline 120] [--no-join]

The swarm is built the way a user builds one, through the CLI (tests/swarm_harness.py): a host
(`init`, `run --role host`), two trunks that `join` with invites and `run --role trunk`, an asker
member, a second member ("friend") and a member that only polls (stats). Then, for --minutes,
bounded in time and in count (--max-requests):

  askers       `swarmctl ask` processes coming and going: --askers of them at once from the asker's
               home (one identity, several processes) and --friend-askers from the friend's home
  API clients  --api-clients streaming HTTP clients (server-sent events, stdlib asyncio) against
               one `swarmctl serve` running on the asker's home (the same identity as those `ask`
               processes): chat prompts through /v1/chat/completions, raw ones through /v1/completions
  prompts      chat and raw prompts of 5 to about 500 tokens, greedy (temperature 0), 8-32 tokens out
  faults       at 20 % of the run the first stage is killed with SIGKILL and restarted --restart-after
               seconds later (same home, no new invite); at 45 % the last stage is frozen with
               SIGSTOP for --freeze seconds, then SIGCONT; at 65 % a new member joins with an invite
               and runs a trunk (the swarm re-plans onto it). A fault also waits until the swarm is
               whole again after the one before, plus QUIET_S.

Before the swarm starts, each prompt's answer is computed once in this process (the asker and two
trunk stages in-process, greedy; in-process and swarm runs are token-identical: tested elsewhere).
A request counts as correct only if its text equals that reference.

Outcomes: "ok" (the reference text), "wrong" (completed, other text), "failed" (an error the
client was told: `ask`'s exit status and its error line, an HTTP error status or an error event in
the stream), "lost" (no answer and no error by the soak's --deadline: the process is killed or the
connection dropped; `ask`'s own deadline is 300 s, `serve`'s 600 s, so a hang shows up as lost).

Every few seconds (--poll) the host's status and each trunk's own `stats` (RSS, open QUIC
streams, requests held, tensor bytes) are read as the member "monitor", and the RSS of the host
and of `serve` from /proc. Each fault
opens an outage window: from the fault until the host reports the swarm complete again with every
running trunk serving, plus GRACE_S.

The verdict (thresholds below, repeated in the JSON):
  zero_lost_requests  no request lost; every failure carried a clear error (a message, no
                      traceback) and overlapped an outage window
  no_wrong_answers    every completed request's text equals its reference
  rss_flat            per process (each incarnation of a restarted trunk on its own): the median RSS
                      over the last third of the run is at most RSS_TOLERANCE above the median over
                      the middle third (the first third is warm-up, and so is the first
                      PROCESS_WARMUP_S of a restarted or new process); for a trunk, RSS less the bytes
                      of the tensors it holds, since re-plans move layers (and their mapped weights)
  open_streams_flat   per trunk: the median open-stream count over the last third is at most
                      STREAMS_SLACK above the middle third's
  open_streams_idle   once the load has stopped and the last request ended, every trunk's open
                      streams fall to IDLE_STREAMS or fewer within IDLE_WAIT_S: the host's plan
                      stream, the stats query itself and, at the last stage, `serve`'s results
                      subscription (a killed `ask`'s connection lasts QUIC's 8 s idle timeout)

Everything the soak starts is stopped when it ends, also on an error or Ctrl-C; `ask` and `serve`
processes also die with the soak (PR_SET_PDEATHSIG) if it is killed outright.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from net.endpoint import Address, ask_member  # noqa: E402
from net.messages import as_dict  # noqa: E402
from swarmctl.commands.status import fetch_status  # noqa: E402
from swarmctl.home import SwarmHome  # noqa: E402
from swarmctl.local_swarm import free_udp_port  # noqa: E402
from tests.swarm_harness import Node, Swarm, die_with_this_process, swarmctl  # noqa: E402

GRACE_S = 5.0  # an outage window lasts until the swarm is whole again, plus this
RSS_TOLERANCE = 0.10  # last third's median RSS at most 10 % above the middle third's
STREAMS_SLACK = 4  # last third's median open streams at most this many above the middle third's
IDLE_STREAMS = 3  # idle trunk: the host's plan stream, the stats query, serve's results subscription
IDLE_WAIT_S = 20.0
PROCESS_WARMUP_S = 60.0  # a (re)started process's first minute is its own warm-up (its allocations grow as it
#                          meets new batch sizes and prompt lengths); its samples then are not judged
STATS_WAIT_S = 4.0  # a sample waits this long for a trunk's stats
QUIET_S = 5.0  # at least this long between one fault's recovery and the next fault

# (mode, text, max_tokens): chat prompts go through the model's chat template, raw ones do not.
_SHELVES = "\n".join(f"Shelf {i}: {3 + (i * 7) % 40} {c} {thing}, counted on day {1 + (i * 5) % 28}."
                     for i, (c, thing) in enumerate(zip(
                         ["red", "blue", "green", "yellow", "black", "white", "grey", "orange"] * 3,
                         ["cups", "plates", "bowls", "forks", "spoons", "knives", "jars", "pans"] * 3), start=1))
_STORY = ("The lighthouse keeper had lived alone on the island for eleven years. Every evening he climbed the "
          "one hundred and twelve steps of the tower, cleaned the great lens with a soft cloth, trimmed the "
          "wick and lit the lamp. Ships passed far out at sea, and he wrote their names in a leather book: "
          "the Margaret, the Northern Star, the Halcyon. In winter the storms came from the west and the "
          "waves broke over the rocks so high that salt crusted the windows of the lamp room. One night, "
          "during the worst storm anyone could remember, the lamp went out.")
PROMPTS: list[tuple[str, str, int]] = [
    ("chat", "Hi!", 12),
    ("raw", "The capital of France is", 8),
    ("chat", "Give me three tips for staying healthy.", 32),
    ("raw", "Once upon a time, in a lighthouse by a cold grey sea,", 24),
    ("raw", "def fibonacci(n):\n", 24),
    ("chat", _STORY + "\n\nWhat do you think happened next? Answer in two sentences.", 16),
    ("raw", "Inventory of the kitchen store room.\n" + _SHELVES + "\nThe shelf with the most items is Shelf", 8),
    ("chat", "Here is a list:\n" + _SHELVES + "\n\nWhich colours appear in the list?", 16),
]


# --- the reference answers ---------------------------------------------------------------------

def reference_answers(prompts: list[tuple[str, str, int]], threads: int) -> tuple[list[str], list[int]]:
    """Each prompt's greedy answer as `swarmctl ask --temperature 0` would print it (without the
    final newline), computed in this process; and each prompt's length in tokens."""
    from kernels.sampling import SamplingParams
    from swarmctl.asker import Asker, InprocTrunk, generate_all, u_split
    from swarmctl.models import default_model_path

    asker = Asker(default_model_path(), 4, n_threads=threads)
    trunk = InprocTrunk(asker.gguf, u_split(asker.spec.n_layer, 4, 2).trunk, n_threads=threads,
                        max_context=asker.max_context)

    def encode(mode: str, text: str) -> list[int]:
        return asker.tokenizer.encode_prompt(text) if mode == "raw" else \
            asker.tokenizer.encode_chat([{"role": "user", "content": text}])

    async def run() -> tuple[list[str], list[int]]:
        texts, lengths = [], []
        for mode, text, max_tokens in prompts:
            tokens = encode(mode, text)
            gen = await generate_all(asker, tokens, trunk, max_tokens=max_tokens,
                                     sampling=SamplingParams(temperature=0))
            decoder = asker.tokenizer.stream_decoder()
            texts.append("".join(decoder.push(t) for t in gen.tokens) + decoder.flush())
            lengths.append(len(tokens))
        return texts, lengths

    try:
        return asyncio.run(run())
    finally:
        trunk.close()
        asker.close()


# --- requests -----------------------------------------------------------------------------------

@dataclass
class Request:
    id: int
    channel: str  # "ask:<member>", "api:chat" or "api:completions"
    prompt: int
    started_s: float
    ended_s: float | None = None
    outcome: str | None = None  # ok, wrong, failed, lost
    cause: str | None = None
    clear_error: bool | None = None  # for failures: the client was told why in words
    ttft_s: float | None = None  # API: first token's arrival
    got: str | None = None

    @property
    def latency_s(self) -> float | None:
        return None if self.ended_s is None else self.ended_s - self.started_s


def _last_line(text: str) -> str:
    """The error line of a CLI's stderr (``swarmctl: error: ...``), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("swarmctl:")]
    return (errors or lines or [""])[-1]


class HttpError(Exception):
    pass


async def _read_http_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise HttpError("the server closed the connection without answering")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = (await reader.readline()).decode("latin-1").strip()
        if not line:
            return status, headers
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The response body as it arrives (chunked or with a Content-Length or until close)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise HttpError("the connection closed inside a chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def api_request(port: int, path: str, body: dict | None, req: Request | None = None,
                      t0: float = 0.0) -> tuple[int, str]:
    """One HTTP/1.1 request to 127.0.0.1:port. Streaming (SSE) answers are parsed: returns the
    status and the text of the deltas; an error event or a stream without [DONE] raises HttpError.
    A non-2xx answer returns (status, the error message)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = json.dumps(body).encode() if body is not None else b""
        method = "POST" if body is not None else "GET"
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status, headers = await _read_http_head(reader)
        if not headers.get("content-type", "").startswith("text/event-stream"):
            raw = b"".join([c async for c in _body_chunks(reader, headers)])
            if status >= 300:
                try:
                    return status, json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    return status, raw.decode(errors="replace")[:200]
            return status, raw.decode()
        pieces, buffer, done = [], b"", False
        async for chunk in _body_chunks(reader, headers):
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.decode().splitlines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        done = True
                        continue
                    message = json.loads(payload)
                    if "error" in message:
                        raise HttpError(f"error event in the stream: {message['error'].get('message')}")
                    for choice in message.get("choices") or []:
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if text:
                            if req is not None and req.ttft_s is None:
                                req.ttft_s = time.monotonic() - t0 - req.started_s
                            pieces.append(text)
        if not done:
            raise HttpError("the stream ended without [DONE] and without an error event")
        return status, "".join(pieces)
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 2)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass


# --- the soak ------------------------------------------------------------------------------------

@dataclass
class Event:
    kind: str  # kill, freeze, join
    node: str
    at_s: float
    action_done_s: float | None = None  # restarted / resumed / started
    recovered_s: float | None = None  # the host reports the swarm complete with every running trunk serving
    window: list[float] | None = None
    note: str = ""


@dataclass
class Config:
    minutes: float = 10.0
    seed: int = 1
    deadline_s: float = 120.0
    askers: int = 3  # concurrent `ask` processes from the asker's home
    friend_askers: int = 1  # ... and from another member's home
    api_clients: int = 2
    max_requests: int = 0  # 0: 150 per minute
    poll_s: float = 3.0
    restart_after_s: float = 5.0
    freeze_s: float = 6.0
    join: bool = True
    kill_at: float = 0.20  # fractions of the load's length; a fault also waits until the swarm has
    freeze_at: float = 0.45  # recovered from the one before and QUIET_S more have passed
    join_at: float = 0.65
    threads: int = 1
    pause_s: float = 1.5  # a client waits up to this long (uniformly) between two requests


def _proc_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


class Soak:
    def __init__(self, config: Config, root: Path, prompts=PROMPTS) -> None:
        self.config = config
        self.root = root
        self.prompts = prompts
        self.swarm = Swarm(root)
        self.rng = random.Random(config.seed)
        self.requests: list[Request] = []
        self.events: list[Event] = []
        self.samples: list[dict] = []
        self.references: list[str] = []
        self.prompt_tokens: list[int] = []
        self.serve: subprocess.Popen | None = None
        self.serve_port: int | None = None
        self.serve_log = root / "serve.log"
        self.children: set[asyncio.subprocess.Process] = set()
        self.frozen: set[int] = set()
        self.incarnation: dict[str, int] = {}  # trunk name -> pid of its current process
        self.t0 = 0.0
        self.load_end_s = config.minutes * 60
        self.max_requests = config.max_requests or int(150 * config.minutes) + 20
        self.setup_s = 0.0
        self.setup_phases: dict[str, float] = {}
        self.idle_streams: dict[str, int | None] = {}
        self.idle_wait_s: float | None = None
        self.errors: list[str] = []
        self.stats_queries: dict[str, asyncio.Future] = {}
        self.tasks: list[asyncio.Future] = []
        self.interrupted = False
        self.reported_exits: set[int] = set()
        self.load_at_start: list[float] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- setup and teardown ---

    def setup(self) -> None:
        started = time.monotonic()

        def phase(name: str) -> None:
            self.setup_phases[name] = round(time.monotonic() - started - sum(self.setup_phases.values()), 1)

        c = self.config
        # the reference answers are computed while the swarm comes up (its nodes are mostly waiting)
        references = ThreadPoolExecutor(1)
        try:
            future = references.submit(reference_answers, self.prompts, self.config.threads)
            self._setup_swarm(phase)
            self.references, self.prompt_tokens = future.result()
            phase("references (what was left of them)")
        finally:
            references.shutdown(wait=True)
        self.setup_s = time.monotonic() - started

    def _setup_swarm(self, phase) -> None:
        c = self.config
        s = self.swarm
        s.init()
        s.start_host()
        s.wait_host()
        phase("host")
        names = ("trunk-a", "trunk-b", "asker", "friend", "monitor")
        codes = [s.invite() for _ in names]  # one at a time: each writes the host's invite records

        def join(name: str, code: str) -> None:
            home = self.root / name
            swarmctl(home, "join", code, "--name", name, "--listen", f"127.0.0.1:{free_udp_port()}", check=True)
            s.homes[name] = home

        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(join, names, codes))
        phase("joins")
        for name in ("trunk-a", "trunk-b"):
            self._start_trunk(name)
        s.wait_complete(2, timeout=120)
        phase("trunks")
        env = {**os.environ, "SWARMCTL_HOME": str(s.homes["asker"]), "OMP_WAIT_POLICY": "PASSIVE"}
        with open(self.serve_log, "wb") as log:
            self.serve = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--port", "0", "--threads",
                                           str(c.threads)], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, preexec_fn=die_with_this_process())
        deadline = time.monotonic() + 120
        while self.serve_port is None:
            text = self.serve_log.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("serving ") and "http://" in line:
                    self.serve_port = int(line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
            if self.serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"swarmctl serve did not start:\n{text[-2000:]}")
            time.sleep(0.2)
        phase("serve")

    def _start_trunk(self, name: str) -> Node:
        node = self.swarm.start_trunk(name, "--threads", str(self.config.threads), capture=False)
        self.incarnation[name] = node.process.pid
        return node

    def _node(self, name: str) -> Node | None:
        home = self.swarm.homes[name]
        return next((n for n in reversed(self.swarm.nodes) if n.home == home and n.alive), None)

    def close(self) -> None:
        for pid in list(self.frozen):  # a stopped process ignores SIGTERM until it runs again
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
        for proc in list(self.children):
            if proc.returncode is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            try:
                self.serve.wait(10)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait()
        self.swarm.close()

    def log_tails(self, n: int = 8) -> dict[str, list[str]]:
        tails = {}
        for path in sorted(self.root.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            tails[path.stem] = lines[-n:]
        return tails

    # --- status and stats ---

    async def status(self) -> dict:
        try:
            return as_dict(await asyncio.wait_for(fetch_status(SwarmHome(self.swarm.homes["monitor"])), 15))
        except Exception as e:  # noqa: BLE001 - an unreachable host is a sample, not an end
            return {"error": f"{type(e).__name__}: {e}"}

    async def trunk_stats(self, member: dict) -> dict:
        """A trunk's `stats`, as member "monitor". A query is never cancelled (a handshake cut short
        leaves its socket behind): one that has not answered within STATS_WAIT_S goes on in the
        background, and the trunk is skipped until it has ended (a frozen or dead trunk answers
        within the connect timeout, 10 s, or the request timeout, 30 s)."""
        name = member["name"]
        pending = self.stats_queries.get(name)
        if pending is None or pending.done():
            creds = SwarmHome(self.swarm.homes["monitor"]).credentials()
            pending = self.stats_queries[name] = asyncio.ensure_future(
                ask_member(Address.parse(member["address"]), creds, name, {"type": "stats"}))
            pending.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here or never
        else:
            return {"error": "the previous stats query has not ended"}
        done, _ = await asyncio.wait({pending}, timeout=STATS_WAIT_S)
        if not done:
            return {"error": f"no stats within {STATS_WAIT_S:.0f} s"}
        try:
            return pending.result()
        except Exception as e:  # noqa: BLE001 - a frozen or dead trunk does not answer
            return {"error": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__}

    async def sample(self) -> dict:
        t = self.now()
        status = await self.status()
        members = [m for m in status.get("members", []) if m.get("role") == "trunk" and m.get("address")]
        stats = await asyncio.gather(*[self.trunk_stats(m) for m in members])
        nodes: dict[str, dict] = {}
        for m, st in zip(members, stats):
            entry = {"health": m.get("health"), "pid": self.incarnation.get(m["name"])}
            if "error" in st:
                entry["error"] = st["error"]
            else:
                entry.update(rss_mb=round(st["rss"] / 2**20, 1) if st.get("rss") else None,
                             open_streams=st.get("open_streams"), requests=st.get("requests"),
                             routes=st.get("routes"), kv_mb=round(st.get("kv_bytes", 0) / 2**20, 2),
                             tensor_mb=round(st.get("tensor_bytes", 0) / 2**20, 1))
            nodes[m["name"]] = entry
        host = self.swarm.nodes[0]
        nodes["host"] = {"rss_mb": _round(_proc_rss_mb(host.process.pid)), "pid": host.process.pid}
        if self.serve is not None:
            nodes["serve"] = {"rss_mb": _round(_proc_rss_mb(self.serve.pid)), "pid": self.serve.pid}
        in_flight = sum(1 for r in self.requests if r.outcome is None)
        sample = {"t": round(t, 2), "plan_version": status.get("plan_version"), "complete": status.get("complete"),
                  "stages": [m["name"] for m in sorted((m for m in status.get("members", []) if m.get("layers")),
                                                        key=lambda m: m["layers"][0])],
                  "in_flight": in_flight, "nodes": nodes}
        if "error" in status:
            sample["host_error"] = status["error"]
        return sample

    def check_processes(self) -> None:
        """A node or `serve` that exits on its own (not killed by a fault) is an error of the run."""
        for node in self.swarm.nodes:
            if not node.alive and node.process.pid not in self.reported_exits:
                self.reported_exits.add(node.process.pid)
                last = _last_line(node.log())
                self.errors.append(f"{node.home.name} exited on its own (code {node.process.returncode}) at "
                                   f"{self.now():.1f} s: {last}")
        if self.serve is not None and self.serve.poll() is not None and self.serve.pid not in self.reported_exits:
            self.reported_exits.add(self.serve.pid)
            self.errors.append(f"serve exited on its own (code {self.serve.returncode}) at {self.now():.1f} s: "
                               f"{_last_line(self.serve_log.read_text(errors='replace'))}")

    async def poller(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            started = time.monotonic()
            self.check_processes()
            self.samples.append(await self.sample())
            try:
                await asyncio.wait_for(stop.wait(), max(0.1, self.config.poll_s - (time.monotonic() - started)))
            except asyncio.TimeoutError:
                pass

    async def whole_again(self, timeout: float = 90.0) -> float | None:
        """Wait until the host reports the swarm complete with every running trunk serving."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = await self.status()
            running = {name for name in self.incarnation if self._is_running(name)}
            serving = {m["name"] for m in status.get("members", []) if m.get("layers")}
            ready = {m["name"] for m in status.get("members", []) if m.get("layers") and m.get("health") == "ready"}
            if status.get("complete") and running <= serving and serving <= ready:
                return self.now()
            await asyncio.sleep(0.5)
        return None

    def _is_running(self, name: str) -> bool:
        home = self.swarm.homes.get(name)
        return any(n.alive for n in self.swarm.nodes if n.home == home)

    async def serving_trunks(self) -> list[str]:
        status = await self.status()
        members = sorted((m for m in status.get("members", []) if m.get("layers") and m.get("role") == "trunk"),
                         key=lambda m: m["layers"][0])
        return [m["name"] for m in members]

    # --- faults ---

    async def faults(self) -> None:
        c = self.config
        plan = [(c.kill_at, self.kill_and_restart), (c.freeze_at, self.freeze)]
        if c.join:
            plan.append((c.join_at, self.join_new_member))
        quiet_from = 0.0
        for fraction, action in plan:
            await asyncio.sleep(max(0.0, fraction * self.load_end_s - self.now(), quiet_from - self.now()))
            if self.now() >= self.load_end_s:
                self.errors.append(f"{action.__name__}: not run, the load had ended (the swarm recovered too slowly)")
                continue
            event = await action()
            if event is None:
                continue
            self.events.append(event)
            event.recovered_s = await self.whole_again()
            end = (event.recovered_s if event.recovered_s is not None else self.now()) + GRACE_S
            event.window = [round(event.at_s, 2), round(end, 2)]
            quiet_from = end - GRACE_S + QUIET_S
            if event.recovered_s is None:
                event.note += " the swarm was not whole again within 90 s"

    async def kill_and_restart(self) -> Event | None:
        stages = [n for n in await self.serving_trunks() if n in self.incarnation]
        if not stages:
            self.errors.append("kill: no serving trunk found")
            return None
        victim = stages[0]
        node = self._node(victim)
        if node is None:
            self.errors.append(f"kill: {victim} serves in the plan but its process is not running")
            return None
        event = Event("kill", victim, self.now(), note="SIGKILL")
        node.process.kill()
        node.process.wait()
        self.swarm.nodes.remove(node)
        await asyncio.sleep(self.config.restart_after_s)
        self._start_trunk(victim)  # same home, same certificate: no new invite
        event.action_done_s = self.now()
        event.note += f", restarted {self.config.restart_after_s:.0f} s later"
        return event

    async def freeze(self) -> Event | None:
        stages = [n for n in await self.serving_trunks() if n in self.incarnation]
        if not stages:
            self.errors.append("freeze: no serving trunk found")
            return None
        victim = stages[-1]
        node = self._node(victim)
        if node is None:
            self.errors.append(f"freeze: {victim} serves in the plan but its process is not running")
            return None
        process = node.process
        event = Event("freeze", victim, self.now(), note=f"SIGSTOP for {self.config.freeze_s:.0f} s, then SIGCONT")
        self.frozen.add(process.pid)
        process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.config.freeze_s)
        finally:
            process.send_signal(signal.SIGCONT)
            self.frozen.discard(process.pid)
        event.action_done_s = self.now()
        return event

    async def join_new_member(self) -> Event | None:
        name = "late"
        event = Event("join", name, self.now(), note="invite + join + run --role trunk")
        try:
            await asyncio.to_thread(self.swarm.join, name)
        except Exception as e:  # noqa: BLE001 - reported, the soak goes on
            self.errors.append(f"join of {name} failed: {e}")
            return None
        self._start_trunk(name)  # in the main thread, as every node is started
        event.action_done_s = self.now()
        return event

    # --- load ---

    def _pick_prompt(self) -> int:
        return self.rng.randrange(len(self.prompts))

    def _may_start(self) -> bool:
        return not self.interrupted and self.now() < self.load_end_s and len(self.requests) < self.max_requests

    def _new_request(self, channel: str) -> Request:
        req = Request(len(self.requests), channel, self._pick_prompt(), self.now())
        self.requests.append(req)
        return req

    def _finish(self, req: Request, outcome: str, cause: str | None = None, got: str | None = None,
                clear: bool | None = None) -> None:
        req.ended_s = self.now()
        if outcome == "ok" and got != self.references[req.prompt]:
            outcome, cause = "wrong", "the text differs from the reference answer"
        req.outcome, req.cause, req.clear_error = outcome, cause, clear
        if outcome == "wrong":
            req.got = got

    async def ask_client(self, member: str, delay: float) -> None:
        await asyncio.sleep(delay)
        while self._may_start():
            req = self._new_request(f"ask:{member}")
            await self.run_ask(req, member)
            await asyncio.sleep(self.rng.uniform(0, self.config.pause_s))

    async def run_ask(self, req: Request, member: str) -> None:
        mode, text, max_tokens = self.prompts[req.prompt]
        args = [sys.executable, "-m", "swarmctl", "ask", "--temperature", "0", "--max-tokens", str(max_tokens),
                "--threads", str(self.config.threads), *(["--raw"] if mode == "raw" else []), text]
        env = {**os.environ, "SWARMCTL_HOME": str(self.swarm.homes[member]), "OMP_WAIT_POLICY": "PASSIVE"}
        proc = await asyncio.create_subprocess_exec(*args, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    preexec_fn=die_with_this_process())
        self.children.add(proc)
        out_task = asyncio.ensure_future(proc.stdout.read())
        err_task = asyncio.ensure_future(proc.stderr.read())
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), self.config.deadline_s)
            except asyncio.TimeoutError:
                timed_out = True
                proc.kill()
                await proc.wait()
            out, err = await asyncio.wait_for(asyncio.gather(out_task, err_task), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            self.children.discard(proc)
        out_text, err_text = out.decode(errors="replace"), err.decode(errors="replace")
        if timed_out:
            tail = " | ".join(line.strip() for line in err_text.strip().splitlines()[-3:]) or "nothing"
            self._finish(req, "lost", f"no answer within the {self.config.deadline_s:.0f}s deadline (killed; "
                                      f"{len(out)} bytes of answer had arrived; stderr ends: {tail})")
        elif proc.returncode != 0:
            line = _last_line(err_text)
            self._finish(req, "failed", f"exit {proc.returncode}: {line or 'no message'}",
                         clear=bool(line) and "Traceback" not in err_text)
        else:
            self._finish(req, "ok", got=out_text[:-1] if out_text.endswith("\n") else out_text)

    async def api_client(self, delay: float) -> None:
        await asyncio.sleep(delay)
        while self._may_start():
            req = self._new_request("api")
            await self.run_api(req)
            await asyncio.sleep(self.rng.uniform(0, self.config.pause_s))

    async def run_api(self, req: Request) -> None:
        """Chat prompts through /v1/chat/completions (the model's chat template, as `ask` uses it),
        raw ones through /v1/completions (as `ask --raw`)."""
        mode, text, max_tokens = self.prompts[req.prompt]
        body: dict = {"model": self.model_id, "temperature": 0, "max_tokens": max_tokens, "stream": True}
        if mode == "chat":
            body["messages"] = [{"role": "user", "content": text}]
            path, req.channel = "/v1/chat/completions", "api:chat"
        else:
            body["prompt"] = text
            path, req.channel = "/v1/completions", "api:completions"
        try:
            status, answer = await asyncio.wait_for(api_request(self.serve_port, path, body, req, self.t0),
                                                    self.config.deadline_s)
        except asyncio.TimeoutError:
            self._finish(req, "lost", f"no answer within the {self.config.deadline_s:.0f}s deadline "
                                      f"(connection closed)")
            return
        except HttpError as e:
            self._finish(req, "failed", str(e), clear=str(e).startswith("error event"))
            return
        except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError) as e:
            self._finish(req, "failed", f"{type(e).__name__}: {e}", clear=False)
            return
        if status != 200:
            self._finish(req, "failed", f"HTTP {status}: {answer}", clear=bool(answer))
        else:
            self._finish(req, "ok", got=answer)

    # --- the run ---

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM: start no more requests and cancel what is under way (a request's own
        cleanup kills its `ask` process or closes its connection)."""
        self.interrupted = True
        for task in self.tasks:
            task.cancel()

    async def run(self, handle_signals: bool = False) -> None:
        status, body = await api_request(self.serve_port, "/v1/models", None)
        self.model_id = json.loads(body)["data"][0]["id"]
        self.load_at_start = [round(x, 2) for x in os.getloadavg()]
        self.t0 = time.monotonic()
        stop_polling = asyncio.Event()
        poller = asyncio.ensure_future(self.poller(stop_polling))
        faults = asyncio.ensure_future(self.faults())
        c = self.config
        kinds = [*[("asker", self.ask_client)] * c.askers, *[("friend", self.ask_client)] * c.friend_askers,
                 *[(None, self.api_client)] * c.api_clients]
        # clients start half a second apart: a cold start of them all at once is not the steady state
        clients = [asyncio.ensure_future(client(member, 0.5 * i) if member else client(0.5 * i))
                   for i, (member, client) in enumerate(kinds)]
        self.tasks = [*clients, faults]
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
        previous = {sig: signal.getsignal(sig) for sig in signals}
        for sig in signals:
            loop.add_signal_handler(sig, self.interrupt)
        try:
            # every client stops starting requests at the end of the load; each request is bounded
            # by its deadline, and a fault's recovery wait by 90 s
            await asyncio.gather(*clients)
            await asyncio.wait_for(faults, max(1.0, self.load_end_s + 120 - self.now()))
            await self.settle_streams()
        except asyncio.CancelledError:
            if not self.interrupted:
                raise
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous[sig])
            faults.cancel()
            stop_polling.set()
            if self.interrupted:  # a client that missed its cancellation stops at its next request
                await asyncio.wait(clients, timeout=15)
                for task in clients:
                    task.cancel()
                await asyncio.gather(*clients, return_exceptions=True)
            await asyncio.gather(poller, faults, return_exceptions=True)
            queries = [q for q in self.stats_queries.values() if not q.done()]
            if queries and not self.interrupted:
                await asyncio.wait(queries, timeout=45)
            for q in queries:
                q.cancel()
            await asyncio.gather(*queries, return_exceptions=True)
        if self.interrupted:
            raise KeyboardInterrupt

    async def settle_streams(self) -> None:
        """After the load: each trunk's open streams, once they stop falling (a stream is forgotten
        only after both sides' ends are acknowledged), waiting at most IDLE_WAIT_S."""
        started = time.monotonic()
        counts: dict[str, int | None] = {}  # each trunk's latest answer (a slow query skips a sample)
        while True:
            sample = await self.sample()
            sample["idle_check"] = True
            self.samples.append(sample)
            for name, n in sample["nodes"].items():
                if name not in ("host", "serve"):
                    counts[name] = n["open_streams"] if n.get("open_streams") is not None else counts.get(name)
            counts = {name: v for name, v in counts.items() if name in sample["nodes"]}
            if (counts and all(v is not None and v <= IDLE_STREAMS for v in counts.values())) or \
                    time.monotonic() - started > IDLE_WAIT_S:
                self.idle_streams = counts
                self.idle_wait_s = round(time.monotonic() - started, 1)
                return
            await asyncio.sleep(1.0)

    # --- the report ---

    def in_outage(self, req: Request) -> bool:
        end = req.ended_s if req.ended_s is not None else self.now()
        return any(e.window and req.started_s <= e.window[1] and end >= e.window[0] for e in self.events)

    def report(self) -> dict:
        c = self.config
        reqs = self.requests
        by_outcome = {k: [r for r in reqs if r.outcome == k] for k in ("ok", "wrong", "failed", "lost")}
        unfinished = [r for r in reqs if r.outcome is None]
        failures = []
        for r in (*by_outcome["failed"], *by_outcome["lost"], *unfinished):
            failures.append({"id": r.id, "channel": r.channel, "prompt": r.prompt, "started_s": round(r.started_s, 2),
                             "ended_s": None if r.ended_s is None else round(r.ended_s, 2),
                             "outcome": r.outcome or "unfinished", "cause": r.cause, "clear_error": r.clear_error,
                             "in_outage_window": self.in_outage(r)})
        failures.sort(key=lambda f: f["started_s"])
        wrong = [{"id": r.id, "channel": r.channel, "prompt": r.prompt, "started_s": round(r.started_s, 2),
                  "expected": self.references[r.prompt][:160], "got": (r.got or "")[:160]} for r in by_outcome["wrong"]]
        channels = sorted({r.channel for r in reqs})
        by_channel = {ch: {k: sum(1 for r in reqs if r.channel == ch and r.outcome == k)
                           for k in ("ok", "wrong", "failed", "lost")} for ch in channels}

        def lat(rs: list[Request]) -> dict:
            values = [r.latency_s for r in rs if r.latency_s is not None]
            return {"n": len(values), "p50": _round(_median(values), 3), "p99": _round(_percentile(values, 0.99), 3),
                    "max": _round(max(values) if values else None, 3)}

        ok = by_outcome["ok"]
        latency = {"all": lat(ok), "ask": lat([r for r in ok if r.channel.startswith("ask:")]),
                   "api": lat([r for r in ok if r.channel.startswith("api:")])}
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        latency["api_first_token"] = {"n": len(ttfts), "p50": _round(_median(ttfts), 3),
                                      "p99": _round(_percentile(ttfts, 0.99), 3)}
        latency["note"] = ("correct requests only, from start to the last byte; an `ask` request's time includes "
                           "starting the process, loading the asker's layers and connecting to the swarm")

        series = self.series()
        rss = self.rss_flatness(series)
        streams = self.streams_flatness(series)
        unexplained = [f for f in failures if f["outcome"] == "failed"
                       and (not f["clear_error"] or not f["in_outage_window"])]
        verdict = {
            "zero_lost_requests": not by_outcome["lost"] and not unfinished and not unexplained,
            "lost": len(by_outcome["lost"]) + len(unfinished),
            "failures_without_clear_error_or_outside_outage": len(unexplained),
            "no_wrong_answers": not by_outcome["wrong"],
            "rss_flat": all(v["flat"] for v in rss.values() if v["flat"] is not None),
            "rss": rss,
            "open_streams_flat": all(v["flat"] for v in streams.values() if v["flat"] is not None),
            "open_streams": streams,
            "open_streams_idle": bool(self.idle_streams) and all(
                v is not None and v <= IDLE_STREAMS for v in self.idle_streams.values()),
            "open_streams_at_end": self.idle_streams,
            "open_streams_idle_after_s": self.idle_wait_s,
            "soak_errors": self.errors,
        }
        verdict["pass"] = all(verdict[k] for k in ("zero_lost_requests", "no_wrong_answers", "rss_flat",
                                                   "open_streams_flat", "open_streams_idle")) and not self.errors
        verdict["definitions"] = {
            "lost": "no answer and no error by the deadline (the client gave up and killed the process or "
                    "closed the connection)",
            "zero_lost_requests": "nothing lost, and every failure had a clear error (a message, no traceback) "
                                  "and overlapped an outage window",
            "outage_window": f"from a fault until the host reports the swarm complete with every running trunk "
                             f"serving, plus {GRACE_S:.0f} s; a failure counts as excused if the request's "
                             f"lifetime overlaps one",
            "rss_flat": f"per process incarnation, samples after the first third of the run and "
                        f"{PROCESS_WARMUP_S:.0f} s after its start: median of the last third <= "
                        f"(1 + {RSS_TOLERANCE}) x median of the middle third; for trunks of RSS less the "
                        f"bytes of the tensors they hold (which follow the plan), for the host and serve of RSS",
            "open_streams_flat": f"per trunk incarnation: median open streams of the last third <= "
                                 f"median of the middle third + {STREAMS_SLACK}",
            "open_streams_idle": f"after the load and its last request: every trunk at <= {IDLE_STREAMS} open "
                                 f"streams within {IDLE_WAIT_S:.0f} s",
        }
        return {
            "benchmark": "soak",
            "config": {**asdict(c), "max_requests": self.max_requests, "grace_s": GRACE_S,
                       "prompts": [{"mode": m, "prompt_tokens": n, "max_tokens": k}
                                   for (m, _, k), n in zip(self.prompts, self.prompt_tokens)]},
            "machine": {"cpus": os.cpu_count(), "load_average_at_start": self.load_at_start,
                        "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
            "setup_s": round(self.setup_s, 1),
            "setup_phases_s": self.setup_phases,
            "load_s": round(self.load_end_s, 1),
            "requests": {"started": len(reqs), "completed": len(ok) + len(by_outcome["wrong"]),
                         "completed_correct": len(ok), "completed_wrong": len(by_outcome["wrong"]),
                         "failed": len(by_outcome["failed"]), "lost": len(by_outcome["lost"]),
                         "unfinished": len(unfinished), "by_channel": by_channel},
            "latency_s": latency,
            "failures": failures,
            "failure_causes": _count(_cause_kind(f["cause"] or "") for f in failures),
            "wrong": wrong,
            "events": [{**asdict(e), "requests_overlapping": self.overlapping(e)} for e in self.events],
            "host": self.host_summary(),
            "series": series,
            "verdict": verdict,
        }

    def overlapping(self, event: Event) -> dict:
        """How the requests whose lifetime overlapped the event's outage window ended."""
        if not event.window:
            return {}
        a, b = event.window
        return _count(r.outcome or "unfinished" for r in self.requests
                      if r.started_s <= b and (r.ended_s if r.ended_s is not None else self.now()) >= a)

    def host_summary(self) -> dict:
        last = next((s for s in reversed(self.samples) if s.get("plan_version") is not None), {})
        return {"plan_versions_seen": sorted({s["plan_version"] for s in self.samples
                                              if s.get("plan_version") is not None}),
                "final_stages": last.get("stages"), "final_complete": last.get("complete"),
                "samples_without_host": sum(1 for s in self.samples if "host_error" in s)}

    def series(self) -> dict:
        """Per node incarnation: [t, rss MB, open streams, requests held] (None where unknown);
        and the swarm's [t, plan version, complete, stages, requests in flight at the soak]."""
        nodes: dict[str, list] = {}
        for s in self.samples:
            for name, n in s["nodes"].items():
                key = name
                pids = [x for x in self._pids(name)]
                if len(pids) > 1 and n.get("pid") in pids:
                    key = f"{name}#{pids.index(n['pid']) + 1}"
                nodes.setdefault(key, []).append([s["t"], n.get("rss_mb"), n.get("open_streams"), n.get("requests"),
                                                  n.get("tensor_mb")])
        swarm = [[s["t"], s.get("plan_version"), s.get("complete"), len(s.get("stages") or []), s["in_flight"]]
                 for s in self.samples]
        return {"columns": ["t_s", "rss_mb", "open_streams", "requests", "tensor_mb"], "nodes": nodes,
                "swarm_columns": ["t_s", "plan_version", "complete", "n_stages", "in_flight"], "swarm": swarm}

    def _pids(self, name: str) -> list[int]:
        seen: list[int] = []
        for s in self.samples:
            pid = s["nodes"].get(name, {}).get("pid")
            if pid is not None and pid not in seen:
                seen.append(pid)
        return seen

    def _thirds(self, rows: list, column: int) -> tuple[list, list]:
        third = self.load_end_s / 3
        started = rows[0][0] if rows else 0.0
        usable = [r for r in rows if r[column] is not None and r[0] <= self.load_end_s
                  and r[0] >= started + PROCESS_WARMUP_S]
        middle = [r[column] for r in usable if third <= r[0] < 2 * third]
        last = [r[column] for r in usable if r[0] >= 2 * third]
        return middle, last

    def rss_flatness(self, series: dict) -> dict:
        """A trunk's RSS follows the layers the plan gives it (their weights are mapped from the
        file): for trunks, judge RSS less the tensor bytes it holds; for the host and `serve`, RSS."""
        out = {}
        for key, rows in series["nodes"].items():
            trunk = key.split("#")[0] not in ("host", "serve")
            if trunk:
                rows = [[r[0], None if r[1] is None or r[4] is None else r[1] - r[4], *r[2:]] for r in rows]
            middle, last = self._thirds(rows, 1)
            if len(middle) < 2 or len(last) < 2:
                out[key] = {"flat": None, "note": "too few samples in the middle or last third"}
                continue
            m, l = statistics.median(middle), statistics.median(last)
            out[key] = {"measure": "rss - tensor bytes" if trunk else "rss",
                        "middle_median_mb": round(m, 1), "last_median_mb": round(l, 1),
                        "ratio": round(l / m, 3), "flat": l <= m * (1 + RSS_TOLERANCE)}
        return out

    def streams_flatness(self, series: dict) -> dict:
        out = {}
        for key, rows in series["nodes"].items():
            if key.split("#")[0] in ("host", "serve"):
                continue
            middle, last = self._thirds(rows, 2)
            values = [r[2] for r in rows if r[2] is not None]
            if len(middle) < 2 or len(last) < 2:
                out[key] = {"flat": None, "max": max(values) if values else None,
                            "note": "too few samples in the middle or last third"}
                continue
            m, l = statistics.median(middle), statistics.median(last)
            out[key] = {"middle_median": m, "last_median": l, "max": max(values),
                        "flat": l <= m + STREAMS_SLACK}
        return out


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _cause_kind(cause: str) -> str:
    """A cause without what differs between requests (ids, times, byte counts), for counting."""
    cause = re.sub(r"\b\d\d:\d\d:\d\d ", "", cause)
    cause = re.sub(r"\b[0-9a-f]{8,}\b", "<id>", cause)
    return re.sub(r"\b\d+ bytes\b", "N bytes", cause)


def _count(items) -> dict:
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def run_soak(config: Config, keep: Path | None = None, prompts: list[tuple[str, str, int]] = PROMPTS,
             handle_signals: bool = False) -> dict:
    """Build the swarm, run the load and the faults, tear everything down; returns the report.
    ``handle_signals``: SIGINT and SIGTERM during the load stop it cleanly (KeyboardInterrupt)."""
    root = Path(tempfile.mkdtemp(prefix="swarmctl-soak-"))
    soak = Soak(config, root, prompts)
    try:
        soak.setup()
        asyncio.run(soak.run(handle_signals))
        result = soak.report()
        if not result["verdict"]["pass"]:  # what the nodes said last, for whoever reads the failures
            result["node_log_tails"] = soak.log_tails()
        return result
    finally:
        soak.close()
        if keep is not None:
            shutil.copytree(root, keep, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    parser.add_argument("--minutes", type=float, default=d.minutes, help="length of the load (default 10)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--deadline", type=float, default=d.deadline_s, dest="deadline_s",
                        help="seconds a request may take before it counts as lost (default 120)")
    parser.add_argument("--askers", type=int, default=d.askers, help="concurrent `ask` processes, asker's home")
    parser.add_argument("--friend-askers", type=int, default=d.friend_askers,
                        help="concurrent `ask` processes from another member's home")
    parser.add_argument("--api-clients", type=int, default=d.api_clients, help="concurrent streaming HTTP clients")
    parser.add_argument("--max-requests", type=int, default=d.max_requests, help="0: 150 per minute")
    parser.add_argument("--poll", type=float, default=d.poll_s, dest="poll_s", help="seconds between stats polls")
    parser.add_argument("--restart-after", type=float, default=d.restart_after_s, dest="restart_after_s")
    parser.add_argument("--freeze", type=float, default=d.freeze_s, dest="freeze_s")
    parser.add_argument("--no-join", action="store_false", dest="join", help="no member joins mid-run")
    parser.add_argument("--threads", type=int, default=d.threads, help="compute threads per process (default 1)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--keep", type=Path, help="copy the nodes' homes and logs here at the end")
    args = parser.parse_args()
    config = Config(**{k: v for k, v in vars(args).items() if k not in ("out", "keep")})

    def interrupted(signum, frame):  # SIGTERM cleans up as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        result = run_soak(config, keep=args.keep, handle_signals=True)
    except KeyboardInterrupt:
        print("soak: interrupted; every process it started has been stopped", file=sys.stderr)
        sys.exit(130)
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
