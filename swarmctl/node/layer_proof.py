"""A trunk proves it holds the layers it serves, and shows the host how fast it runs them.

Claims are cheap: one ``register`` with a tiny ``ms_per_layer_token`` used to win every layer,
and a ``ready`` from a member without the model used to make it a stage. So the host checks.

**The layer check.** A layer's bytes are its tensors' data, the tensors in the order
``GGUFFile.layer_tensor_names`` gives (the order ``layer_hash`` hashes them in), end to end: the
same bytes in the full GGUF and in a slice file fetched from the host. The host sends a fresh
nonce and random windows ``[layer, offset, length]`` over those bytes; the trunk answers
``sha256(nonce, each window's layer/offset/length and bytes)`` from its own file, and the host
computes the same from its own GGUF. ``WINDOWS`` windows of ``WINDOW_BYTES``: 4 KiB read on each
side. A trunk that holds a share f of a stage's bytes passes with probability about f^16.

**The speed probe.** The host picks one layer the trunk holds and a number of steps R, and sends
a random activation row h0. The trunk runs R decode steps of that layer, each on the previous
step's output scaled to unit RMS (so the steps cannot run side by side: each needs the one
before), and answers only the SHA-256 of the R output rows: that round trip is what the host
times. It does this ``PROBE_RUNS`` times; then the host asks for the outputs of the fastest run
(they must hash to what the trunk committed to) and checks them with one prefill of the same
layer on its own copy: a causal prefill of the chain's inputs gives each step's output, so the
host's cost is one R-token pass over one layer, not R decode steps. The figure is the fastest
run's time less the host's round trip to the trunk, per step: never below what the trunk's
hardware can do (a trunk can answer slowly, but not faster than it computes), so the host plans
with the larger of it and the trunk's own claim.

Messages (host → trunk, each on a new stream of the trunk's connection to the host; a trunk
answers only its own host):

    prove        {nonce, windows: [[layer, offset, length], ...], probe?: {layer, steps}}
                 → proof {digest}                   (after the probe's warm-up, when asked for)
    probe_run    {run, hidden: base64 f32 [n_embd]} → probe_done {digest}     (timed by the host)
    probe_reveal {run}                              → probe_outputs {outputs: base64 f32 [steps, n_embd]}

    an error reply {type: "error", message, missing?: true}: ``missing`` when the trunk does not
    hold a layer asked about (at registration a trunk that fetches slices holds none yet).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import os
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

import numpy as np

from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from net import clock
from net import messages as m

WINDOWS = 16
WINDOW_BYTES = 256
MAX_WINDOWS = 64  # what a trunk answers at most (a challenge is the host's, but bounded all the same)
MAX_WINDOW_BYTES = 4096
PROBE_RUNS = 5  # the best of several short runs: on a loaded machine one of them finds the cores free
PROBE_TARGET_MS = 40.0  # a run of about this long at the claimed speed: the round trip's noise spreads thin
MIN_STEPS, MAX_STEPS = 8, 32
MAX_REVEAL_BYTES = 512 * 1024  # the outputs of a run, before base64
TOLERANCE = 0.05  # ‖trunk's output − host's‖ / ‖host's output − input|: one layer's update, 5%
TIMEOUT_S = float(os.environ.get("SWARMCTL_PROOF_TIMEOUT_S", "30"))  # per message; lower in tests
CHALLENGES = m.kinds(m.Prove, m.ProbeRun, m.ProbeReveal)  # what a trunk answers its host
_WINDOW_HEADER = struct.Struct(">IQI")
M = TypeVar("M", bound=m.Message)
_PROBE_ID = b"swarm-probe-0000"


class ProofError(Exception):
    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


# --- the layer check (both sides) ---

Experts = "tuple[int, int] | None"  # an expert node's [first, last): windows over those experts' bytes only


def _pieces(gguf: GGUFFile, layer: int, experts: Experts = None) -> list[memoryview]:
    """A layer's bytes as the check lays them end to end: its tensors' data or, for an expert node,
    the slabs of its experts [first, last) of the layer's expert tensors (all it holds of the layer)."""
    if experts is None:
        return [gguf.tensor_bytes(gguf.tensors[n]) for n in gguf.layer_tensor_names(layer)]
    from kernels.experts import expert_slabs

    out = []
    for _, _, info, offset, size in expert_slabs(gguf, layer, *experts):
        start = offset - info.offset
        out.append(gguf.tensor_bytes(info)[start:start + size])
    return out


