"""How fast this machine runs one layer of the model: milliseconds per layer per decode token.

Measured when a trunk starts, on one real layer of the model it will serve (so the figure reflects
this model's layer shape and quantization on this machine), and refreshed from the batches it
serves afterwards.

A single burst of decode steps is not a measurement. Two trunk processes started a second apart
on one machine registered 0.27 and 6.12 ms per layer: the second measured while the first was busy,
and two ggml thread teams sharing the cores make each other's barriers wait for a descheduled thread
(measured here: a step's median went from 0.34 ms to 9.1 ms while another ggml process computed,
and back to 0.24 after). So ``measure_speed``:

1. warms up (the first steps fault the weights in and build the graph);
2. runs repeats of at least ``MIN_REPEAT_S`` each, a repeat's figure being the median of its
   decode steps, and notes per repeat this process's CPU time against the wall time, and the CPU
   time other processes took (``/proc/stat``, where there is one);
3. counts a repeat as *starved* when other processes kept more than ``OTHERS_LIMIT`` × our
   threads' worth of cores busy (beyond the cores our threads leave free), or when this process
   got less than ``STARVED_RATIO`` CPU seconds per wall second per core its threads can use:
   while a competitor runs, a 2-thread team gets 0.2-1.0 CPU seconds per wall second instead of
   1.84-2.00 (measured), whatever its steps' times say;
4. after a starved repeat, pauses (a random 1-3 × ``PAUSE_S``) and tries again, until ``repeats``
   clean repeats or the ``budget_s`` is spent, and takes the best (fastest) of the clean repeats:
   interference only ever adds time, so on a loaded machine the fastest short run is the one
   nearest the machine's own speed, and it is what two probes a minute apart agree on (a median
   or a single long run swung 20-30x from one probe to the next on a loaded 2-core machine).
   With no clean repeat at all it takes the fastest step and says ``contended``, and
   the trunk measures again later.

``SpeedTracker`` then keeps the figure honest while the trunk serves, by the same rule: the best
quarter, over recent single-token batches that had the CPU to themselves, of a batch's compute
time divided by the layers of the slice. A batch that other processes starved (on a shared
machine: the asker's own layers, another trunk) says nothing about this machine, so the swarm's
own load never reads as slowness.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from .threads import usable_cores
from .devices import Device
from .gguf_file import GGUFFile

MIN_REPEAT_S = 0.04  # long enough for /proc/stat's 10 ms ticks to say something about the others
REPEATS = 5
BUDGET_S = 1.0  # at most this long retrying starved repeats (the figure then says "contended")
PAUSE_S = 0.04  # after a starved repeat, 1-3× this: let the competitor's burst pass
OTHERS_LIMIT = 0.3  # × our threads: other processes' CPU, beyond the cores we leave free
STARVED_RATIO = 0.7  # CPU seconds per wall second, per core our threads can use


@dataclass(frozen=True)
class Repeat:
    """One repeat: its decode steps, and who had the CPU meanwhile."""

    ms: float  # median of this repeat's decode steps
    wall_s: float
    cpu_s: float  # this process (every thread) over the repeat
    others_cores: float | None = None  # CPUs other processes kept busy on average (None: unknown)
    steps: int = 0
    low_ms: float | None = None  # its fastest step (None: same as ms)


@dataclass(frozen=True)
class SpeedMeasurement:
    ms_per_layer_token: float
    repeats: tuple[Repeat, ...]
    starved: tuple[bool, ...]  # per repeat: left out of the figure
    contended: bool  # no clean repeat: the figure is the fastest of starved ones
    seconds: float
    n_threads: int

    @property
    def clean(self) -> int:
        return self.starved.count(False)

    def describe(self) -> str:
        what = f"{self.clean} of {len(self.repeats)} repeats clean"
        if self.contended:
            what += ", every repeat shared the CPU with other processes: measuring again later"
        return f"{self.ms_per_layer_token:.3f} ms per layer ({what}, {self.seconds:.2f} s)"


def classify(repeats: Iterable[Repeat], n_threads: int, n_cpus: int, *, others_limit: float = OTHERS_LIMIT,
             starved_ratio: float = STARVED_RATIO) -> list[bool]:
    """Which repeats other processes starved (True), by the two tests described above. The CPU
    share is compared with the cores our threads can have, ``min(n_threads, n_cpus)``: ggml's
    threads spin between kernels, so an undisturbed team keeps them all busy (1.84-2.00 CPU
    seconds per wall second on 2 cores, measured; 0.2-1.0 while other processes computed). Where
    threads sleep instead, repeats read as starved: the figure is then the fastest steps', and
    the trunk measures again later, which costs time but never a wrong plan."""
    repeats = list(repeats)
    spare = max(0, n_cpus - n_threads)  # cores our threads leave to others anyway
    cores = min(n_threads, n_cpus)
    flags = []
    for r in repeats:
        share = r.cpu_s / r.wall_s if r.wall_s > 0 else 0.0
        others = r.others_cores is not None and r.others_cores - spare > others_limit * n_threads
        flags.append(others or share < starved_ratio * cores)
    return flags


def robust_figure(repeats: list[Repeat], starved: list[bool]) -> tuple[float, bool]:
    """(ms, contended): the best of the clean repeats' medians (interference only adds time, so
    the fastest short run is the machine's own speed). With no clean repeat, the fastest step of
    all: under a competitor a step either runs undisturbed (as fast as idle) or waits for a
    descheduled thread (10-40 ms, measured), and a repeat's median is whichever was the majority.
    On a machine busy throughout, every step can wait (measured: 9-25 ms in 2 of 9 measurements
    against two busy processes on 2 cores); the trunk then measures again, or serves and reports
    what it sees."""
    clean = [r.ms for r, s in zip(repeats, starved) if not s]
    if clean:
        return min(clean), False
    return min(r.ms if r.low_ms is None else r.low_ms for r in repeats), True


def collect(run_repeat: Callable[[], Repeat], *, n_threads: int, n_cpus: int, repeats: int = REPEATS,
            budget_s: float = BUDGET_S, pause_s: float = PAUSE_S, max_repeats: int = 40,
            clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep
            ) -> SpeedMeasurement:
    """Run repeats until ``repeats`` clean ones, or the budget is spent (at least ``repeats`` in
    all); the clock, the sleep and the repeats themselves can be replaced in tests."""
    t0 = clock()
    done: list[Repeat] = []
    while len(done) < max_repeats:
        done.append(run_repeat())
        flags = classify(done, n_threads, n_cpus)
        if flags.count(False) >= repeats or (len(done) >= repeats and clock() - t0 >= budget_s):
            break
        if flags[-1]:  # a random pause: trunks measuring at once fall out of step, and one runs alone
            sleep(pause_s * (1 + 2 * random.random()))
    flags = classify(done, n_threads, n_cpus)
    ms, contended = robust_figure(done, flags)
    return SpeedMeasurement(ms, tuple(done), tuple(flags), contended, clock() - t0, n_threads)


class _Clocks:
    """Wall time, this process's CPU time and the whole machine's busy CPU time, read together."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def machine_busy_s(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal (guest time is already in user)
        return (sum(values[:8]) - values[3] - values[4]) / self.tick

    def read(self) -> tuple[float, float, float | None]:
        return time.perf_counter(), time.process_time(), self.machine_busy_s()


