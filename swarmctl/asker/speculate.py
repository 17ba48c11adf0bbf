"""Speculative steps on the asker: draft a few tokens cheaply, check them all in one
step through the swarm, keep the prefix the model agrees with.

Over a WAN every token pays every link's round trip; a step that carries the last token plus k
drafted ones pays it once for up to k + 1 tokens. The asker drafts, checks and samples; the trunk
only sees a step of k + 1 positions marked ``verify``, and the next step marked ``rewind`` when
some drafts were rejected (every stage then drops those positions' keys and values).

Exactness. A step of n positions does not by itself give each position the bits that n one-token
steps give: ggml's CPU matmul sends a product with two or more columns to llamafile's sgemm and a
single column to ``ggml_vec_dot_f16``, which add attention's F16 products in another order. Found
on SmolLM2 Q4_1: 53 of 96 checked rows differed, logits up to 0.85 apart, and greedy speculation
left plain decoding after 21 tokens. A ``verify`` step therefore runs attention one row at a time
(kernels/graph.py, ``GraphBuilder._attend``): the same 96 rows are then bit-identical, and greedy
speculative output equals plain output token for token (tests/test_speculate.py).

Sampling follows speculative sampling (Leviathan et al. 2023; Chen et al. 2023): a drafted token
d is kept with probability min(1, p(d) / q(d)), where p is the target's distribution (after
top-k, top-p, temperature) and q the draft's; at the first rejection the token is drawn from
the residual max(0, p − q) renormalised; when every draft is kept, one more token is drawn from
the last row. The output distribution is exactly the target's. Seeded runs are reproducible but
are not the same draws as a plain run with that seed.

    ngram   prompt lookup: the longest recent n-gram of the context that occurred before
            proposes what followed it then (code edits, extraction, quoting chat); q is a point
            mass on the proposed token
    draft   a small GGUF with the same vocabulary, run whole on the asker (``ModelDraft``)
    layerskip  the model itself with its trunk skipped: the asker's own head layers feed its own
            tail layers and LM head directly (``LayerSkipDraft``); no other file, no crossing,
            any architecture, and low acceptance where the trunk does most of the work
    mtp     the model's multi-token-prediction (nextn) layer, which DeepSeek-V3 and GLM files may
            carry after their last layer, run at the asker from the final hidden states its tail
            makes anyway (``MtpDraft``): no crossing, one layer's compute per drafted token
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from kernels.sampling import Candidates, Sampler, SamplingParams
from kernels.slice import SliceEngine, Step, split_hidden
from kernels.spec import ModelSpec, SliceSpec
from plans.whatif import MAX_WINDOWS
from swarmctl.batching import BatchRunner
from swarmctl.model_files.models import checked_model

MODES = ("off", "ngram", "draft", "layerskip", "mtp")
MAX_DRAFT = 8  # drafted tokens per step at most
MAX_NGRAM = 4  # longest n-gram matched against the context
LOOKBACK = 4096  # how far back the lookup searches (tokens)
RHO_PRIOR = 0.25  # a row's cost against a one-row step, until a step has measured it
PROMPT_ROWS = 512  # positions per step when the nextn layer catches up on a prompt (the prompt's own chunk)
# MAX_WINDOWS (plans/whatif.py): the speculative windows of one request out at once, at most, and the
# planner's what-if with it (benchmarks/bench_swarm.py section k: 6 and 8 windows were exact; 6 always
# out paid over 4 where the trip had room; the asker's choice under a cap of 6 did as well as under 4 on
# one CPU-bound box, under 8 it did worse there)
# A further window goes out only if the chain before it stands (every window out keeps all its
# drafts) at least this often: while the stages queue other requests' steps, a window that falls
# takes rows from them; while they idle between this request's trips, it costs little.
WINDOW_WORTH_BUSY = 0.5
WINDOW_WORTH_IDLE = 0.2
RETRY_MAX = 64  # plain steps between retries of a single draft at most, after failed retries
GAIN_SAMPLES = 3  # drafting steps timed before their measured gain may stop drafting (one failed step alone says little)
GAIN_WINDOW = 5  # ... and the latest drafting steps it is the median of
PLAIN_EVERY = 16  # while drafts often fail, one plain step in this many drafting steps is timed
BUSY = 0.1  # the stages count as busy when steps queue there for this share of a trip or more
MATCH_FLOOR = 2  # prompt lookup drafts from matches of this many tokens or more (MatchGate: one-token ones rarely hold)


@dataclass
class Draft:
    """Drafted tokens and, per token, the distribution it was drawn from (None: a point mass)."""

    tokens: list[int] = field(default_factory=list)
    q: list[Candidates | None] = field(default_factory=list)
    match: int | None = None  # prompt lookup: how many context tokens the drafts' n-gram matched (None: a model's)

    def q_of(self, i: int) -> Candidates:
        return self.q[i] if i < len(self.q) and self.q[i] is not None else Candidates.only(self.tokens[i])

    def then(self, token: int, q: Candidates | None) -> "Draft":
        """These drafts and one more after them (a window in flight's guessed first token)."""
        return Draft(self.tokens + [token], [self.q[i] if i < len(self.q) else None
                                             for i in range(len(self.tokens))] + [q], self.match)


@dataclass
class NgramDraft:
    """Prompt lookup decoding: no model, just the context."""

    max_ngram: int = MAX_NGRAM
    lookback: int = LOOKBACK

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens: what followed an earlier occurrence of the context's longest matching
        suffix (of ``max_ngram`` tokens down to one) — the latest occurrence with k tokens after
        it, else the one with the most (a recent match inside the answer being written is often
        cut short by the end of the context); [] when nothing matches."""
        return self.lookup(context, k)[0]

    def lookup(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """``propose``'s tokens and the length of the suffix they follow (0: nothing matched)."""
        if k <= 0:
            return [], 0
        window = list(context[-self.lookback:])
        n_ctx = len(window)
        for n in range(min(self.max_ngram, n_ctx - 1), 0, -1):
            suffix = window[-n:]
            best: list[int] = []
            for start in range(n_ctx - n - 1, -1, -1):  # latest first, before the suffix itself
                if window[start:start + n] == suffix:
                    follows = window[start + n:start + n + k]
                    if len(follows) > len(best):
                        best = follows
                    if len(best) == k:
                        break
            if best:
                return best, n
        return [], 0

    async def draft(self, rid: bytes, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft:
        tokens, n = self.lookup(context, k)
        return Draft(tokens, match=n)

    async def release(self, rid: bytes) -> None:
        pass


class _EngineDraft:
    """A draft that runs an engine of its own at the asker: the file, the engine and its runner,
    and per request a sampler and what ``_forget`` drops."""

    gguf: GGUFFile
    engine: SliceEngine
    runner: BatchRunner
    _samplers: dict[bytes, Sampler]

    def _forget(self, rid: bytes) -> None:
        raise NotImplementedError

    async def release(self, rid: bytes) -> None:
        self._forget(rid)
        self._samplers.pop(rid, None)
        await self.runner.call(self.engine.release, rid)

    def close(self) -> None:
        self.runner.close()
        self.engine.close()
        self.gguf.close()


class ModelDraft(_EngineDraft):
    """A small model with the target's vocabulary, run whole on the asker (``--draft-model``). It
    keeps a KV cache per request and catches up on the tokens the target kept since its last
    draft (rewinding over the ones it drafted and the target did not keep)."""

    def __init__(self, path: str | Path, target: GGUFFile, *, n_threads: int | None = None,
                 max_context: int | None = None) -> None:
        self.gguf = GGUFFile(path)
        try:
            check_same_vocabulary(self.gguf, target, Path(path).name)
            spec = ModelSpec.from_gguf(self.gguf)
            self.engine = SliceEngine(self.gguf, SliceSpec(0, spec.n_layer, True, True), n_threads=n_threads,
                                      max_context=max_context)
        except BaseException:
            self.gguf.close()
            raise
        self.runner = BatchRunner(self.engine)
        self._held: dict[bytes, list[int]] = {}  # per request: the tokens its cache holds, in order
        self._samplers: dict[bytes, Sampler] = {}

    async def draft(self, rid: bytes, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft:
        k = min(k, self.engine.max_context - len(context))
        if k <= 0:
            return Draft()
        held = self._held.setdefault(rid, [])
        common = 0
        for a, b in zip(held, context):
            if a != b:
                break
            common += 1
        common = min(common, len(context) - 1)  # the last context token is fed to get the next row
        sampler = self._samplers.setdefault(rid, Sampler(_draft_params(sampling)))
        new = list(context[common:])
        # A catch-up of several tokens after the prompt runs as a check does, so the draft's rows
        # are the bits its one-token steps would give (kernels.slice.Step.verify).
        logits = await self._logits(Step(rid, common, tokens=new, rewind=common < len(held), verify=common > 0))
        held[common:] = new
        out = Draft()
        for i in range(k):
            q = sampler.candidates(logits[-1])
            token = sampler.draw(q)
            out.tokens.append(token)
            out.q.append(None if sampling.greedy else q)
            if i + 1 < k:
                logits = await self._logits(Step(rid, len(held), tokens=[token]))
                held.append(token)
        return out

    async def _logits(self, step: Step) -> np.ndarray:
        logits, _ = await self.runner.run(step)
        return logits

    def _forget(self, rid: bytes) -> None:
        self._held.pop(rid, None)


class LayerSkipDraft(ModelDraft):
    """The target as its own draft, its trunk skipped (``--speculate layerskip``): embedding and
    head layers [0, K), then straight into tail layers [L-K, L) and the LM head: the layers the
    asker holds anyway, in engines of their own (their own KV caches; on the CPU the weights stay
    in the file's map, so they are not held twice). It drafts without a crossing, for any
    architecture; how often the trunk agrees with it is measured, not assumed."""

    def __init__(self, path: str | Path, head_layers: int, *, n_threads: int | None = None,
                 max_context: int | None = None) -> None:
        self.gguf = GGUFFile(path)
        try:
            n = ModelSpec.from_gguf(self.gguf).n_layer
            if not 0 <= head_layers <= n // 2:
                raise EngineError(f"--speculate layerskip: {head_layers} head layers do not fit a model of {n}")
            self.head = SliceEngine(self.gguf, SliceSpec(0, head_layers, has_embedding=True), n_threads=n_threads,
                                    max_context=max_context)
            self.engine = SliceEngine(self.gguf, SliceSpec(n - head_layers, n, has_lm_head=True),
                                      n_threads=n_threads, max_context=max_context)
        except BaseException:
            if getattr(self, "head", None) is not None:
                self.head.close()
            self.gguf.close()
            raise
        self.head_runner = BatchRunner(self.head)
        self.runner = BatchRunner(self.engine)
        self._held = {}
        self._samplers = {}

    async def _logits(self, step: Step) -> np.ndarray:
        hidden, _ = await self.head_runner.run(step)
        logits, _ = await self.runner.run(Step(step.request_id, step.start_pos, hidden=hidden, rewind=step.rewind,
                                               verify=step.verify))
        return logits

    async def release(self, rid: bytes) -> None:
        await super().release(rid)
        await self.head_runner.call(self.head.release, rid)

    def close(self) -> None:
        self.head_runner.close()
        self.head.close()
        super().close()


@dataclass
class _NextnState:
    """One request at the nextn layer. Its cache cell i holds the layer's input at position i: the
    embedding of token i + 1 and the target's final hidden state at i. Cells [0, ``committed``)
    hold true inputs (hidden states the target computed, tokens it chose); later ones were
    drafts, and are rewound over."""

    committed: int = 0
    filled: int = 0  # cells the layer holds now (committed, then a draft's chain)
    last: tuple[np.ndarray, np.ndarray] | None = None  # cell committed - 1's (logits, output hidden state)
    seen: dict[int, np.ndarray] = field(default_factory=dict)  # position → the target's hidden state, not yet run


class MtpDraft(_EngineDraft):
    """``--speculate mtp``: the model's own multi-token-prediction layer at the asker (DeepSeek-V3's
    MTP module, as vLLM and SGLang run it). The asker's tail returns each step's final normed
    hidden states (kernels.slice.Step.hidden_rows; the logits are unchanged) and the rows the
    target kept are handed here (``saw``). To draft after a context of n tokens, the layer first
    runs every position it has not seen with its true inputs (position j: the hidden state at j
    and token j + 1; a prompt's positions included), whose last row's logits are the first draft;
    each further draft feeds the layer's own output hidden state and the token just drafted.
    Drafting beyond what the target has shown (a window in flight's guess) chains the same way
    through the assumed tokens. One layer per drafted token, no crossing; how often the trunk
    agrees is measured, not assumed."""

    wants_hidden = True

    def __init__(self, path: str | Path, *, n_threads: int | None = None, max_context: int | None = None) -> None:
        self.gguf = GGUFFile(path)
        try:
            spec = ModelSpec.from_gguf(self.gguf)
            if not spec.n_nextn:
                raise EngineError(f"--speculate mtp: {Path(path).name} has no multi-token-prediction (nextn) layer; "
                                  f"--speculate ngram or layerskip work with any model")
            probe = f"blk.{spec.n_layer}.nextn.eh_proj.weight"  # llama.cpp's test for a trunk-only file
            if probe not in self.gguf.tensors:
                raise EngineError(f"--speculate mtp: {Path(path).name} has no multi-token-prediction (nextn) layer: "
                                  f"its metadata counts {spec.n_nextn} but {probe} is not in the file; "
                                  f"--speculate ngram or layerskip work with any model")
            self.engine = SliceEngine(self.gguf, SliceSpec.nextn_of(spec), n_threads=n_threads,
                                      max_context=max_context)
        except BaseException:
            self.gguf.close()
            raise
        self.runner = BatchRunner(self.engine)
        self._state: dict[bytes, _NextnState] = {}
        self._samplers: dict[bytes, Sampler] = {}

    def saw(self, rid: bytes, start: int, hidden: np.ndarray) -> None:
        """The target's final hidden states of positions [start, start + len(hidden)), each
        computed on kept tokens only."""
        state = self._state.setdefault(rid, _NextnState())
        for i, row in enumerate(hidden):
            if start + i >= state.committed:
                state.seen[start + i] = row

    async def draft(self, rid: bytes, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft:
        state = self._state.get(rid)
        k = min(k, self.engine.max_context - len(context))
        if state is None or k <= 0:
            return Draft()
        # Catch up: positions whose hidden state the target gave, in chunks of a prompt's size.
        while state.committed in state.seen and state.committed + 1 < len(context):
            n = 0
            while n < PROMPT_ROWS and state.committed + n in state.seen and state.committed + n + 1 < len(context):
                n += 1
            a = state.committed
            rows = np.stack([state.seen.pop(a + i) for i in range(n)])
            state.last = await self._run(state, rid, a, context[a + 1:a + n + 1], rows)
            state.committed = a + n
        for pos in [p for p in state.seen if p < state.committed]:
            del state.seen[pos]
        if state.last is None:
            return Draft()  # nothing seen yet
        logits, hidden = state.last
        pos = state.committed
        while pos + 2 <= len(context):  # tokens assumed beyond what the target showed: chain through them
            logits, hidden = await self._run(state, rid, pos, [context[pos + 1]], hidden[None])
            pos += 1
        sampler = self._samplers.setdefault(rid, Sampler(_draft_params(sampling)))
        out = Draft()
        for i in range(k):
            q = sampler.candidates(logits)
            token = sampler.draw(q)
            out.tokens.append(token)
            out.q.append(None if sampling.greedy else q)
            if i + 1 < k:
                logits, hidden = await self._run(state, rid, pos, [token], hidden[None])
                pos += 1
        return out

    async def _run(self, state: _NextnState, rid: bytes, start: int, tokens: Sequence[int],
                   hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The layer on ``tokens`` and the hidden states before them from ``start`` (cells after it
        dropped); the last row's logits and output hidden state."""
        out, _ = await self.runner.run(Step(rid, start, tokens=list(tokens), hidden=hidden, rewind=start < state.filled))
        state.filled = start + len(tokens)
        logits, rows = split_hidden(out)
        return logits[-1], rows[-1]

    def _forget(self, rid: bytes) -> None:
        self._state.pop(rid, None)


def _draft_params(sampling: SamplingParams) -> SamplingParams:
    """The draft samples with the request's settings but its own random stream."""
    seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + 17) % 2**63
    return SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed)


def check_same_vocabulary(draft: GGUFFile, target: GGUFFile, name: str) -> None:
    """A draft proposes token ids: they must mean what they mean to the target."""
    d, t = draft.get("tokenizer.ggml.tokens"), target.get("tokenizer.ggml.tokens")
    if d is None or t is None or len(d) != len(t) or list(d) != list(t):
        n_d = "no" if d is None else len(d)
        n_t = "no" if t is None else len(t)
        raise EngineError(f"--draft-model {name}: its vocabulary differs from the model's ({n_d} tokens vs "
                          f"{n_t}{'' if n_d != n_t else ', not the same ones'}); a draft must share the tokenizer")


@dataclass
class DraftLength:
    """How many tokens to draft next: the k that maximises expected tokens per unit of step time,
    (1 - a^(k+1)) / (1 - a) / (1 + rho * k), from two running estimates: ``a``, the chance that a
    draft is kept (kept drafts against first rejections, recent steps weighted most), and ``rho``,
    what one more row costs against a one-row step (its compute against the round trip). Over a
    WAN a row is cheap against the round trip and drafts pay even when half fail; on one machine
    a row costs about a step and only well-kept drafts pay. At 0 (plain steps), one draft is tried
    again after ``retry_after`` plain steps, so a request that turns repetitive later gets its
    speed back; each retry that fails doubles that wait (up to ``retry_max``), one that keeps its
    draft halves it (down to ``retry_after``).

    The model is checked against what drafting steps really gave: each one's tokens against its
    time, over a plain step's time (``gain``, both as this request measured them: queueing behind
    other requests' steps, a machine busy with other work and the check's own overheads
    included). Drafting stops while that measured gain is below 1, whatever the model says. While
    drafts are often rejected, a plain step is taken now and then (``PLAIN_EVERY``) to keep the
    plain step's time current: it costs nothing against not speculating."""

    k: int = 4
    k_max: int = MAX_DRAFT
    retry_after: int = 8
    retry_max: int = RETRY_MAX
    decay: float = 0.8  # weight of the previous estimates at each step
    kept: float = 1.0  # decayed counts behind ``a`` (a prior of one each)
    failed: float = 1.0
    rho: float | None = None  # unknown until a step with drafts has been timed
    one_row_compute_s: float | None = None  # a plain step's compute (what every step pays once)
    fill: float | None = None  # a step's time against its compute: how many steps its trip could hold
    busy: float = 0.0  # the share of a step's time it queued at the stages behind other steps
    stood: float = 1.0  # decayed counts of drafting steps that kept every draft, and that did not (a prior of one each)
    fell: float = 1.0
    fixed_windows: int | None = None  # windows in flight as given (tests, benchmarks); None: from the cost model
    max_windows: int = MAX_WINDOWS  # what the cost model may choose at most
    plain_s: float | None = None  # a plain (one-row) decode step's time, start to logits, as measured
    gains: deque = field(default_factory=lambda: deque(maxlen=GAIN_WINDOW))  # the latest drafting steps' gains
    _plain_steps: int = field(default=0, repr=False)
    _retry_every: int | None = field(default=None, repr=False)  # plain steps before a retry now (backs off)
    _retrying: bool = field(default=False, repr=False)  # the step out is a retry's single draft
    _since_plain: int = field(default=0, repr=False)  # drafting steps since a plain step was timed

    @property
    def a(self) -> float:
        return self.kept / (self.kept + self.failed)

    @property
    def retry_every(self) -> int:
        """Plain steps before the next retry of a single draft (doubled by each failed retry)."""
        return self.retry_after if self._retry_every is None else self._retry_every

    def next(self) -> int:
        self._retrying = False
        if self.k == 0:
            self._plain_steps += 1
            if self._plain_steps >= self.retry_every:
                self._plain_steps = 0
                self._retrying = True
                return 1
            return 0
        if self.a < 0.5 and (self.plain_s is None or self._since_plain >= PLAIN_EVERY):
            self._since_plain = 0
            return 0  # drafts often fail: time a plain step, what drafting is measured against
        self._since_plain += 1
        return self.k

    def observe(self, rows: int, compute_s: float, total_s: float, queued_s: float = 0.0) -> None:
        """A step's timing: a one-row step's compute is the fixed cost; a step of more rows tells
        what each further row adds, against the time of a one-row step (its round trip)."""
        def ewma(old: float | None, new: float) -> float:
            return new if old is None else self.decay * old + (1 - self.decay) * new

        if compute_s > 0:
            self.fill = ewma(self.fill, total_s / compute_s)
        if total_s > 0:
            self.busy = ewma(self.busy, queued_s / total_s)
        if rows == 1:
            self.one_row_compute_s = ewma(self.one_row_compute_s, compute_s)
            if total_s > 0:
                self.plain_s = ewma(self.plain_s, total_s)
            return
        if self.one_row_compute_s is None:
            return  # no plain step seen yet: nothing to tell the extra rows' share by
        per_row = max(0.0, compute_s - self.one_row_compute_s) / (rows - 1)
        one_row = total_s - (rows - 1) * per_row
        if one_row > 0:
            self.rho = ewma(self.rho, per_row / one_row)

    def yielded(self, tokens: int, total_s: float) -> None:
        """A drafting step's outcome: ``tokens`` chosen (drafts kept and the one the target chose)
        in ``total_s`` from its start to its logits. Against a plain step's time, what drafting
        really gave. A retry that kept its draft starts the figure over (the text may have turned
        repetitive): the next drafting steps then say which way it goes."""
        if self.plain_s is None or total_s <= 0:
            return
        if self._retrying and tokens > 1:
            self.gains.clear()
        self.gains.append(tokens * self.plain_s / total_s)

    @property
    def gain(self) -> float | None:
        """Drafting steps' tokens per second over plain steps', as measured: the median of the latest
        GAIN_WINDOW (a step slowed by other work on the machine, or one lucky draft, moves it
        little); None before GAIN_SAMPLES of them."""
        return statistics.median(self.gains) if len(self.gains) >= GAIN_SAMPLES else None

    def update(self, drafted: int, accepted: int) -> None:
        """After a step: ``drafted`` tokens, ``accepted`` of them kept."""
        if drafted == 0:
            return
        self.kept = self.decay * self.kept + accepted
        self.failed = self.decay * self.failed + (1 if accepted < drafted else 0)
        self.stood = self.decay * self.stood + (accepted == drafted)
        self.fell = self.decay * self.fell + (accepted < drafted)
        self.k = self.best_k()
        if self._retrying:  # a failed retry waits twice as long for the next; a kept one (luck, on text
            # that does not repeat, one time in a few) half as long
            self._retry_every = min(self.retry_max, 2 * self.retry_every) if self.k == 0 else \
                max(self.retry_after, self.retry_every // 2)
            self._retrying = False

    def windows(self, sure: bool = True) -> int:
        """How many windows to keep in flight: window n + 1 stands only if window n keeps
        all its drafts and the guess after them. How often a window keeps them all is measured
        (drafts are not kept independently: copied text keeps whole windows, then misses at an
        edit). The i-th extra window goes out while the chain before it stands often enough
        (WINDOW_WORTH_*, stricter while the stages are busy with others) and the trip holds it (a
        step's time over its compute: on one machine about 1, and windows would only queue).
        ``sure`` False: the step's drafts came from a weak source (a short lookup match), one window."""
        if self.fixed_windows is not None:
            return self.fixed_windows
        if self.k == 0 or self.fill is None or not sure:
            return 1
        stands = self.stood / (self.stood + self.fell)
        worth = WINDOW_WORTH_BUSY if self.busy >= BUSY else WINDOW_WORTH_IDLE
        n = 1
        while n < self.max_windows and n + 1 <= self.fill and stands ** n >= worth:
            n += 1
        return n

    def best_k(self) -> int:
        if self.gain is not None and self.gain < 1.0:
            return 0  # measured: drafting steps gave fewer tokens per second than plain ones
        a, rho = min(self.a, 0.999), RHO_PRIOR if self.rho is None else self.rho
        gain = [(1 - a ** (k + 1)) / (1 - a) / (1 + rho * k) for k in range(self.k_max + 1)]
        return max(range(self.k_max + 1), key=lambda k: (gain[k] > gain[0] * 1.02 or k == 0) and gain[k])


@dataclass
class MatchGate:
    """The shortest prompt-lookup match a request drafts from. How often the first draft after a
    match was kept, by the match's length, over every position of the four answers of
    bench_swarm's speculative tasks (greedy, the bundled model, worked out offline): one token 8
    of 48, two 7 of 17, three 5 of 8, four 191 of 201. A story's matches are one to three tokens
    long and rarely right; text the answer copies matches four. A draft checked costs its rows
    through every stage whether kept or not (more on a busy machine), so a request starts
    drafting from two-token matches; a draft whose first token is rejected raises the least
    length to one past its match (at most ``most``, the lookup's longest: a full-length match is
    always tried, and the measured gain (``DraftLength``) rules those); one that keeps every
    draft lowers it by one, not below ``floor``."""

    floor: int = MATCH_FLOOR
    least: int = MATCH_FLOOR
    most: int = MAX_NGRAM

    def allows(self, match: int | None) -> bool:
        """None: drafts from a model, which the gate does not judge."""
        return match is None or match >= self.least

    def sure(self, match: int | None) -> bool:
        """A full-length match (or a model's drafts): worth windows in flight after it. After a
        shorter one even the first draft is kept less than half the time, and a window in flight
        stands only if all of them and the guess are."""
        return match is None or match >= self.most

    def learn(self, match: int | None, drafted: int, accepted: int) -> None:
        if match is None or drafted == 0:
            return
        if accepted == 0:
            self.least = max(self.least, min(self.most, match + 1))
        elif accepted == drafted:
            self.least = max(self.floor, self.least - 1)


@dataclass
class Speculation:
    """A request's drafting: the source, the adaptive length, the shortest match it drafts from
    (prompt lookup), and what it achieved."""

    source: NgramDraft | ModelDraft | MtpDraft
    length: DraftLength = field(default_factory=DraftLength)
    gate: MatchGate = field(default_factory=MatchGate)
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # steps that carried drafts
    # the match the latest proposed step's drafts followed (0: it had none)
    _opening: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        most = getattr(self.source, "max_ngram", None)
        if most is not None:  # a lookup that never matches more cannot clear a higher bar
            self.gate.most = min(self.gate.most, most)
            self.gate.floor = min(self.gate.floor, most)
            self.gate.least = min(self.gate.least, most)

    async def propose(self, rid: bytes, context: Sequence[int], room: int, sampling: SamplingParams) -> Draft:
        """Drafts for the next step; ``room``: how many tokens may still be generated after the
        one the step is sure to produce."""
        out = await self.draft(rid, context, min(self.length.next(), room), sampling)
        self._opening = out.match if out.tokens else 0
        return out

    async def draft(self, rid: bytes, context: Sequence[int], k: int, sampling: SamplingParams) -> Draft:
        """Up to ``k`` drafts after ``context`` (a step's, or a window in flight's guess and its
        drafts), none where the lookup's match is shorter than the gate allows."""
        if k <= 0:
            return Draft()
        out = await self.source.draft(rid, context, k, sampling)
        return out if self.gate.allows(out.match) else Draft(match=out.match)

    def windows(self) -> int:
        """Windows in flight after the step just proposed: one unless its drafts followed a match
        the gate is sure of (or came from a model), else as the length policy says."""
        return self.length.windows(self.gate.sure(self._opening))

    @property
    def wants_hidden(self) -> bool:
        """The source drafts from the target's final hidden states (the asker's tail returns them)."""
        return getattr(self.source, "wants_hidden", False)

    def saw(self, rid: bytes, start: int, hidden: np.ndarray) -> None:
        """Hidden states of positions the target kept, from ``start`` (sources that want them)."""
        self.source.saw(rid, start, hidden)

    def record(self, drafted: int, accepted: int, timing=None, rows: int = 1, match: int | None = None) -> None:
        """After a step of ``rows`` rows: what it checked and kept (a window in flight's guessed first
        token counts as a draft of the window before); ``timing`` (a swarmctl.asker.TokenTiming) of a
        decode step (one token and its drafts, not a prompt chunk) feeds the cost model; ``match``:
        the lookup match the step's drafts followed (``Draft.match``)."""
        if timing is not None:
            self.length.observe(rows, timing.compute_s, timing.total_s, timing.trunk_queued_s)
            if drafted and rows > 1:
                self.length.yielded(accepted + 1, timing.total_s)
        self.length.update(drafted, accepted)
        self.gate.learn(match, drafted, accepted)
        if drafted:
            self.drafted += drafted
            self.accepted += accepted
            self.steps += 1

    async def release(self, rid: bytes) -> None:
        await self.source.release(rid)


def accept(sample: Sampler, rows: np.ndarray, draft: Draft, choose_last: bool = True) -> tuple[list[int], int]:
    """The tokens a checked step yields: the drafts kept, then one token the target chose (a
    correction at the first rejection, or one more after the last draft). ``rows``: the target's
    logits for the step's last ``len(draft.tokens) + 1`` positions (or ``len(draft.tokens)``
    with ``choose_last`` False: when every draft is kept, the next row, and the choice it makes,
    belong to the window in flight after this one). Returns (tokens, drafts kept)."""
    out: list[int] = []
    for i, d in enumerate(draft.tokens):
        p = sample.candidates(rows[i])
        if sample.params.greedy:
            token = int(p.ids[0])
            if token == d:
                out.append(d)
                continue
            return out + [token], i
        q = draft.q_of(i)
        p_d, q_d = p.prob(d), q.prob(d)
        if q_d > 0 and sample.uniform() < min(1.0, p_d / q_d):
            out.append(d)
            continue
        return out + [sample.draw(_residual(p, q))], i
    if not choose_last:
        return out, len(draft.tokens)
    return out + [sample(rows[len(draft.tokens)])], len(draft.tokens)


def _residual(p: Candidates, q: Candidates) -> Candidates:
    """max(0, p − q), renormalised: what p has that the draft under-proposed."""
    q_of = dict(zip(q.ids.tolist(), q.probs.tolist()))
    rest = np.array([max(0.0, pp - q_of.get(int(i), 0.0)) for i, pp in zip(p.ids, p.probs)])
    total = rest.sum()
    if total <= 0.0:  # p == q on p's support: any draw from p is right
        return p
    return Candidates(p.ids, rest / total)


class Drafting:
    """A process's ``--speculate`` choice: it makes each request's ``Speculation`` and owns the
    draft model that requests share."""

    def __init__(self, mode: str = "off", draft_model: ModelDraft | MtpDraft | None = None,
                 k_max: int = MAX_DRAFT) -> None:
        if mode == "layerskip" and draft_model is None:
            raise EngineError("--speculate layerskip drafts with the asker's own head and tail: open it with "
                              "open_drafting(..., head_layers=K)")
        speculation_for(mode, draft_model, k_max)  # a bad mode or a missing draft: one line now
        self.mode, self.draft_model, self.k_max = mode, draft_model, k_max

    def for_request(self) -> Speculation | None:
        return speculation_for(self.mode, self.draft_model, self.k_max)

    def close(self) -> None:
        if self.draft_model is not None:
            self.draft_model.close()
            self.draft_model = None


def open_drafting(mode: str, draft_path: str | None, model_path: str | Path, *, k_max: int = MAX_DRAFT,
                  n_threads: int | None = None, max_context: int | None = None,
                  head_layers: int | None = None) -> Drafting:
    """The drafting for ``--speculate MODE [--draft-model PATH] [--draft-tokens K]``; a draft model
    whose vocabulary differs from the model's is refused here, in one line. ``layerskip`` needs the
    asker's ``head_layers`` (None: not known yet, and then it is opened again once it is)."""
    if mode not in MODES:
        raise EngineError(f"--speculate {mode!r}: expected one of {', '.join(MODES)}")
    if not 1 <= k_max <= 32:
        raise EngineError(f"--draft-tokens must be between 1 and 32, not {k_max}")
    if draft_path is not None and mode != "draft":
        raise EngineError("--draft-model is used only with --speculate draft")
    if mode == "layerskip":
        if head_layers is None:
            return Drafting("off", None, k_max)
        return Drafting(mode, LayerSkipDraft(model_path, head_layers, n_threads=n_threads, max_context=max_context),
                        k_max)
    if mode == "mtp":
        return Drafting(mode, MtpDraft(model_path, n_threads=n_threads, max_context=max_context), k_max)
    if mode != "draft":
        return Drafting(mode, None, k_max)
    if draft_path is None:
        raise EngineError("--speculate draft needs --draft-model PATH (a small GGUF with the same vocabulary)")
    with GGUFFile(model_path) as target:
        draft = ModelDraft(checked_model(draft_path), target, n_threads=n_threads, max_context=max_context)
    return Drafting(mode, draft, k_max)


def speculation_for(mode: str, draft_model: ModelDraft | MtpDraft | None = None, k_max: int = MAX_DRAFT,
                    windows: int | None = None, max_windows: int = MAX_WINDOWS) -> Speculation | None:
    """A request's drafting for ``--speculate MODE`` (None: off); ``draft`` needs ``draft_model``;
    ``windows``: that many windows in flight, always (None: as the cost model says, up to
    ``max_windows``)."""
    if mode == "off":
        return None
    if mode == "ngram":
        return Speculation(NgramDraft(), DraftLength(k=min(4, k_max), k_max=k_max, fixed_windows=windows,
                                                       max_windows=max_windows))
    if mode in ("draft", "layerskip", "mtp"):
        if draft_model is None:
            raise EngineError("--speculate draft needs --draft-model PATH (a small GGUF with the same vocabulary)")
        return Speculation(draft_model, DraftLength(k=min(4, k_max), k_max=k_max, fixed_windows=windows,
                                                    max_windows=max_windows))
    raise EngineError(f"--speculate {mode!r}: expected one of {', '.join(MODES)}")