def layer_size(gguf: GGUFFile, layer: int, experts: Experts = None) -> int:
    return sum(len(piece) for piece in _pieces(gguf, layer, experts))


def holds(gguf: GGUFFile, layers: Iterable[int], experts: Experts = None) -> bool:
    from kernels.experts import FIRST_KEY

    if experts is None and gguf.get(FIRST_KEY) is not None:
        return False  # an expert node's fetched file: some experts of each layer, no whole layer
    try:
        return all(layer_size(gguf, layer, experts) for layer in layers)
    except Exception:  # noqa: BLE001 - a file without those experts holds nothing asked about
        return False


def read_window(gguf: GGUFFile, layer: int, offset: int, length: int, experts: Experts = None) -> bytes:
    """``length`` bytes at ``offset`` of the layer's tensor data laid end to end."""
    out = bytearray()
    skip = offset
    for piece in _pieces(gguf, layer, experts):
        if skip >= len(piece):
            skip -= len(piece)
            continue
        out += piece[skip:skip + length - len(out)]
        skip = 0
        if len(out) == length:
            return bytes(out)
    raise ProofError(f"window [{layer}, {offset}, {length}] runs past the layer's bytes")


def window_digest(gguf: GGUFFile, nonce: bytes, windows: Sequence[Sequence[int]], experts: Experts = None) -> str:
    digest = hashlib.sha256(nonce)
    for layer, offset, length in windows:
        digest.update(_WINDOW_HEADER.pack(layer, offset, length))
        digest.update(read_window(gguf, layer, offset, length, experts))
    return digest.hexdigest()


def new_windows(gguf: GGUFFile, layers: Sequence[int], n: int = WINDOWS,
                length: int = WINDOW_BYTES, experts: Experts = None) -> list[list[int]]:
    """``n`` random windows, each over a random layer of ``layers`` (the host's choice, unpredictable)."""
    windows = []
    for _ in range(n):
        layer = layers[secrets.randbelow(len(layers))]
        size = layer_size(gguf, layer, experts)
        span = min(length, size)
        windows.append([layer, secrets.randbelow(size - span + 1), span])
    return windows


def check_windows(windows: object) -> list[tuple[int, int, int]]:
    """A challenge's windows as the trunk accepts them (bounded work), or ProofError."""
    if not isinstance(windows, list) or not 0 < len(windows) <= MAX_WINDOWS:
        raise ProofError(f"a challenge has 1 to {MAX_WINDOWS} windows")
    out = []
    for w in windows:
        if (not isinstance(w, list) or len(w) != 3 or any(isinstance(v, bool) or not isinstance(v, int) for v in w)
                or not (0 <= w[0] < 2**31 and 0 <= w[1] < 2**62 and 0 < w[2] <= MAX_WINDOW_BYTES)):
            raise ProofError(f"a window is [layer, offset, length] with 0 < length <= {MAX_WINDOW_BYTES}")
        out.append((w[0], w[1], w[2]))
    return out


# --- the speed probe (both sides) ---

def steps_for(claimed_ms: float | None, n_embd: int) -> int:
    """R: a run of about ``PROBE_TARGET_MS`` at the claimed speed, within bounds (a tiny claim
    gets the most steps; the revealed outputs stay under ``MAX_REVEAL_BYTES``)."""
    most = max(MIN_STEPS, min(MAX_STEPS, MAX_REVEAL_BYTES // (4 * n_embd)))
    if not claimed_ms or claimed_ms <= 0:
        return most
    return max(MIN_STEPS, min(most, math.ceil(PROBE_TARGET_MS / claimed_ms)))


def unit_rms(x: np.ndarray) -> np.ndarray:
    scale = np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True))
    return (x / np.maximum(scale, 1e-30)).astype(np.float32)


