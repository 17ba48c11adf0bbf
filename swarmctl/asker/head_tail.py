"""The asker's side of the U-shaped split, for many requests at once.

    text → tokens → embedding → head layers [0, K)  ──activations──►  trunk [K, L-K)
    text ← tokens ← sample ← LM head ← tail layers [L-K, L)  ◄──activations──┘

Text, token ids and logits stay in this process; the trunk sees only activations. Each request is
a coroutine: head step, trunk round trip, tail step, sample. Head and tail steps of all requests
in flight run in shared batches (``BatchRunner``), and the trunk pipelines them. An admission
bound caps requests in flight: beyond it, new requests wait, and give up with a clear error at
their deadline.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Protocol, Sequence

import numpy as np

from kernels.devices import Device
from kernels.errors import ContextOverflowError, EngineError, SliceRangeError
from kernels.gguf_file import GGUFFile
from kernels.sampling import Candidates, Sampler, SamplingParams
from kernels.slice import ON_THE_CPU, Outputs, Placement, SliceEngine, Step, split_hidden
from kernels.spec import ModelSpec, SliceSpec
from kernels.tokenizer import Tokenizer
from net import clock
from net.wire import DType, Hop
from swarmctl.batching import BatchRunner, StepTiming
from swarmctl.asker.logprobs import TokenLogprob, token_logprob
from kernels.grammar import Grammar, GrammarError
from swarmctl.asker.speculate import Draft, Speculation, accept
from swarmctl.asker.prefixes import PrefixCache, PrefixEntry, Steps, chunk_bounds
from swarmctl.asker.windows import Window, Windows

PREFILL_CHUNK = 512  # prompt tokens per step, as llama.cpp's default n_batch / n_ubatch
DEFAULT_MAX_IN_FLIGHT = 16


class BusyError(EngineError):
    """The admission bound is reached and a request's deadline passed while it waited."""


@dataclass
class TrunkResult:
    hidden: np.ndarray  # [n_tokens, n_embd] float32
    hops: tuple[Hop, ...]  # one record per trunk stage
    round_trip_s: float  # from handing the activations over to getting the output back
    # For the per-token trace (swarmctl/asker/trace.py), all on this process's clock; 0 where unknown.
    sent_at: float = 0.0  # time.perf_counter() as the activations left
    received_at: float = 0.0  # ... and as the output came back
    sent_bytes: int = 0  # the frames this process sent and received (0: the trunk is in this process)
    received_bytes: int = 0
    activation_bytes: int = 0  # the activations one crossing carries, in the dtype they travel in
    # Earlier than sent_at when the step's route failed and the step went again on a new route:
    # as the first attempt left (what lies between is the reroute); 0 when it went once.
    first_sent_at: float = 0.0
    attempts: int = 1


class Trunk(Protocol):
    """The middle of the U: whatever runs layers [K, L-K) (in-process stages, or a swarm)."""

    # How many steps of one request may be out at once, handed over in position order (a long
    # prompt's chunks stream through the stages); 1: each step's result comes back first.
    steps_in_flight: int

    async def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int, *, rewind: bool = False,
                      verify: bool = False) -> TrunkResult:
        """``rewind``: the step starts before the positions already sent (rejected drafts are
        dropped); ``verify``: a speculative check (kernels.slice.Step)."""
        ...

    async def release(self, request_id: bytes) -> None: ...


@dataclass(frozen=True)
class USplit:
    head: SliceSpec  # embedding + layers [0, K)
    trunk: tuple[SliceSpec, ...]  # layers [K, L-K) in consecutive stages
    tail: SliceSpec  # layers [L-K, L) + output norm + LM head


def u_ends(n_layer: int, head_layers: int) -> tuple[SliceSpec, SliceSpec]:
    """The asker's two slices: embedding + [0, K), and [L-K, L) + LM head."""
    if head_layers < 0:
        raise SliceRangeError("--head-layers must be 0 or more")
    if 2 * head_layers > n_layer:
        raise SliceRangeError(f"--head-layers {head_layers} needs {2 * head_layers} layers; the model has {n_layer}")
    return (SliceSpec(0, head_layers, has_embedding=True),
            SliceSpec(n_layer - head_layers, n_layer, has_lm_head=True))