def measure_speed(gguf: GGUFFile, *, n_threads: int | None = None, layer: int | None = None,
                  repeats: int = REPEATS, budget_s: float = BUDGET_S, min_repeat_s: float = MIN_REPEAT_S,
                  device: Device | None = None, rows: int = 1) -> SpeedMeasurement:
    """ms per decode token through one layer, as described at the top of this file; with ``rows``
    above 1, ms per step of that many prompt rows (``measure_prompt_rate``)."""
    from .slice import Placement, SliceEngine
    from .spec import ModelSpec, SliceSpec

    spec = ModelSpec.from_gguf(gguf)
    present = [i for i in range(spec.n_layer) if spec.layer_bytes[i] > 0]
    if not present:
        raise ValueError("the model file holds no layers to measure")
    il = layer if layer is not None else present[len(present) // 2]
    rng = np.random.default_rng(0)
    clocks = _Clocks()
    cpus = usable_cores()
    with SliceEngine(gguf, SliceSpec(il, il + 1), n_threads=n_threads, max_context=256 + 6 * rows,
                     placement=Placement(device=device)) as engine:
        threads = engine.backend.n_threads
        rid = b"speed-probe-0000"
        engine.forward(rid, start_pos=0, hidden=rng.standard_normal((16, spec.n_embd)).astype(np.float32))
        x = rng.standard_normal((rows, spec.n_embd)).astype(np.float32)
        warm = 4 if rows == 1 else 1  # (a prompt probe follows a decode probe: the weights are in)
        for pos in range(16, 16 + warm * rows, rows):  # warm-up: the first steps fault the weights in and build the graph
            engine.forward(rid, start_pos=pos, hidden=x)

        def run_repeat() -> Repeat:
            wall0, cpu0, busy0 = clocks.read()
            times: list[float] = []
            while True:
                pos = 16 + warm * rows + len(times) % 8  # rewinding keeps every repeat at the same few positions
                t = time.perf_counter()
                engine.forward(rid, start_pos=pos, hidden=x, rewind=True)
                times.append(time.perf_counter() - t)
                elapsed = time.perf_counter() - wall0
                if (len(times) >= 5 and elapsed >= min_repeat_s) or (len(times) >= 3 and elapsed >= 4 * min_repeat_s):
                    break
            wall1, cpu1, busy1 = clocks.read()
            wall, cpu = wall1 - wall0, cpu1 - cpu0
            others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - cpu) / wall
            times.sort()
            return Repeat(statistics.median(times) * 1e3, wall, cpu, others, len(times),
                          times[0] * 1e3)

        result = collect(run_repeat, n_threads=threads, n_cpus=cpus, repeats=repeats, budget_s=budget_s)
        engine.release(rid)
    return result


