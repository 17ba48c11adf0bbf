"""The soak's report: what became of the requests, their latencies, the faults, the processes'
figures over time, and the verdict (zero lost requests, no wrong answers, flat RSS, flat and then
idle open streams), with the thresholds it was judged by."""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from harness.soak.config import (GRACE_S, IDLE_STREAMS, IDLE_WAIT_S, PROCESS_WARMUP_S, RSS_TOLERANCE,
                                    STREAMS_SLACK, Config, Prompt)
from harness.soak.records import Clock, Event, Request, Sample, round_or_none

OUTCOMES = ("ok", "wrong", "failed", "lost")
UNJUDGED = ("host", "serve")  # not trunks: no stats of their own, RSS only


@dataclass
class SoakRecord:
    """Everything a soak measured, for its report."""

    config: Config
    prompts: Sequence[Prompt]
    prompt_tokens: list[int]
    references: list[str]
    max_requests: int
    setup_s: float
    setup_phases: dict[str, float]
    load_at_start: list[float]
    requests: list[Request]
    events: list[Event]
    samples: list[Sample]
    idle_streams: dict[str, int | None]  # each trunk's open streams once the load ended
    idle_wait_s: float | None
    errors: list[str]
    clock: Clock


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _cause_kind(cause: str) -> str:
    """A cause without what differs between requests (ids, times, byte counts), for counting."""
    cause = re.sub(r"\b\d\d:\d\d:\d\d ", "", cause)
    cause = re.sub(r"\b[0-9a-f]{8,}\b", "<id>", cause)
    return re.sub(r"\b\d+ bytes\b", "N bytes", cause)


def _count(items: Iterable) -> dict:
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _latency(rs: list[Request]) -> dict[str, Any]:
    values = [r.latency_s for r in rs if r.latency_s is not None]
    return {"n": len(values), "p50": round_or_none(_median(values), 3),
            "p99": round_or_none(_percentile(values, 0.99), 3),
            "max": round_or_none(max(values) if values else None, 3)}