def u_split(n_layer: int, head_layers: int, n_stages: int) -> USplit:
    """Head and tail of K layers each on the asker; the trunk split evenly into n_stages."""
    head, tail = u_ends(n_layer, head_layers)
    n_trunk = n_layer - 2 * head_layers
    if n_stages < 0 or (n_stages == 0 and n_trunk > 0):
        raise SliceRangeError("--stages must be at least 1 when there are trunk layers")
    if n_stages > n_trunk:
        raise SliceRangeError(f"cannot split {n_trunk} trunk layers into {n_stages} stages")
    bounds = [head_layers + (n_trunk * i) // n_stages for i in range(n_stages + 1)] if n_stages else [head_layers]
    return USplit(head=head, trunk=tuple(SliceSpec(a, b) for a, b in zip(bounds, bounds[1:])), tail=tail)


class InprocTrunk:
    """Trunk stages as slice engines in this process (``--transport inproc``), each batching."""

    steps_in_flight = 1  # (its stages share this process's cores: nothing to overlap)

    def __init__(self, gguf: GGUFFile, stages: Sequence[SliceSpec], *, n_threads: int | None, max_context: int,
                 device: Device | None = None, wire: Sequence[DType] | None = None):
        """``wire``: the dtype of each hop, asker → first stage, …, last stage → asker (a swarm's
        --wire-dtype, emulated: rows rounded as that hop would deliver them); None: f32 throughout."""
        self.wire = list(wire) if wire is not None else [DType.F32] * (len(stages) + 1)
        if len(self.wire) != len(stages) + 1:
            raise EngineError(f"{len(stages)} stages have {len(stages) + 1} hops, not {len(self.wire)}")
        self.engines: list[SliceEngine] = []
        try:
            for stage in stages:
                self.engines.append(SliceEngine(gguf, stage, n_threads=n_threads, max_context=max_context,
                                                placement=Placement(device=device)))
        except BaseException:
            self.close()
            raise
        self.runners = [BatchRunner(e) for e in self.engines]

    async def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int, *, rewind: bool = False,
                      verify: bool = False) -> TrunkResult:
        t0 = time.perf_counter()
        hops = []
        hidden = self.wire[0].as_received(hidden)
        for i, runner in enumerate(self.runners):
            hidden, timing = await runner.run(Step(request_id, start_pos, hidden=hidden, rewind=rewind, verify=verify))
            hidden = self.wire[i + 1].as_received(hidden)
            hops.append(Hop(f"stage-{i + 1}", int(timing.queued_s * 1e6), int(timing.compute_s * 1e6),
                            timing.batch_requests))
        t1 = time.perf_counter()
        return TrunkResult(hidden, tuple(hops), t1 - t0, sent_at=t0, received_at=t1,
                           activation_bytes=int(np.asarray(hidden).nbytes))

    def describe_nodes(self) -> dict[str, str]:
        """What each stage (named as its hop records name it) holds, for the trace."""
        return {f"stage-{i + 1}": f"layers [{e.slice.start}, {e.slice.stop})" for i, e in enumerate(self.engines)}

    async def release(self, request_id: bytes) -> None:
        for runner in self.runners:
            await runner.call(runner.engine.release, request_id)

    # --- kept prefixes (swarmctl/asker/prefixes.py): the stages' caches move, nothing to replay ---

    async def keep(self, request_id: bytes, prefix: bytes, positions: int) -> list | None:
        """End the request, keeping its cells [0, positions) as ``prefix`` at every stage."""
        moved = [await runner.call(runner.engine.move, request_id, b"trunk-prefix/" + prefix, positions)
                 for runner in self.runners]
        if not all(moved):
            await self.forget(prefix)
            await self.release(request_id)
            return None
        return []

    async def resume(self, request_id: bytes, prefix: bytes, positions: int, record: list | None) -> bool:
        """Request ``request_id`` starts from ``prefix``'s cells cut to ``positions`` (False: it cannot)."""
        key = b"trunk-prefix/" + prefix
        if record is None or not all(r.engine.position_of(key) >= positions and r.engine.has_request(key)
                                     for r in self.runners):
            return False
        for runner in self.runners:
            await runner.call(runner.engine.move, key, request_id, positions)
        return True

    async def forget(self, prefix: bytes) -> None:
        for runner in self.runners:
            await runner.call(runner.engine.release, b"trunk-prefix/" + prefix)

    def close(self) -> None:
        for runner in getattr(self, "runners", []):
            runner.close()
        for engine in self.engines:
            engine.close()
        self.engines = []