PROMPT_ROWS = 32  # rows in the prompt probe: enough that a step's cost is its rows' compute


def measure_prompt_rate(gguf: GGUFFile, *, n_threads: int | None = None, layer: int | None = None,
                        device: Device | None = None, rows: int = PROMPT_ROWS, one_row_ms: float | None = None,
                        **kwargs) -> SpeedMeasurement:
    """ms per prompt row through one layer beyond a step's first (``one_row_ms``, the decode
    figure, when given), in steps of ``rows`` rows near the start of a context: what a prompt chunk
    costs a member per layer and row (plans/prefill.py). A prompt's rows share one read of the
    weights, so this is compute, not the memory reads a decode token's figure is; per row it held
    within 5 % from 32 to 512 rows on a 1B llama-shaped layer and a Kimi-width one (measured), while
    attention over a longer context added 8-25 % per row at 1,500 positions (not in the figure)."""
    measurement = measure_speed(gguf, n_threads=n_threads, layer=layer, device=device, rows=rows,
                                **{"repeats": 2, **kwargs})
    per_row = prompt_row_ms(measurement.ms_per_layer_token, rows, one_row_ms)
    return SpeedMeasurement(per_row, measurement.repeats, measurement.starved, measurement.contended,
                            measurement.seconds, measurement.n_threads)


def prompt_row_ms(step_ms: float, rows: int, one_row_ms: float | None) -> float:
    """A step of ``rows`` rows through one layer, per row beyond the first when the first row's
    cost (a decode step's) is known and below it, else per row."""
    if one_row_ms is not None and rows > 1 and step_ms > one_row_ms:
        return (step_ms - one_row_ms) / (rows - 1)
    return step_ms / rows


@dataclass(frozen=True)
class RamRate:
    """How fast this machine's CPU gets through the bytes a token reads in one mixture-of-experts
    layer held in host RAM: what a GPU member that keeps routed experts in RAM (kernels/device_split.py)
    offers the planner as its RAM's rate (plans/cost.py charges the experts there at it). Measured
    by ``measure_speed`` on the CPU, so compute and the threads' reach are in the figure, not only
    the memory's bandwidth."""

    gb_s: float
    layer: int
    ms_per_token: float  # the layer on the CPU, per decode token
    bytes_per_token: float  # what a token reads in it: the dense part and its share of the experts

    def describe(self) -> str:
        return (f"{self.gb_s:.1f} GB/s from host RAM ({self.bytes_per_token / 1e6:.1f} MB per token through "
                f"layer {self.layer} in {self.ms_per_token:.2f} ms on the CPU)")


