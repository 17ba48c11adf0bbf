"""A request's per-token trace, in Chrome's trace-event format (``swarmctl ask --trace FILE``,
``swarmctl serve --trace DIR``): open it in ui.perfetto.dev or chrome://tracing.

One process row per node (the asker, each trunk stage in route order, each expert node), one
complete ("X") event per span. Every step of the request (a generated token, or a speculative
step's several) shows where its time went, in the order it went there:

    asker: head queue, head (embedding + first layers)
    asker: reroute (only where the step's route failed: from its first sending to the last)
    wire:  asker → first stage                      ┐
    stage: queue, compute (its expert calls inside)  │ the trunk round trip, measured by the asker
    wire:  stage → next stage ... last stage → asker ┘
    asker: tail queue, tail (last layers + LM head), sample

Clocks are never assumed to agree. Everything is placed on the asker's clock: the asker measures
each round trip itself (from its packet leaving to the result's frame arriving); each stage
reports, in its hop record, how long the packet queued there and how long its batch computed
(durations on its own clock, which need no common origin). What the round trip leaves after those
durations is the wire (with each sender's encoding and each receiver's QUIC processing), split
evenly between the crossings: the route's N stages make N + 1 of them. Evenly, because every
crossing carries the same activations (the same rows × width, in the same dtype) and nothing
measures one crossing alone: a crossing's share is an estimate, their sum is measured. Expert
calls (expert parallelism) are timed by the calling stage from the start of its batch's compute
(each from sending the rows to having the answer: both crossings and the expert node's compute),
so they sit inside that compute span, on the expert node's row.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from swarmctl.asker.head_tail import Generation, TokenTiming, TrunkResult
from swarmctl.batching import StepTiming

ASKER = "asker"  # the asker's process row; a stage's row is its member name
STEPS_TRACK = "steps"  # a node's compute track; on the asker, each step's span holds its parts
SEND_TRACK = "send"  # a node's outgoing crossings
# The categories that make up a step's critical path, end to end; "step" (the whole step),
# "roundtrip" (the asker waiting on the trunk) and "expert" (inside a stage's compute) overlap them.
CRITICAL_PATH = ("queue", "compute", "reroute", "wire", "sample")
WIRE_SPLIT = "even"  # how a round trip's wire time is divided between its crossings (see above)


@dataclass(frozen=True)
class Span:
    """One complete event: where (node and track), what, and when on the asker's clock."""

    node: str
    track: str
    name: str
    cat: str  # "step", "queue", "compute", "reroute", "wire", "sample", "roundtrip" or "expert"
    start_us: float  # from the request's start
    dur_us: float
    args: dict[str, Any] = field(default_factory=dict)  # shown by the viewer when the span is selected


@dataclass(frozen=True)
class TraceInfo:
    """What the trace's header says about the request."""

    model: str = ""
    prompt_tokens: int = 0
    finish_reason: str | None = None
    nodes: Mapping[str, str] = field(default_factory=dict)  # member name → what it holds ("layers [4, 14)")


class TraceError(OSError):
    """A trace file or folder that cannot be written; the message is one line."""


# --- spans ---

def request_spans(gen: Generation, nodes: Mapping[str, str] | None = None) -> list[Span]:
    """Every step of a request as spans on the asker's clock, from the request's start."""
    nodes = nodes or {}
    origin = gen.started
    spans: list[Span] = []
    for step, timing in enumerate([*gen.fill_timings, *gen.timings]):
        spans += step_spans(timing, step, origin, nodes, prompt_tokens=gen.prompt_tokens)
    return spans


def step_label(timing: TokenTiming) -> str:
    """"token 3", "tokens 5-7" (a speculative step), or "prompt 0-511" (a chunk that chose none)."""
    if not timing.tokens:
        return f"prompt {timing.start_pos}-{timing.start_pos + timing.rows - 1}"
    first, last = timing.first_token + 1, timing.first_token + len(timing.tokens)
    return f"token {first}" if first == last else f"tokens {first}-{last}"


def step_spans(timing: TokenTiming, step: int, origin: float, nodes: Mapping[str, str], *,
               prompt_tokens: int = 0) -> list[Span]:
    """One step: its whole span on the asker, then its parts along the critical path."""
    def at(clock: float) -> float:
        return (clock - origin) * 1e6

    label = step_label(timing)
    tag = {"step": step, "tokens": label}
    start = at(timing.started)
    end = at(timing.done) if timing.done else at(timing.tail_returned)
    whole = {**tag, "rows": timing.rows, "start_pos": timing.start_pos, "token_ids": list(timing.tokens)}
    if timing.done:
        whole["latency_us"] = round(timing.latency_s * 1e6, 3)  # the asker's own measurement of the step
    if timing.drafted:
        whole.update(drafted=timing.drafted, kept=timing.kept)
    if timing.start_pos == 0 and prompt_tokens:
        whole["prompt_tokens"] = prompt_tokens
    spans = [Span(ASKER, STEPS_TRACK, label, "step", start, end - start, whole)]
    spans += _runner_spans("head", timing.head, start, tag)
    if timing.trunk is not None:
        spans += trunk_spans(timing.trunk, timing.trunk_returned, origin, tag, nodes)
    spans += _runner_spans("tail", timing.tail, at(timing.trunk_returned), tag)
    if timing.done:
        spans.append(Span(ASKER, STEPS_TRACK, "sample", "sample", at(timing.done) - timing.sample_s * 1e6,
                          timing.sample_s * 1e6, dict(tag)))
    return spans