@dataclass
class TokenTiming:
    """One step's latency (a generated token, or a speculative step's several), split by where it
    went. The clock readings (time.perf_counter()) place it on a timeline for the trace."""

    head: StepTiming
    trunk: TrunkResult | None
    tail: StepTiming
    total_s: float  # head, trunk and tail: from the step's start to its logits
    started: float = 0.0  # as the head step was handed to the head's runner
    trunk_returned: float = 0.0  # as the trunk's forward returned (after its round trip and any check)
    tail_returned: float = 0.0  # as the tail's logits came back
    rows: int = 0  # positions the step ran: a prompt chunk, or the last token and its drafts
    start_pos: int = 0
    # Filled in by the sampling that follows (Asker._steps); prompt chunks that only fill the
    # caches have none of it.
    sample_s: float = 0.0  # choosing the tokens from the logits (and checking the drafts)
    done: float = 0.0  # as the step's tokens were chosen: its latency is done - started
    first_token: int = 0  # index in the generation's tokens of the first token the step chose
    tokens: tuple[int, ...] = ()  # the tokens it chose (an end-of-generation token included)
    drafted: int = 0  # speculative tokens it checked, and of those kept
    kept: int = 0

    @property
    def latency_s(self) -> float:
        """The asker's own measurement of the step: from handing its tokens to the head until its
        tokens were chosen (0.0 for a prompt chunk that chose none)."""
        return self.done - self.started if self.done else 0.0

    @property
    def trunk_compute_s(self) -> float:
        return sum(h.compute_us for h in self.trunk.hops) / 1e6 if self.trunk else 0.0

    @property
    def trunk_queued_s(self) -> float:
        return sum(h.queued_us for h in self.trunk.hops) / 1e6 if self.trunk else 0.0

    @property
    def compute_s(self) -> float:
        """Compute on the asker and every stage (what more rows make longer)."""
        return self.head.compute_s + self.tail.compute_s + self.trunk_compute_s

    @property
    def transfer_s(self) -> float:
        """The trunk round trip minus what the stages spent queueing and computing: the wire."""
        if self.trunk is None:
            return 0.0
        return max(0.0, self.trunk.round_trip_s - self.trunk_compute_s - self.trunk_queued_s)


@dataclass
class Generation:
    """A request's progress: tokens so far, why it stopped, and per-token timings."""

    request_id: bytes
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    timings: list[TokenTiming] = field(default_factory=list)  # one per step (a speculative step yields several tokens)
    finish_reason: str | None = None  # "stop" (end of generation), "length" (max tokens), "context"
    drafted: int = 0  # speculative tokens drafted, and of those kept (swarmctl/asker/speculate.py)
    accepted: int = 0
    started: float = field(default_factory=time.perf_counter)
    fill_timings: list[TokenTiming] = field(default_factory=list)  # prompt chunks before the last (over 512 tokens)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token in ``tokens``, when asked for
    cached_tokens: int = 0  # prompt positions taken from a kept prefix, not computed (swarmctl/asker/prefixes.py)
    prompt_done: bool = False  # every prompt position is in the caches (its last row's logits came back)
    # A stage lacked the kept prefix and the trunk computed it again (``cached_tokens`` were then
    # saved at the asker's head and tail only): usage reports none cached.
    prefix_recomputed: bool = False


class GrammarRows:
    """A checked step's rows of logits, each masked by the grammar as its turn comes (structured
    output): row i is masked in the state after drafts 0..i-1, which ``accept`` only asks for once
    it kept them, so a draft the grammar forbids is never kept."""

    def __init__(self, grammar: Grammar, rows: np.ndarray, drafts: Sequence[int]) -> None:
        self.grammar, self.rows, self.drafts = grammar, rows, drafts
        self._masked: list[np.ndarray] = []

    def __getitem__(self, i: int) -> np.ndarray:
        while len(self._masked) <= i:
            j = len(self._masked)
            if j > 0:
                self.grammar.accept(self.drafts[j - 1])  # (kept: accept() reached the row after it)
            row = self.grammar.mask(self.rows[j])
            if not np.isfinite(row).any():
                raise GrammarError("the grammar allows no token here")
            self._masked.append(row)
        return self._masked[i]

    def __len__(self) -> int:
        return len(self.rows)


