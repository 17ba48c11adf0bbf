"""The soak's view of the swarm: the host's status and each trunk's own `stats`, read as the member
"monitor"; the RSS of the host and of `serve` from /proc; processes that exit on their own; and
waits on the swarm's state (whole again after a fault, streams closed after the load)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.soak.config import IDLE_STREAMS, IDLE_WAIT_S, RECOVERY_TIMEOUT_S, STATS_WAIT_S
from harness.soak.records import Clock, NodeSample, Sample, round_or_none
from harness.soak.swarm import SoakSwarm, last_line
from net.endpoint import Address, ask_member
from net.messages import MemberStatus, Status
from swarmctl.commands.status import fetch_status
from swarmctl.node.home import SwarmHome

STATUS_TIMEOUT_S = 15.0
STATS_QUERIES_END_S = 45.0  # at the end, a stats query still under way may take this long to end


def proc_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def trunk_sample(member: MemberStatus, stats: dict[str, Any], pid: int | None) -> NodeSample:
    """A trunk as the host lists it, with its `stats` reply (or the error instead of one)."""
    if "error" in stats:
        return NodeSample(pid=pid, health=member.health, error=stats["error"])
    return NodeSample(pid=pid, health=member.health,
                      rss_mb=round(stats["rss"] / 2**20, 1) if stats.get("rss") else None,
                      open_streams=stats.get("open_streams"), requests=stats.get("requests"),
                      routes=stats.get("routes"), kv_mb=round(stats.get("kv_bytes", 0) / 2**20, 2),
                      tensor_mb=round(stats.get("tensor_bytes", 0) / 2**20, 1))


def serving_members(status: Status) -> list[MemberStatus]:
    """The members that hold layers, first stage first."""
    return sorted((m for m in status.members if m.layers), key=lambda m: m.layers[0])


class SwarmMonitor:
    def __init__(self, swarm: SoakSwarm, clock: Clock, errors: list[str], poll_s: float,
                 in_flight: Callable[[], int]) -> None:
        self.swarm = swarm
        self.clock = clock
        self.errors = errors  # the run's own errors, shared with the rest of the soak
        self.poll_s = poll_s
        self.in_flight = in_flight  # requests under way at the soak, for each sample
        self.samples: list[Sample] = []
        self.stats_queries: dict[str, asyncio.Future] = {}  # trunk name -> its latest stats query
        self.reported_exits: set[int] = set()  # pids
        self.idle_streams: dict[str, int | None] = {}  # each trunk's open streams once the load ended
        self.idle_wait_s: float | None = None

    # --- reading the swarm ---

    async def status(self) -> Status | str:
        """The host's status, or why it could not be read."""
        try:
            return await asyncio.wait_for(fetch_status(SwarmHome(self.swarm.homes["monitor"])), STATUS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - an unreachable host is a sample, not an end
            return f"{type(e).__name__}: {e}"

    async def trunk_stats(self, member: MemberStatus) -> dict[str, Any]:
        """A trunk's `stats`, as member "monitor". A query is never cancelled (a handshake cut short
        leaves its socket behind): one that has not answered within STATS_WAIT_S goes on in the
        background, and the trunk is skipped until it has ended (a frozen or dead trunk answers
        within the connect timeout, 10 s, or the request timeout, 30 s)."""
        name = member.name
        pending = self.stats_queries.get(name)
        if pending is None or pending.done():
            creds = SwarmHome(self.swarm.homes["monitor"]).credentials()
            pending = self.stats_queries[name] = asyncio.ensure_future(
                ask_member(Address.parse(member.address), creds, name, {"type": "stats"}))
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

    async def sample(self) -> Sample:
        t = self.clock.now()
        status = await self.status()
        known = isinstance(status, Status)
        members = [m for m in status.members if m.role == "trunk" and m.address] if known else []
        stats = await asyncio.gather(*[self.trunk_stats(m) for m in members])
        nodes = {m.name: trunk_sample(m, st, self.swarm.incarnation.get(m.name)) for m, st in zip(members, stats)}
        host = self.swarm.host
        nodes["host"] = NodeSample(pid=host.process.pid, rss_mb=round_or_none(proc_rss_mb(host.process.pid)))
        serve = self.swarm.serve
        if serve is not None:
            nodes["serve"] = NodeSample(pid=serve.pid, rss_mb=round_or_none(proc_rss_mb(serve.pid)))
        return Sample(t=round(t, 2), plan_version=status.plan_version if known else None,
                      complete=status.complete if known else None,
                      stages=[m.name for m in serving_members(status)] if known else [],
                      in_flight=self.in_flight(), nodes=nodes, host_error=None if known else status)

    async def serving_trunks(self) -> list[str]:
        """The trunks that hold layers, first stage first (none while the host does not answer)."""
        status = await self.status()
        if not isinstance(status, Status):
            return []
        return [m.name for m in serving_members(status) if m.role == "trunk"]

    def check_processes(self) -> None:
        """A node or `serve` that exits on its own (not killed by a fault) is an error of the run."""
        for node in self.swarm.nodes:
            if not node.alive and node.process.pid not in self.reported_exits:
                self.reported_exits.add(node.process.pid)
                last = last_line(node.log())
                self.errors.append(f"{node.home.name} exited on its own (code {node.process.returncode}) at "
                                   f"{self.clock.now():.1f} s: {last}")
        serve = self.swarm.serve
        if serve is not None and serve.poll() is not None and serve.pid not in self.reported_exits:
            self.reported_exits.add(serve.pid)
            self.errors.append(f"serve exited on its own (code {serve.returncode}) at {self.clock.now():.1f} s: "
                               f"{last_line(self.swarm.serve_log.read_text(errors='replace'))}")

    # --- over time ---

    async def poll(self, stop: asyncio.Event) -> None:
        """A sample every poll_s seconds until ``stop`` is set."""
        while not stop.is_set():
            started = time.monotonic()
            self.check_processes()
            self.samples.append(await self.sample())
            try:
                await asyncio.wait_for(stop.wait(), max(0.1, self.poll_s - (time.monotonic() - started)))
            except asyncio.TimeoutError:
                pass

    async def whole_again(self, timeout: float = RECOVERY_TIMEOUT_S) -> float | None:
        """Wait until the host reports the swarm complete with every running trunk serving."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = await self.status()
            if isinstance(status, Status) and status.complete:
                running = {name for name in self.swarm.incarnation if self.swarm.is_running(name)}
                serving = {m.name for m in status.members if m.layers}
                ready = {m.name for m in status.members if m.layers and m.health == "ready"}
                if running <= serving and serving <= ready:
                    return self.clock.now()
            await asyncio.sleep(0.5)
        return None

    async def settle_streams(self) -> None:
        """After the load: each trunk's open streams, once they stop falling (a stream is forgotten
        only after both sides' ends are acknowledged), waiting at most IDLE_WAIT_S."""
        started = time.monotonic()
        counts: dict[str, int | None] = {}  # each trunk's latest answer (a slow query skips a sample)
        while True:
            sample = await self.sample()
            sample.idle_check = True
            self.samples.append(sample)
            for name, n in sample.nodes.items():
                if name not in ("host", "serve"):
                    counts[name] = n.open_streams if n.open_streams is not None else counts.get(name)
            counts = {name: v for name, v in counts.items() if name in sample.nodes}
            if (counts and all(v is not None and v <= IDLE_STREAMS for v in counts.values())) or \
                    time.monotonic() - started > IDLE_WAIT_S:
                self.idle_streams = counts
                self.idle_wait_s = round(time.monotonic() - started, 1)
                return
            await asyncio.sleep(1.0)

    async def end_stats_queries(self, wait: bool) -> None:
        """Let the stats queries still under way end (``wait``: for up to STATS_QUERIES_END_S),
        then cancel what is left."""
        queries = [q for q in self.stats_queries.values() if not q.done()]
        if queries and wait:
            await asyncio.wait(queries, timeout=STATS_QUERIES_END_S)
        for q in queries:
            q.cancel()
        await asyncio.gather(*queries, return_exceptions=True)