def _definitions() -> dict[str, str]:
    return {
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


class SoakReport:
    def __init__(self, record: SoakRecord) -> None:
        self.record = record
        self.by_outcome = {k: [r for r in record.requests if r.outcome == k] for k in OUTCOMES}
        self.unfinished = [r for r in record.requests if r.outcome is None]

    def to_dict(self) -> dict[str, Any]:
        rec, c = self.record, self.record.config
        ok, wrong = self.by_outcome["ok"], self.by_outcome["wrong"]
        failures = self.failures()
        series = self.series()
        return {
            "benchmark": "soak",
            "config": {**asdict(c), "max_requests": rec.max_requests, "grace_s": GRACE_S,
                       "prompts": [{"mode": m, "prompt_tokens": n, "max_tokens": k}
                                   for (m, _, k), n in zip(rec.prompts, rec.prompt_tokens)]},
            "machine": {"cpus": os.cpu_count(), "load_average_at_start": rec.load_at_start,
                        "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
            "setup_s": round(rec.setup_s, 1),
            "setup_phases_s": rec.setup_phases,
            "load_s": round(c.load_s, 1),
            "requests": {"started": len(rec.requests), "completed": len(ok) + len(wrong),
                         "completed_correct": len(ok), "completed_wrong": len(wrong),
                         "failed": len(self.by_outcome["failed"]), "lost": len(self.by_outcome["lost"]),
                         "unfinished": len(self.unfinished), "by_channel": self.by_channel()},
            "latency_s": self.latency(),
            "failures": failures,
            "failure_causes": _count(_cause_kind(f["cause"] or "") for f in failures),
            "wrong": [{"id": r.id, "channel": r.channel, "prompt": r.prompt, "started_s": round(r.started_s, 2),
                       "expected": rec.references[r.prompt][:160], "got": (r.got or "")[:160]} for r in wrong],
            "events": [{**asdict(e), "requests_overlapping": self.overlapping(e)} for e in rec.events],
            "host": self.host_summary(),
            "series": series,
            "verdict": self.verdict(failures, series),
        }

    # --- requests ---

    def in_outage(self, req: Request) -> bool:
        end = req.end_or(self.record.clock.now())
        return any(e.window and req.started_s <= e.window[1] and end >= e.window[0] for e in self.record.events)

    def failures(self) -> list[dict[str, Any]]:
        """The failed, lost and unfinished requests, in the order they started."""
        failures = []
        for r in (*self.by_outcome["failed"], *self.by_outcome["lost"], *self.unfinished):
            failures.append({"id": r.id, "channel": r.channel, "prompt": r.prompt, "started_s": round(r.started_s, 2),
                             "ended_s": None if r.ended_s is None else round(r.ended_s, 2),
                             "outcome": r.outcome or "unfinished", "cause": r.cause, "clear_error": r.clear_error,
                             "in_outage_window": self.in_outage(r)})
        failures.sort(key=lambda f: f["started_s"])
        return failures

    def by_channel(self) -> dict[str, dict[str, int]]:
        reqs = self.record.requests
        return {ch: {k: sum(1 for r in reqs if r.channel == ch and r.outcome == k) for k in OUTCOMES}
                for ch in sorted({r.channel for r in reqs})}

    def latency(self) -> dict[str, Any]:
        ok = self.by_outcome["ok"]
        latency: dict[str, Any] = {"all": _latency(ok),
                                   "ask": _latency([r for r in ok if r.channel.startswith("ask:")]),
                                   "api": _latency([r for r in ok if r.channel.startswith("api:")])}
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        latency["api_first_token"] = {"n": len(ttfts), "p50": round_or_none(_median(ttfts), 3),
                                      "p99": round_or_none(_percentile(ttfts, 0.99), 3)}
        latency["note"] = ("correct requests only, from start to the last byte; an `ask` request's time includes "
                           "starting the process, loading the asker's layers and connecting to the swarm")
        return latency

    def overlapping(self, event: Event) -> dict:
        """How the requests whose lifetime overlapped the event's outage window ended."""
        if not event.window:
            return {}
        a, b = event.window
        return _count(r.outcome or "unfinished" for r in self.record.requests
                      if r.started_s <= b and r.end_or(self.record.clock.now()) >= a)

    # --- the verdict ---

    def verdict(self, failures: list[dict[str, Any]], series: dict[str, Any]) -> dict[str, Any]:
        rec = self.record
        lost = self.by_outcome["lost"]
        rss = self.rss_flatness(series)
        streams = self.streams_flatness(series)
        unexplained = [f for f in failures if f["outcome"] == "failed"
                       and (not f["clear_error"] or not f["in_outage_window"])]
        verdict = {
            "zero_lost_requests": not lost and not self.unfinished and not unexplained,
            "lost": len(lost) + len(self.unfinished),
            "failures_without_clear_error_or_outside_outage": len(unexplained),
            "no_wrong_answers": not self.by_outcome["wrong"],
            "rss_flat": all(v["flat"] for v in rss.values() if v["flat"] is not None),
            "rss": rss,
            "open_streams_flat": all(v["flat"] for v in streams.values() if v["flat"] is not None),
            "open_streams": streams,
            "open_streams_idle": bool(rec.idle_streams) and all(
                v is not None and v <= IDLE_STREAMS for v in rec.idle_streams.values()),
            "open_streams_at_end": rec.idle_streams,
            "open_streams_idle_after_s": rec.idle_wait_s,
            "soak_errors": rec.errors,
        }
        verdict["pass"] = all(verdict[k] for k in ("zero_lost_requests", "no_wrong_answers", "rss_flat",
                                                   "open_streams_flat", "open_streams_idle")) and not rec.errors
        verdict["definitions"] = _definitions()
        return verdict

    # --- the processes over time ---

    def host_summary(self) -> dict[str, Any]:
        samples = self.record.samples
        last = next((s for s in reversed(samples) if s.plan_version is not None), None)
        return {"plan_versions_seen": sorted({s.plan_version for s in samples if s.plan_version is not None}),
                "final_stages": last.stages if last else None, "final_complete": last.complete if last else None,
                "samples_without_host": sum(1 for s in samples if s.host_error is not None)}

    def series(self) -> dict[str, Any]:
        """Per node incarnation: [t, rss MB, open streams, requests held, tensor MB] (None where
        unknown); and the swarm's [t, plan version, complete, stages, requests in flight at the soak]."""
        nodes: dict[str, list] = {}
        for s in self.record.samples:
            for name, n in s.nodes.items():
                key = name
                pids = self._pids(name)
                if len(pids) > 1 and n.pid in pids:
                    key = f"{name}#{pids.index(n.pid) + 1}"
                nodes.setdefault(key, []).append([s.t, n.rss_mb, n.open_streams, n.requests, n.tensor_mb])
        swarm = [[s.t, s.plan_version, s.complete, len(s.stages), s.in_flight] for s in self.record.samples]
        return {"columns": ["t_s", "rss_mb", "open_streams", "requests", "tensor_mb"], "nodes": nodes,
                "swarm_columns": ["t_s", "plan_version", "complete", "n_stages", "in_flight"], "swarm": swarm}

    def _pids(self, name: str) -> list[int]:
        """The node's incarnations, in the order the samples met them."""
        seen: list[int] = []
        for s in self.record.samples:
            node = s.nodes.get(name)
            if node is not None and node.pid is not None and node.pid not in seen:
                seen.append(node.pid)
        return seen

    def _thirds(self, rows: list, column: int) -> tuple[list, list]:
        """A column's values in the middle and the last third of the load, past the process's warm-up."""
        load_s = self.record.config.load_s
        third = load_s / 3
        started = rows[0][0] if rows else 0.0
        usable = [r for r in rows if r[column] is not None and r[0] <= load_s
                  and r[0] >= started + PROCESS_WARMUP_S]
        middle = [r[column] for r in usable if third <= r[0] < 2 * third]
        last = [r[column] for r in usable if r[0] >= 2 * third]
        return middle, last

    def rss_flatness(self, series: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """A trunk's RSS follows the layers the plan gives it (their weights are mapped from the
        file): for trunks, judge RSS less the tensor bytes it holds; for the host and `serve`, RSS."""
        out = {}
        for key, rows in series["nodes"].items():
            trunk = key.split("#")[0] not in UNJUDGED
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

    def streams_flatness(self, series: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out = {}
        for key, rows in series["nodes"].items():
            if key.split("#")[0] in UNJUDGED:
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