def _runner_spans(part: str, timing: StepTiming, start_us: float, tag: dict[str, Any]) -> list[Span]:
    """The asker's head or tail: waiting for its batch, then the batch's compute."""
    queued, compute = timing.queued_s * 1e6, timing.compute_s * 1e6
    batch = {"batch_requests": timing.batch_requests, "batch_tokens": timing.batch_tokens}
    what = "embedding + first layers" if part == "head" else "last layers + LM head"
    return [Span(ASKER, STEPS_TRACK, f"{part} queue", "queue", start_us, queued, dict(tag)),
            Span(ASKER, STEPS_TRACK, part, "compute", start_us + queued, compute, {**tag, **batch, "runs": what})]


def trunk_spans(result: TrunkResult, returned: float, origin: float, tag: dict[str, Any],
                nodes: Mapping[str, str]) -> list[Span]:
    """The round trip through the trunk, its stages placed from their hop records (module docstring)."""
    received = result.received_at or returned
    sent = result.sent_at or received - result.round_trip_s
    total = (received - sent) * 1e6
    hops = result.hops
    busy = sum(h.queued_us + h.compute_us for h in hops)
    # Durations measured on other clocks cannot honestly exceed the round trip that holds them;
    # if rounding or a drifting clock makes them, they are squeezed to fit and the span says so.
    squeeze = min(1.0, total / busy) if busy > 0 else 1.0
    crossings = len(hops) + 1
    wire_each = max(0.0, total - busy) / crossings
    start = (sent - origin) * 1e6
    spans = []
    if result.first_sent_at and result.first_sent_at < sent:  # the attempts whose route failed, and the wait for a new one
        first = (result.first_sent_at - origin) * 1e6
        spans.append(Span(ASKER, STEPS_TRACK, "reroute", "reroute", first, start - first,
                          {**tag, "attempts": result.attempts}))
    spans.append(Span(ASKER, STEPS_TRACK, "trunk round trip", "roundtrip", start, total,
                      {**tag, "stages": len(hops), "wire_us": round(wire_each * crossings, 3),
                       "wire_split": WIRE_SPLIT}))
    route = [ASKER, *(h.stage for h in hops), ASKER]
    t = start
    for i in range(crossings):
        sender, receiver = route[i], route[i + 1]
        wire = {**tag, "from": sender, "to": receiver, "bytes": result.activation_bytes, "wire_split": WIRE_SPLIT}
        frame = result.sent_bytes if i == 0 else result.received_bytes if i == crossings - 1 else 0
        if frame:
            wire["frame_bytes"] = frame  # measured by the asker (the others carry the same activations)
        spans.append(Span(sender, SEND_TRACK, f"→ {receiver}", "wire", t, wire_each, wire))
        t += wire_each
        if i == len(hops):
            break
        hop = hops[i]
        queued, compute = hop.queued_us * squeeze, hop.compute_us * squeeze
        extra = {"squeezed_to": round(squeeze, 4)} if squeeze < 1.0 else {}
        spans.append(Span(hop.stage, STEPS_TRACK, "queue", "queue", t, queued, {**tag, **extra}))
        work = {**tag, **extra, "batch_requests": hop.batch, "runs": nodes.get(hop.stage, "trunk layers")}
        if hop.calls:
            work.update(expert_calls=len(hop.calls), expert_call_us=sum(c.duration_us for c in hop.calls))
        spans.append(Span(hop.stage, STEPS_TRACK, "compute", "compute", t + queued, compute, work))
        for call in hop.calls:
            # A call and its batch are timed by separate readings on the stage, each rounded to a
            # microsecond, so a call can end a few microseconds past the batch's recorded compute
            # (seen: 3 us): it is drawn inside its caller's compute, where it happened.
            offset = min(call.offset_us * squeeze, compute)
            spans.append(Span(call.node, f"calls from {hop.stage}", f"layer {call.layer} experts", "expert",
                              t + queued + offset, min(call.duration_us * squeeze, compute - offset),
                              {**tag, "caller": hop.stage, "layer": call.layer, "rows": call.rows,
                               "bytes": call.bytes, "runs": nodes.get(call.node, "experts")}))
        t += queued + compute
    return spans


