"""A trunk's ``stats`` reply (``net.messages.Stats``, built by ``stats_reply`` from the parts that
keep each figure), and the figures it reads about itself: its memory, what this machine can offer,
and the recent batches."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from net import messages as m

if TYPE_CHECKING:
    from swarmctl.trunk.service import TrunkService


def proc_status(field: str) -> int:
    """A memory figure of this process from /proc/self/status, in bytes (0 where unavailable)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_memory() -> int:
    """What this machine can offer (MemAvailable), or 8 GB where /proc/meminfo cannot say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 1024**3


def batch_window(runner, window_s: float, wall_time: float) -> list[list]:
    """The runner's batches that started in the last ``window_s`` seconds before ``wall_time``
    (time.time(): a batch's ``started`` is wall-clock time, which ``top`` shows)."""
    since = wall_time - window_s
    return [[b.started, b.seconds, b.tokens, [rid.hex()[:8] for rid in b.request_ids]]
            for b in (runner.stats.recent if runner else ()) if b.started >= since]


def stats_reply(trunk: TrunkService, now: float, wall_time: float, window_s: float) -> m.Stats:
    """``recent_batches`` over the last ``window_s`` seconds before ``wall_time``; ``requests_detail``:
    what the stage holds at ``now`` (the clock routes are stamped with)."""
    held, requests = trunk.held, trunk.requests
    runner, engine, experts = held.runner, held.engine, held.experts
    return m.Stats(
        name=trunk.name, role="experts" if experts else ("stage" if held.stage else "idle"),
        layers=[held.stage.start, held.stage.stop] if held.stage else None,
        expert_range=[experts.first, experts.last] if experts else None,
        time=wall_time, recent_batches=batch_window(runner, window_s, wall_time),
        requests_detail=[{"id": rid.hex()[:8], "position": engine.position_of(rid) if engine else 0,
                          "idle_s": now - route.last_active, "drafted": route.checks.drafted,
                          "accepted": route.checks.accepted} for rid, route in requests.routes.items()],
        requests=engine.n_requests if engine else 0, routes=len(requests.routes),
        kv_bytes=engine.kv_bytes if engine else 0, peak_kv_bytes=requests.peak_kv_bytes,
        queue_depth=runner.queue_depth if runner else 0,
        batches=runner.stats.batches if runner else 0, steps=runner.stats.steps if runner else 0,
        tokens=runner.stats.tokens if runner else 0, busy_s=runner.stats.busy_s if runner else 0.0,
        largest_batch=runner.stats.largest_batch if runner else 0,
        tensor_bytes=engine.weights.n_bytes if engine else (experts.n_bytes if experts else 0),
        budget=held.budget.stats(),
        open_streams=sum(c.open_streams for c in trunk.connections if c.is_open),
        request_locks=len(requests.routes.locks), rss=proc_status("VmRSS"), peak_rss=proc_status("VmHWM"),
        fetched_bytes=held.fetched_bytes, expert_rows_served=trunk.expert_server.rows_served,
        expert_call_bytes=trunk.expert_client.call_bytes + trunk.expert_server.call_bytes,
        activation_bytes_sent=requests.activation_bytes_sent, ms_per_layer_token=trunk.speed.ms_per_layer_token,
        one_stage=requests.one_stage.stats())