def choose_constrained(grammar: Grammar, sample: Sampler, rows: np.ndarray, checked: Draft) -> tuple[list[int], int]:
    """``accept`` with only what the grammar allows, and the grammar advanced by the tokens
    chosen (run in a grammar worker thread: ``Grammar.run``)."""
    if sample.params.greedy and not checked.tokens and (best := grammar.best_allowed(rows[0])) is not None:
        # (the likeliest allowed among the likeliest few is the constrained argmax: no mask needed)
        grammar.accept(best)
        return [best], 0
    tokens, kept = accept(sample, GrammarRows(grammar, rows, checked.tokens), checked)
    grammar.accept(tokens[-1])
    return tokens, kept


class USteps:
    """A request's steps through the U: head, trunk and tail, each end's steps batched with other
    requests' (``BatchRunner``); a long prompt's chunks streamed through the trunk."""

    def __init__(self, head_runner: BatchRunner, tail_runner: BatchRunner) -> None:
        self.head_runner, self.tail_runner = head_runner, tail_runner
        # Rewrites the head's activations before they leave this process (e.g. a privacy mitigation
        # that adds noise: swarmctl/audit/noise.py); None sends them as computed.
        self.uplink_transform: Callable[[np.ndarray], np.ndarray] | None = None

    def launch(self, rid: bytes, start: int, lead: list[int], draft: Draft, trunk: Trunk | None, *,
               rewind: bool = False, guess_q: Candidates | None = None, hidden_rows: bool = False) -> Window:
        """A step of ``lead`` and ``draft``'s tokens from ``start``, set going (head, trunk, tail)."""
        task = asyncio.ensure_future(self.step(rid, start, lead + draft.tokens, trunk,
                                               outputs="all" if draft.tokens else "last", rewind=rewind,
                                               verify=bool(draft.tokens), hidden_rows=hidden_rows))
        return Window(start, lead, draft, task, guess_q)

    async def step(self, rid: bytes, start: int, tokens: list[int], trunk: Trunk | None,
                   outputs: Outputs = "last", rewind: bool = False, verify: bool = False, hidden_rows: bool = False):
        """Head, trunk and tail: (the tail's output, TokenTiming). The output is the logits, or, with
        ``hidden_rows``, a kernels.slice.WithHidden that also holds every row's final hidden state."""
        t0 = time.perf_counter()
        hidden, head_timing = await self.head(rid, start, tokens, trunk, rewind, verify)
        trunk_result = None
        if trunk is not None:
            trunk_result = await trunk.forward(rid, hidden, start, rewind=rewind, verify=verify)
            hidden = trunk_result.hidden
        return await self.tail(rid, start, len(tokens), hidden, outputs, rewind, verify, t0, head_timing, trunk_result,
                               hidden_rows)

    async def head(self, rid: bytes, start: int, tokens: list[int], trunk: Trunk | None, rewind: bool = False,
                   verify: bool = False) -> tuple[np.ndarray, StepTiming]:
        hidden, timing = await self.head_runner.run(Step(rid, start, tokens=tokens, rewind=rewind, verify=verify))
        if trunk is not None and self.uplink_transform is not None:
            hidden = np.ascontiguousarray(self.uplink_transform(hidden), dtype=np.float32)
        return hidden, timing

    async def tail(self, rid: bytes, start: int, rows: int, hidden: np.ndarray, outputs: Outputs, rewind: bool,
                   verify: bool, t0: float, head_timing: StepTiming, trunk_result: TrunkResult | None,
                   hidden_rows: bool = False):
        t_trunk = time.perf_counter()
        logits, tail_timing = await self.tail_runner.run(Step(rid, start, hidden=hidden, outputs=outputs,
                                                              rewind=rewind, verify=verify, hidden_rows=hidden_rows))
        t_tail = time.perf_counter()
        return logits, TokenTiming(head_timing, trunk_result, tail_timing, t_tail - t0, started=t0,
                                   trunk_returned=t_trunk, tail_returned=t_tail, rows=rows, start_pos=start)

    async def stream_prompt(self, rid: bytes, chunks: list[list[int]], trunk: Trunk, hidden_rows: bool = False,
                            first: int = 0):
        """A long prompt's chunks through head, trunk and tail, streamed: each chunk goes to the
        trunk as soon as the head has it (up to ``trunk.steps_in_flight`` out at once), so the
        second stage works on chunk 1 while the first works on chunk 2, and an uplink carries one
        chunk while the head computes the next; the tail takes the results in order. Every
        engine runs the same steps as one chunk at a time would (the same bits). Returns each
        chunk's (logits of its last row, timing); with ``hidden_rows`` the logits come in a
        kernels.slice.WithHidden with every row's final hidden state."""
        window = asyncio.Semaphore(trunk.steps_in_flight)
        handed: asyncio.Queue = asyncio.Queue()  # (the trunk's step, t0, head timing, start, rows), or an error

        async def head_side() -> None:
            start = first
            try:
                for chunk in chunks:
                    await window.acquire()
                    t0 = time.perf_counter()
                    hidden, head_timing = await self.head(rid, start, chunk, trunk)
                    forward = asyncio.ensure_future(trunk.forward(rid, hidden, start))
                    handed.put_nowait((forward, t0, head_timing, start, len(chunk)))
                    start += len(chunk)
            except Exception as e:  # noqa: BLE001 - handed to the tail side, which raises it
                handed.put_nowait(e)

        heads = asyncio.ensure_future(head_side())
        forwards: list[asyncio.Future] = []
        results = []
        try:
            for _ in chunks:
                item = await handed.get()
                if isinstance(item, Exception):
                    raise item
                forward, t0, head_timing, start, rows = item
                forwards.append(forward)
                trunk_result = await forward
                window.release()
                results.append(await self.tail(rid, start, rows, trunk_result.hidden, "last", False, False, t0,
                                               head_timing, trunk_result, hidden_rows))
            return results
        finally:
            heads.cancel()
            for forward in forwards:
                forward.cancel()
            while not handed.empty():  # handed over but not yet taken: cancelled too
                item = handed.get_nowait()
                if not isinstance(item, Exception):
                    item[0].cancel()