def chain_inputs(first: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    """The input of every step of a run: h0, then each output before the last, scaled to unit RMS."""
    return np.concatenate([first.reshape(1, -1), unit_rms(outputs[:-1])]).astype(np.float32)


def expected_outputs(gguf: GGUFFile, layer: int, inputs: np.ndarray, n_threads: int | None = None) -> np.ndarray:
    """What one layer gives for ``inputs`` at positions 0..R-1: one causal prefill (the host's side)."""
    from kernels.slice import SliceEngine
    from kernels.spec import SliceSpec

    with SliceEngine(gguf, SliceSpec(layer, layer + 1), n_threads=n_threads, max_context=len(inputs)) as engine:
        return engine.forward(b"swarm-verify-000", start_pos=0, hidden=inputs, outputs="all")


def check_outputs(first: np.ndarray, outputs: np.ndarray, expected: np.ndarray) -> str:
    """"" when every step's output matches the host's within ``TOLERANCE`` of that step's update."""
    inputs = chain_inputs(first, outputs)
    if outputs.shape != expected.shape or not np.isfinite(outputs).all():
        return "outputs of the wrong shape or not finite"
    update = np.linalg.norm(expected - inputs, axis=1)
    error = np.linalg.norm(outputs - expected, axis=1) / np.maximum(update, 1e-30)
    worst = int(np.argmax(error))
    if error[worst] > TOLERANCE:
        return f"step {worst}'s output is off by {error[worst]:.3g} of the layer's update (tolerance {TOLERANCE})"
    return ""


def encode_array(x: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(x, dtype="<f4").tobytes()).decode()


def decode_array(text: object, columns: int, max_rows: int) -> np.ndarray:
    if not isinstance(text, str) or len(text) > (max_rows * columns * 4 + 2) * 4 // 3 + 4:
        raise ProofError("expected a base64 array of bounded size")
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise ProofError("not base64") from None
    if len(raw) % (4 * columns) or not 0 < len(raw) <= max_rows * columns * 4:
        raise ProofError(f"expected rows of {columns} float32 values")
    return np.frombuffer(raw, dtype="<f4").reshape(-1, columns).astype(np.float32)


def outputs_digest(outputs: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(outputs, dtype="<f4").tobytes()).hexdigest()


# --- the trunk's side ---

class _Probe:
    """One layer, warmed up: its KV cache sized for the steps and its graphs built."""

    def __init__(self, gguf: GGUFFile, layer: int, steps: int, n_threads: int | None) -> None:
        from kernels.slice import SliceEngine
        from kernels.spec import SliceSpec

        self.layer, self.steps = layer, steps
        self.engine = SliceEngine(gguf, SliceSpec(layer, layer + 1), n_threads=n_threads, max_context=steps)
        self.n_embd = self.engine.spec.n_embd
        self.outputs: dict[int, np.ndarray] = {}
        rng = np.random.default_rng()
        try:
            self.engine.forward(_PROBE_ID, start_pos=0, hidden=rng.standard_normal((steps, self.n_embd),
                                                                                   dtype=np.float32))
            self.run(rng.standard_normal((1, self.n_embd), dtype=np.float32))
        except BaseException:
            self.engine.close()
            raise

    def run(self, first: np.ndarray) -> np.ndarray:
        outputs = np.empty((self.steps, self.n_embd), np.float32)
        x = first
        for i in range(self.steps):  # rewinds to position 0: every run at the same positions, graphs reused
            outputs[i] = self.engine.forward(_PROBE_ID, start_pos=i, hidden=x)[0]
            x = unit_rms(outputs[i:i + 1])
        return outputs

    def close(self) -> None:
        self.engine.close()


class Prover:
    """Answers the host's challenges from the files this trunk holds. Call ``answer`` on the
    compute thread (one at a time): the probe's steps then never share the cores with a batch.

    ``sources`` lists the files that may hold the layers asked about (the loaded one first). The
    prover keeps its own map of each (not the stage's), so a stage reloading meanwhile cannot pull
    the bytes away from under a probe; a file no longer listed is closed at the next challenge."""

    def __init__(self, sources: Callable[[], list[Path]], n_threads: int | None = None) -> None:
        self.sources = sources
        self.n_threads = n_threads
        self._gguf: GGUFFile | None = None
        self._probe: _Probe | None = None
        self._files: dict[Path, GGUFFile] = {}  # kept open: opening a GGUF parses its header (tens of ms)

    def answer(self, message: m.Message) -> m.Message:
        """The answer to one challenge (parsed with ``CHALLENGES``), or ProofError."""
        if isinstance(message, m.Prove):
            return self._prove(message)
        if isinstance(message, m.ProbeRun):
            probe = self._need_probe()
            first = decode_array(message.hidden, probe.n_embd, 1)
            probe.outputs[message.run] = probe.run(first)
            return m.ProbeDone(run=message.run, digest=outputs_digest(probe.outputs[message.run]))
        if isinstance(message, m.ProbeReveal):
            outputs = self._need_probe().outputs.get(message.run)
            if outputs is None:
                raise ProofError("no such probe run")
            self.close()
            return m.ProbeOutputs(outputs=encode_array(outputs))
        raise ProofError(f"unknown challenge {type(message).__name__}")

    def _prove(self, message: m.Prove) -> m.Proof:
        if message.probe is not None:
            self.close()
        # (else a probe under way stays: the host may check a trunk's experts, which has no probe,
        # while it times the same trunk on its trial layers; dropping the probe failed the trial)
        try:
            nonce = bytes.fromhex(message.nonce)
        except ValueError:
            raise ProofError("the nonce is not hex") from None
        windows = check_windows(message.windows)
        probe = message.probe
        layers = {w[0] for w in windows} | ({probe.layer} if probe is not None else set())
        experts = (message.experts[0], message.experts[1]) if len(message.experts) == 2 else None
        if experts is not None and probe is not None:
            raise ProofError("an expert node's check has no speed probe")
        self._gguf = self._open_holding(sorted(layers), experts)
        for layer, offset, length in windows:
            if offset + length > layer_size(self._gguf, layer, experts):
                raise ProofError(f"window [{layer}, {offset}, {length}] runs past the layer's bytes")
        digest = window_digest(self._gguf, nonce, windows, experts)
        if probe is not None:
            self._probe = _Probe(self._gguf, probe.layer, probe.steps, self.n_threads)
        return m.Proof(digest=digest)

    def _open_holding(self, layers: list[int], experts: Experts = None) -> GGUFFile:
        sources = [Path(p) for p in self.sources()]
        for path in [p for p in self._files if p not in sources]:
            self._files.pop(path).close()
        for path in sources:
            gguf = self._files.get(path)
            if gguf is None:
                try:
                    gguf = self._files[path] = GGUFFile(path)
                except Exception:  # noqa: BLE001 - a file that cannot be read holds nothing
                    continue
            if holds(gguf, layers, experts):
                return gguf
        raise ProofError(f"this trunk does not hold layers {layers[0]}..{layers[-1]}", missing=True)

    def _need_probe(self) -> _Probe:
        if self._probe is None:
            raise ProofError("no probe prepared (send 'prove' with a probe first)", missing=True)
        return self._probe

    def close(self, files: bool = False) -> None:
        """End the probe session; with ``files``, close the maps too (at shutdown)."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        self._gguf = None
        if files:
            for gguf in self._files.values():
                gguf.close()
            self._files.clear()


# --- the host's side ---

@dataclass
class Outcome:
    """What a challenge showed. ``problem``: the trunk failed (a wrong answer, or none in time);
    ``missing``: it said it does not hold the layers (not a lie by itself: at registration, a
    trunk that fetches slices holds none yet)."""

    problem: str = ""
    missing: str = ""
    timed_out: bool = False
    ms_per_layer: float | None = None  # from the speed probe, when there was one and it passed
    layer: int | None = None
    steps: int = 0
    runs_ms: list[float] = field(default_factory=list)
    rtt_ms: float | None = None
    proof_ms: float = 0.0  # the layer check's round trip, as the host saw it
    bytes_read: int = 0  # of layer data, on each side

    @property
    def ok(self) -> bool:
        return not self.problem and not self.missing


async def challenge(conn, gguf: GGUFFile, layers: Sequence[int], *, probe_layer: int | None = None,
                    claimed_ms: float | None = None, timeout: float | None = None,
                    timing_lock: asyncio.Lock | None = None, experts: Experts = None) -> Outcome:
    """Check that the trunk at ``conn`` holds ``layers`` and, with ``probe_layer``, time it on that
    layer. ``timing_lock`` keeps the host's probes one at a time (trunks that share a machine
    would otherwise slow each other's runs, and the host's own check of the outputs with them)."""
    from net.wire import WireError

    timeout = TIMEOUT_S if timeout is None else timeout
    outcome = Outcome(layer=probe_layer)

    async def ask(message: m.Message, expect: type[M]) -> M:
        try:
            return m.decode((await conn.request(m.encode(message), timeout=timeout)).body, expect)
        except m.Refused as e:
            raise ProofError(e.error.message[:200], missing=e.error.missing) from None
        except WireError as e:
            raise ProofError(str(e)[:200]) from None

    nonce = secrets.token_bytes(16)
    windows = new_windows(gguf, list(layers), experts=experts)
    outcome.bytes_read = sum(w[2] for w in windows)
    want = await asyncio.to_thread(window_digest, gguf, nonce, windows, experts)
    spec = ModelSpec.from_gguf(gguf)
    n_embd = spec.n_embd
    probe = None
    if probe_layer is not None:
        outcome.steps = min(steps_for(claimed_ms, n_embd), spec.n_ctx_train)
        probe = m.ProbeSpec(layer=probe_layer, steps=outcome.steps)
    try:
        t0 = clock.now()
        reply = await ask(m.Prove(nonce=nonce.hex(), windows=windows, probe=probe, experts=list(experts or ())),
                          m.Proof)
        outcome.proof_ms = (clock.now() - t0) * 1e3
        if reply.digest != want:
            outcome.problem = "failed the layer check: its bytes at random offsets are not the model's"
            return outcome
        if probe_layer is None:
            return outcome
        async with timing_lock or asyncio.Lock():
            pings = []
            for _ in range(3):
                t0 = clock.now()
                await asyncio.wait_for(conn.ping(), timeout)
                pings.append((clock.now() - t0) * 1e3)
            outcome.rtt_ms = min(pings)
            rng = np.random.default_rng()
            firsts, digests = [], []
            for run in range(PROBE_RUNS):
                first = rng.standard_normal((1, n_embd), dtype=np.float32)
                t0 = clock.now()
                done = await ask(m.ProbeRun(run=run, hidden=encode_array(first)), m.ProbeDone)
                outcome.runs_ms.append((clock.now() - t0) * 1e3)
                firsts.append(first)
                digests.append(done.digest)
            best = int(np.argmin(outcome.runs_ms))
            revealed = await ask(m.ProbeReveal(run=best), m.ProbeOutputs)
            outputs = decode_array(revealed.outputs, n_embd, outcome.steps)
            if outputs.shape[0] != outcome.steps or outputs_digest(outputs) != digests[best]:
                outcome.problem = "failed the speed probe: the outputs it showed are not the ones it timed"
                return outcome
            expected = await asyncio.to_thread(expected_outputs, gguf, probe_layer,
                                               chain_inputs(firsts[best], outputs))
        wrong = check_outputs(firsts[best], outputs, expected)
        if wrong:
            outcome.problem = f"failed the speed probe on layer {probe_layer}: {wrong}"
            return outcome
        outcome.ms_per_layer = max(outcome.runs_ms[best] - outcome.rtt_ms, 0.0) / outcome.steps
    except ProofError as e:
        if e.missing:
            outcome.missing = str(e)
        else:
            outcome.problem = f"failed the layer check: {e}"
    except (asyncio.TimeoutError, TimeoutError):
        outcome.problem = f"failed the layer check: no answer within {timeout:g} s"
        outcome.timed_out = True
    except (ConnectionError, WireError, ValueError, KeyError, TypeError) as e:  # a closed link, a malformed answer
        outcome.problem = f"failed the layer check: {type(e).__name__}: {e}"[:300]
        outcome.timed_out = isinstance(e, ConnectionError)
    return outcome