def measure_ram_rate(gguf: GGUFFile, *, n_threads: int | None = None, **kwargs) -> RamRate | None:
    """The CPU's rate through a token's bytes of one of the model's mixture-of-experts layers in
    host RAM (``RamRate``); None for a dense model (no routed experts to keep in RAM)."""
    from .spec import ModelSpec

    spec = ModelSpec.from_gguf(gguf)
    held = [il for il in spec.moe_layers if spec.layer_bytes[il] > 0] if spec.layer_expert_bytes else []
    if not held:
        return None
    il = held[len(held) // 2]
    ms = measure_speed(gguf, n_threads=n_threads, layer=il, device=None, **kwargs).ms_per_layer_token
    experts = spec.layer_expert_bytes[il]
    per_token = spec.layer_bytes[il] - experts + experts * spec.n_expert_used / spec.n_expert
    return RamRate(per_token / (ms * 1e6), il, ms, per_token)


# --- after the first measurement ---

REPORT_FACTOR = 1.25  # tell the host a fresh measurement when it is this far from what it has
SERVED_REPORT_FACTOR = 1.1  # a served figure: the host smooths these, so smaller steps reach it
WINDOW = 32  # single-token batches in the window
MIN_SAMPLES = 8
SERVED_QUANTILE = 0.25  # the best quarter of the window's clean batches: interference only adds time
MAX_AGE_S = 120.0  # older batches say little about the machine now
REPORT_INTERVAL_S = 30.0  # at most one serving figure per 30 s (under load the median moves every few seconds)
RESEND_S = 60.0  # a served figure is sent again this often while it holds: the host judges by the last few
REMEASURE_AFTER_S = 10.0  # a contended first measurement is repeated after 10, 20, 40, 80 s
MAX_REMEASURES = 4
# A trunk given no layers (a slow spell, at its start or in the batches it served, may have planned
# it out: it serves nothing, so no batch can say it is fast again) measures again after 60 s idle,
# then 120, 240, ... up to every 16 minutes (a third of a second of compute each, on an idle machine).
IDLE_REMEASURE_S = 60.0
IDLE_REMEASURE_MAX_S = 960.0
PROMPT_MIN_ROWS = 16  # a batch with this many rows counts as a prompt's (its rows share the weights' read)
PROMPT_WINDOW = 8  # prompt batches kept: they are rarer than decode steps, so kept whatever their age


def worth_reporting(figure: float | None, reported: float | None, factor: float = REPORT_FACTOR) -> bool:
    """A figure the host should hear: it has none, or it is ``factor`` or more away from it."""
    if figure is None or not figure > 0:
        return False
    return reported is None or not reported > 0 or not 1 / factor < figure / reported < factor


def batch_starved(seconds: float, cpu_s: float | None, n_threads: int | None, cpus: int) -> bool:
    """A batch that other processes kept from the CPU: this process got less than
    ``STARVED_RATIO`` CPU seconds per wall second per core its threads can use (the test
    ``classify`` applies to a measurement's repeats). Unknown (no CPU time, no thread count): clean."""
    if cpu_s is None or not n_threads or seconds <= 0:
        return False
    return classify([Repeat(0.0, seconds, cpu_s)], n_threads, cpus)[0]


@dataclass
class SpeedTracker:
    """A trunk's figure after its first measurement.

    While it serves: over the last ``window`` batches of exactly one token (one request's decode
    step; a batch of several shares its matmuls, and its time per token is not one step's), a
    batch's compute time (``BatchRunner``'s record) divided by the slice's layers, and of those
    the best quarter (``SERVED_QUANTILE``) of the batches that had the CPU: a batch during which
    this process got too little CPU (``batch_starved``: on one machine, the asker computing its
    layers, or another trunk) is kept out, so the swarm's own load never reads as this machine's
    slowness (0.41 idle against 4.51 ms per layer under load re-planned the swarm in a
    loop). The time includes the forward pass's fixed overhead spread over the layers, so it reads
    a little above the micro-benchmark; the host smooths what it hears (``plans/hysteresis.py``),
    so figures it plans with converge to what the stage serves.

    While it serves nothing, after a first measurement that never had the CPU to itself: measure
    again, a few times, further apart each time (a stage's figure comes from its batches instead).
    """

    window: int = WINDOW
    min_samples: int = MIN_SAMPLES
    max_age_s: float = MAX_AGE_S
    samples: deque = field(default_factory=deque)  # (time.time() of the batch, ms per layer, starved)
    last_seen: float = 0.0  # the newest batch already read
    contended: bool = False  # the last micro-benchmark never had the CPU to itself
    remeasures: int = 0
    next_remeasure: float = math.inf  # time.monotonic()
    idle_remeasure_s: float = IDLE_REMEASURE_S  # the first wait of a trunk given no layers
    idle_wait_s: float = 0.0  # the wait under way
    next_idle_remeasure: float = math.inf  # the loop's clock (net/clock.py); inf: not waiting
    last_report: float = -math.inf  # time.monotonic() of the last serving figure reported
    cpus: int = field(default_factory=usable_cores)
    # (rows, ms per layer per row beyond the first) of recent prompt batches that had the CPU (plans/prefill.py)
    prompt_samples: deque = field(default_factory=lambda: deque(maxlen=PROMPT_WINDOW))

    def measured(self, measurement: SpeedMeasurement, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.contended = measurement.contended
        self.next_remeasure = now + REMEASURE_AFTER_S * 2 ** self.remeasures if self.contended else math.inf

    def take_remeasure(self, now: float | None = None) -> bool:
        """True (once) when a contended measurement is due to be repeated."""
        now = time.monotonic() if now is None else now
        if not self.contended or self.remeasures >= MAX_REMEASURES or now < self.next_remeasure:
            return False
        self.remeasures += 1
        self.next_remeasure = math.inf  # until this one is measured
        return True

    def take_idle_remeasure(self, waiting: bool, now: float) -> bool:
        """True (once per wait) when a trunk given no layers should measure again. ``waiting``: it
        is idle now and can measure (False resets the waits)."""
        if not waiting:
            self.next_idle_remeasure = math.inf
            return False
        if self.next_idle_remeasure == math.inf:
            self.idle_wait_s = self.idle_remeasure_s
            self.next_idle_remeasure = now + self.idle_wait_s
            return False
        if now < self.next_idle_remeasure:
            return False
        self.idle_wait_s = min(2 * self.idle_wait_s, IDLE_REMEASURE_MAX_S)
        self.next_idle_remeasure = now + self.idle_wait_s
        return True

    def observe(self, batches: Iterable, n_layers: int, now: float | None = None,
                n_threads: int | None = None, one_row_ms: float | None = None) -> None:
        """``batches``: records with ``started`` (unix time), ``seconds``, ``tokens`` and maybe
        ``cpu_s`` (this process's CPU time over the batch), oldest first, as
        ``BatchRunner.stats.recent`` keeps them; each is read once. ``n_threads``: the engine's;
        ``one_row_ms``: the decode figure, which a prompt batch's first row costs."""
        now = time.time() if now is None else now
        newest = self.last_seen
        for b in list(batches):
            if b.started <= self.last_seen:
                continue
            newest = max(newest, b.started)
            if n_layers <= 0 or b.seconds <= 0:
                continue
            starved = batch_starved(b.seconds, getattr(b, "cpu_s", None), n_threads, self.cpus)
            if b.tokens == 1:
                self.samples.append((b.started, b.seconds * 1e3 / n_layers, starved))
            elif b.tokens >= PROMPT_MIN_ROWS and not starved:
                self.prompt_samples.append((b.tokens, prompt_row_ms(b.seconds * 1e3 / n_layers, b.tokens, one_row_ms)))
        self.last_seen = newest
        while self.samples and (len(self.samples) > self.window or self.samples[0][0] < now - self.max_age_s):
            self.samples.popleft()

    def serving_estimate(self) -> float | None:
        """The best quarter of the window's clean single-token batches, or None with fewer than
        ``min_samples`` of them (a window of starved batches says nothing)."""
        clean = sorted(ms for _, ms, starved in self.samples if not starved)
        if len(clean) < self.min_samples:
            return None
        return clean[int((len(clean) - 1) * SERVED_QUANTILE)]

    def prompt_estimate(self) -> float | None:
        """The fastest (interference only adds time) of the recent prompt batches at least half as
        long as the longest of them (a long prompt's chunks are what a first-token time waits for;
        at Kimi's width a 30-row batch's rows cost 10 ms per layer and a 400-row one's 13-15 in the
        same run, measured), or None."""
        if not self.prompt_samples:
            return None
        longest = max(rows for rows, _ in self.prompt_samples)
        return min(ms for rows, ms in self.prompt_samples if 2 * rows >= longest)

    def serving_report(self, reported: float | None, now: float | None = None) -> float | None:
        """The serving figure, when the host should hear it: ``REPORT_INTERVAL_S`` after the last
        one, and ``SERVED_REPORT_FACTOR`` away from what it has, or the same again ``RESEND_S``
        after the last served report (the host takes the best of the last few: a stage that got
        slower has to say so several times)."""
        now = time.monotonic() if now is None else now
        figure = self.serving_estimate()
        if figure is None or now - self.last_report < REPORT_INTERVAL_S:
            return None
        again = self.last_report > -math.inf and now - self.last_report >= RESEND_S
        if not again and not worth_reporting(figure, reported, SERVED_REPORT_FACTOR):
            return None
        self.last_report = now
        return figure