class Asker:
    """Embedding, head, tail, LM head, tokenizer and sampling: everything the asker keeps."""

    def __init__(self, model_path: str | Path, head_layers: int, *, n_threads: int | None = None,
                 max_context: int | None = None, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
                 placement: Placement = ON_THE_CPU, prefill_chunk: int = PREFILL_CHUNK) -> None:
        """``uplink_transform`` (set it after): rewrites the head's activations before they leave
        this process. ``placement``: where the head and tail compute (default the CPU) and with which kernels
        (a swarm's asker: the plan's, as its trunks). ``prefill_chunk``: prompt tokens per step
        (llama.cpp's n_ubatch); the chunks decide the bits, so compare runs only at one chunk size."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be 1 or more, not {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.gguf = GGUFFile(model_path)
        self.head: SliceEngine | None = None
        self.tail: SliceEngine | None = None
        try:
            self.spec = ModelSpec.from_gguf(self.gguf)
            head, tail = u_ends(self.spec.n_layer, head_layers)
            self.head = SliceEngine(self.gguf, head, n_threads=n_threads, max_context=max_context,
                                    placement=placement)
            self.tail = SliceEngine(self.gguf, tail, n_threads=n_threads, max_context=max_context,
                                    placement=placement)
            self.max_context = self.head.max_context
            self.tokenizer = Tokenizer(model_path)
        except BaseException:
            self.close()
            raise
        self.head_runner = BatchRunner(self.head)
        self.tail_runner = BatchRunner(self.tail)
        self.u = USteps(self.head_runner, self.tail_runner)
        self.max_in_flight = max_in_flight
        self._admission: asyncio.Semaphore | None = None
        self.in_flight: dict[bytes, Generation] = {}

    @property
    def uplink_transform(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """Rewrites the head's activations before they leave this process (None: as computed)."""
        return self.u.uplink_transform

    @uplink_transform.setter
    def uplink_transform(self, transform: Callable[[np.ndarray], np.ndarray] | None) -> None:
        self.u.uplink_transform = transform

    async def generate(self, prompt: Sequence[int], trunk: Trunk | None, *, max_tokens: int,
                       sampling: SamplingParams, timeout: float | None = None,
                       generation: Generation | None = None, ignore_eos: bool = False,
                       speculation: Speculation | None = None, logprobs: int | None = None,
                       grammar: Grammar | None = None, prefixes: PrefixCache | None = None) -> AsyncIterator[int]:
        """Yield generated token ids. ``timeout`` bounds the whole request, the wait for admission
        included; ``generation`` (optional) is filled in as it goes; ``ignore_eos`` keeps going
        past end-of-generation tokens (for benchmarks, like llama.cpp's --ignore-eos);
        ``speculation`` drafts tokens to check several per step (swarmctl/asker/speculate.py), and
        counts what it drafted and kept; ``logprobs``: record each token's log-probability and that
        many alternatives in ``generation.logprobs`` (None: none); ``grammar``: only tokens it
        allows are chosen, drafts included (kernels/grammar.py: structured output); ``prefixes``:
        start from the longest kept prefix the prompt begins with, and keep this prompt's cells
        there at the end (swarmctl/asker/prefixes.py; the answer is the same bits)."""
        if max_tokens <= 0:
            raise EngineError("--max-tokens must be a positive number")
        if not prompt:
            raise EngineError("the prompt is empty")
        if len(prompt) >= self.max_context:
            raise ContextOverflowError(f"the prompt has {len(prompt)} tokens but the context length is "
                                       f"{self.max_context}")
        deadline = clock.now() + timeout if timeout else None
        if self._admission is None:
            self._admission = asyncio.Semaphore(self.max_in_flight)
        try:
            await asyncio.wait_for(self._admission.acquire(), timeout)
        except asyncio.TimeoutError:
            raise BusyError(f"the swarm is busy ({self.max_in_flight} requests in flight); gave up after "
                            f"waiting {timeout:.0f}s") from None
        gen = generation or Generation(secrets.token_bytes(16), len(prompt))
        gen.request_id = gen.request_id or secrets.token_bytes(16)
        self.in_flight[gen.request_id] = gen
        if prefixes is not None and (speculation is not None and speculation.wants_hidden
                                     or trunk is not None and getattr(trunk, "keep", None) is None):
            prefixes = None  # (a draft that reads every row's hidden state, or a trunk that cannot keep cells)
        filled = Steps()  # the prompt's steps of several rows: what a kept prefix may hold
        steps = None
        try:
            if prefixes is not None:
                gen.cached_tokens, filled = await self._resume(gen.request_id, prompt, trunk, prefixes)
            sampler = Sampler(sampling)
            steps = self._steps(list(prompt), trunk, max_tokens, sampler, gen, ignore_eos, speculation, logprobs,
                                grammar, gen.cached_tokens)
            while True:
                remaining = None if deadline is None else deadline - clock.now()
                if remaining is not None and remaining <= 0:
                    raise BusyError(f"the request ran past its {timeout:.0f}s deadline")
                try:
                    token = await asyncio.wait_for(steps.__anext__(), remaining)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise BusyError(f"the request ran past its {timeout:.0f}s deadline") from None
                yield token
        finally:
            if steps is not None:
                await steps.aclose()
            if speculation is not None:
                await speculation.release(gen.request_id)
            del self.in_flight[gen.request_id]
            self._admission.release()
            if prefixes is not None and gen.prompt_done:
                for start, rows in chunk_bounds(gen.cached_tokens, len(prompt), self.prefill_chunk):
                    filled = filled.then(start, rows)
                await self._keep(gen.request_id, prompt, filled.exact(), trunk, prefixes)
            else:
                await self._release(gen.request_id, trunk)

    async def _steps(self, prompt: list[int], trunk: Trunk | None, max_tokens: int, sample: Sampler,
                     gen: Generation, ignore_eos: bool, speculation: Speculation | None = None,
                     logprobs: int | None = None, grammar: Grammar | None = None, start: int = 0):
        """``start``: the first prompt position to compute (those before it came from a kept prefix)."""
        rid = gen.request_id
        # A draft from the final hidden states (--speculate mtp) is shown those of every kept row.
        hidden_rows = speculation is not None and speculation.wants_hidden
        # The chunks a plain run from 0 cuts: the same bits (swarmctl/asker/prefixes.py)
        bounds = chunk_bounds(start, len(prompt), self.prefill_chunk)
        chunks = [prompt[a:a + n] for a, n in bounds]
        prompt_result = None  # the last chunk's logits and timing, when the chunks streamed through together
        if len(chunks) > 1 and trunk is not None and trunk.steps_in_flight > 1:
            *fills, prompt_result = await self.u.stream_prompt(rid, chunks, trunk, hidden_rows, start)
            for (out, timing), (chunk_start, _) in zip(fills, bounds):
                gen.fill_timings.append(timing)
                if hidden_rows:
                    speculation.saw(rid, chunk_start, split_hidden(out)[1])
            start = len(prompt) - len(chunks[-1])
        else:
            for chunk in chunks[:-1]:  # all but the last prompt chunk: only fill the caches
                out, timing = await self.u.step(rid, start, chunk, trunk, hidden_rows=hidden_rows)
                gen.fill_timings.append(timing)
                if hidden_rows:
                    speculation.saw(rid, start, split_hidden(out)[1])
                start += len(chunk)
        # The windows in flight (swarmctl/asker/windows.py): what goes out next, what a verdict cancels
        flight = Windows(start, chunks[-1], list(prompt), self.max_context)
        try:
            while len(gen.tokens) < max_tokens:
                if not flight.out:
                    # Drafts ride along after the last token (never with a prompt chunk, which must
                    # stay the prefill a plain run does); each row of logits then says what follows
                    # its position.
                    room, draft = flight.room(max_tokens - len(gen.tokens)), Draft()
                    if prompt_result is not None:
                        done = asyncio.get_running_loop().create_future()
                        done.set_result(prompt_result)
                        flight.add(Window(flight.start, flight.lead, draft, done))
                        prompt_result = None
                    else:
                        if speculation is not None and len(flight.lead) == 1 and room > 0:
                            draft = await speculation.propose(rid, flight.context, room, sample.params)
                        flight.add(self.u.launch(rid, flight.start, flight.lead, draft, trunk,
                                                 rewind=flight.rewinds, hidden_rows=hidden_rows))
                if speculation is not None and grammar is None:
                    await self._more_windows(rid, flight, max_tokens - len(gen.tokens), speculation, sample.params,
                                             trunk)
                window = flight.take()
                out, timing = await window.task
                if not gen.prompt_done and gen.cached_tokens:
                    gen.prefix_recomputed = rid in getattr(trunk, "recomputed", ())
                gen.prompt_done = True
                logits, hidden = split_hidden(out)
                gen.timings.append(timing)
                # Its drafts, and the first token of the window after it (the guess of what follows
                # them): the window's last row checks that guess, the next window's rows the rest.
                following = flight.following
                checked = window.draft if following is None else window.draft.then(following.lead[0], following.guess_q)
                sampling_started = time.perf_counter()
                rows = logits[len(logits) - len(window.draft.tokens) - 1:]  # row j: what follows the j-th last position
                if grammar is None:
                    tokens, kept = accept(sample, rows, checked, choose_last=following is None)
                else:  # in a grammar worker, within its time budget: a full mask can take long (kernels/grammar.py)
                    tokens, kept = await grammar.run(choose_constrained, grammar, sample, rows, checked)
                chain_holds = following is not None and kept == len(checked.tokens)
                timing.done = time.perf_counter()
                timing.sample_s = timing.done - sampling_started
                timing.first_token, timing.tokens = len(gen.tokens), tuple(tokens)
                timing.drafted, timing.kept = len(checked.tokens), kept
                if speculation is not None:
                    speculation.record(len(checked.tokens), kept, timing if len(window.lead) == 1 else None,
                                       len(window.lead) + len(window.draft.tokens), checked.match)
                    gen.drafted, gen.accepted = speculation.drafted, speculation.accepted
                    if hidden is not None:  # the rows of the lead and the drafts kept were computed on kept tokens
                        speculation.saw(rid, window.start, hidden[:len(window.lead) + kept])
                for j, token in enumerate(tokens):
                    if not ignore_eos and self.tokenizer.is_end_of_generation(token):
                        gen.finish_reason = "stop"
                        return
                    if logprobs is not None:
                        gen.logprobs.append(token_logprob(rows[j], token, logprobs))
                    gen.tokens.append(token)
                    flight.context.append(token)
                    yield token
                # The next window's step stands, or the later ones fall: the next step starts after
                # the last kept draft and its later cells are dropped.
                fallen = flight.verdict(window, kept, chain_holds, gen.tokens[-1])
                if fallen:
                    for later in fallen:
                        later.task.cancel()
                    await asyncio.gather(*(later.task for later in fallen), return_exceptions=True)
                if flight.context_full:
                    gen.finish_reason = "context"
                    return
            gen.finish_reason = "length"
        finally:
            for later in flight.out:
                later.task.cancel()
            await asyncio.gather(*(later.task for later in flight.out), return_exceptions=True)

    async def _more_windows(self, rid: bytes, flight: Windows, left: int, speculation: Speculation,
                            sampling: SamplingParams, trunk: Trunk | None) -> None:
        """Windows in flight: while the cost model says another window pays (up to its cap), draft
        one on the guess that every window out keeps all its drafts, and send it before their
        verdicts. ``left``: tokens still to generate."""
        while (guess := flight.guess(left, speculation.windows(), speculation.length.k)) is not None:
            proposal = await speculation.draft(rid, guess.context, guess.k + 1, sampling)
            if not proposal.tokens:
                return
            rest = Draft(proposal.tokens[1:], [proposal.q[i] if i < len(proposal.q) else None
                                               for i in range(1, len(proposal.tokens))], proposal.match)
            flight.add(self.u.launch(rid, guess.start, proposal.tokens[:1], rest, trunk,
                                   guess_q=proposal.q[0] if proposal.q else None, hidden_rows=speculation.wants_hidden))

    async def _resume(self, rid: bytes, prompt: Sequence[int], trunk: Trunk | None,
                      prefixes: PrefixCache) -> tuple[int, Steps]:
        """Start request ``rid`` from the kept prefix ``prompt`` shares the most with: its cells
        move into the request's caches here and at every stage. Returns the first position to
        compute and the steps that computed those before it ((0, none) without one)."""
        found = prefixes.take(prompt, self.prefill_chunk)
        if found is None:
            return 0, Steps()
        entry, start = found.entry, found.start
        here = all(e.position_of(entry.key) >= start and e.has_request(entry.key) for e in (self.head, self.tail))
        if not here or (trunk is not None and not await trunk.resume(rid, entry.prefix, start, entry.trunk_record)):
            await self._forget(entry, trunk)
            return 0, Steps()
        await self.head_runner.call(self.head.move, entry.key, rid, start)
        await self.tail_runner.call(self.tail.move, entry.key, rid, start)
        return start, entry.steps.cut(start)

    async def _keep(self, rid: bytes, prompt: Sequence[int], filled: Steps, trunk: Trunk | None,
                    prefixes: PrefixCache) -> None:
        """End request ``rid``, keeping the cells of its prompt's positions [0, filled.end) as a
        prefix here and at every stage (freed instead where that cannot be done)."""
        entry = PrefixEntry(tuple(prompt[:filled.end]), filled)
        if self.head is None or self.tail is None or filled.end < 2:
            return await self._release(rid, trunk)
        if not (await self.head_runner.call(self.head.move, rid, entry.key, filled.end)
                and await self.tail_runner.call(self.tail.move, rid, entry.key, filled.end)):
            await self._forget(entry, None)
            return await self._release(rid, trunk)
        if trunk is not None:
            try:
                entry.trunk_record = await trunk.keep(rid, entry.prefix, filled.end)
            except (EngineError, ConnectionError):
                entry.trunk_record = None
            if entry.trunk_record is None:
                return await self._forget(entry, None)
        else:
            entry.trunk_record = []
        for old in prefixes.put(entry):
            await self._forget(old, trunk)

    async def _forget(self, entry: PrefixEntry, trunk: Trunk | None) -> None:
        """Free a kept prefix's cells here (and, for an in-process trunk, its stages')."""
        if self.head is None or self.tail is None:
            return
        await self.head_runner.call(self.head.release, entry.key)
        await self.tail_runner.call(self.tail.release, entry.key)
        if trunk is not None and getattr(trunk, "forget", None) is not None:
            await trunk.forget(entry.prefix)

    async def _release(self, rid: bytes, trunk: Trunk | None) -> None:
        if self.head is None or self.tail is None:
            return  # closed already: the engines freed everything
        await self.head_runner.call(self.head.release, rid)
        await self.tail_runner.call(self.tail.release, rid)
        if trunk is not None:
            try:
                await trunk.release(rid)
            except (EngineError, ConnectionError):
                pass  # the trunk frees idle requests on its own

    def close(self) -> None:
        for runner in (getattr(self, "head_runner", None), getattr(self, "tail_runner", None)):
            if runner is not None:
                runner.close()
        for engine in (self.head, self.tail):
            if engine is not None:
                engine.close()
        self.head = self.tail = None
        self.gguf.close()


async def generate_all(asker: Asker, prompt: Sequence[int], trunk: Trunk | None, *, max_tokens: int,
                       sampling: SamplingParams, timeout: float | None = None, ignore_eos: bool = False,
                       speculation: Speculation | None = None, grammar: Grammar | None = None) -> Generation:
    """Run one request to the end; returns its Generation (tokens, finish reason, timings)."""
    gen = Generation(secrets.token_bytes(16), len(prompt))
    async for _ in asker.generate(prompt, trunk, max_tokens=max_tokens, sampling=sampling, timeout=timeout,
                                  generation=gen, ignore_eos=ignore_eos, speculation=speculation, grammar=grammar):
        pass
    return gen