# --- the file ---

def chrome_trace(spans: Sequence[Span], info: TraceInfo, *, started_wall: float) -> dict[str, Any]:
    """Chrome's JSON Object Format: complete events, and metadata events naming every process
    (node) and thread (track), in route order: the asker, the stages, then the expert nodes."""
    nodes = _node_order(spans)
    tracks: dict[str, list[str]] = {node: [] for node in nodes}
    for span in spans:
        if span.track not in tracks[span.node]:
            tracks[span.node].append(span.track)
    for node in nodes:  # the steps track first, the crossings next, the rest (expert callers) after
        tracks[node].sort(key=lambda t: (t != STEPS_TRACK, t != SEND_TRACK, t))
    pid = {node: i + 1 for i, node in enumerate(nodes)}
    events: list[dict[str, Any]] = []
    for node in nodes:
        label = node if node == ASKER else f"{node}: {info.nodes[node]}" if node in info.nodes else node
        events += [_meta("process_name", pid[node], 0, {"name": label}),
                   _meta("process_sort_index", pid[node], 0, {"sort_index": pid[node]})]
        for tid, track in enumerate(tracks[node], start=1):
            events += [_meta("thread_name", pid[node], tid, {"name": track}),
                       _meta("thread_sort_index", pid[node], tid, {"sort_index": tid})]
    for span in sorted(spans, key=lambda s: (s.start_us, -s.dur_us)):  # parents before their children
        events.append({"name": span.name, "cat": span.cat, "ph": "X", "ts": round(span.start_us, 3),
                       "dur": round(max(0.0, span.dur_us), 3), "pid": pid[span.node],
                       "tid": tracks[span.node].index(span.track) + 1, "args": span.args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"tool": "swarmctl", "model": info.model, "prompt_tokens": info.prompt_tokens,
                          "finish_reason": info.finish_reason or "", "started_unix_s": round(started_wall, 6),
                          "clock": "the asker's; stages placed from their hop records",
                          "wire_split": WIRE_SPLIT}}


def _node_order(spans: Sequence[Span]) -> list[str]:
    stages, experts = [], []
    for span in spans:
        if span.node == ASKER:
            continue
        into = experts if span.cat == "expert" else stages
        if span.node not in stages and span.node not in experts:
            into.append(span.node)
    return [ASKER, *stages, *experts]


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def generation_trace(gen: Generation, info: TraceInfo) -> dict[str, Any]:
    """A finished (or stopped) request's trace, ready to write."""
    # The wall clock at the request's start, for the header: perf_counter has no epoch.
    started_wall = time.time() - (time.perf_counter() - gen.started)
    return chrome_trace(request_spans(gen, info.nodes), info, started_wall=started_wall)


def write_trace(path: str | os.PathLike, trace: dict[str, Any]) -> None:
    """Write the trace whole or not at all: a reader never sees half a file."""
    path = Path(path)
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False, encoding="utf-8") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(f.name, path)
    except OSError as e:
        raise TraceError(f"cannot write the trace to {path}: {e.strerror or e}") from None


@dataclass
class TraceFolder:
    """``serve --trace DIR``: one file per request, named after the request's x-request-id."""

    path: Path
    model: str = ""
    describe_nodes: Callable[[], dict[str, str]] = dict  # the trunk's nodes, as the session knows them now

    def write(self, request_id: str, gen: Generation) -> Path:
        target = self.path / f"{request_id}.json"
        info = TraceInfo(model=self.model, prompt_tokens=gen.prompt_tokens, finish_reason=gen.finish_reason,
                         nodes=self.describe_nodes())
        write_trace(target, generation_trace(gen, info))
        return target


def check_trace_file(path: str | os.PathLike) -> Path:
    """Before any work: that a trace can be written at ``path`` (its folder exists and takes a new
    file, and the path is not a folder). One line saying why not, otherwise."""
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"cannot write the trace to {path}: it is a folder (--trace takes a file name)")
    _check_folder(path.parent if str(path.parent) else Path("."), f"cannot write the trace to {path}")
    return path


def check_trace_dir(path: str | os.PathLike) -> Path:
    """``serve --trace DIR``: the folder, made if missing (its parent must exist), and writable."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise TraceError(f"cannot use {path} for traces: it is a file, not a folder")
    try:
        path.mkdir(exist_ok=True)
    except OSError as e:
        raise TraceError(f"cannot use {path} for traces: {e.strerror or e}") from None
    _check_folder(path, f"cannot write traces into {path}")
    return path


def _check_folder(folder: Path, problem: str) -> None:
    """Write and remove a scratch file: permission bits alone miss read-only mounts and ACLs."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".swarmctl-trace-", suffix=".tmp"):
            pass
    except OSError as e:
        raise TraceError(f"{problem}: {e.strerror or e}") from None
