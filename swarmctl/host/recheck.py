"""The host's own re-check of a stage's results, on the path askers' steps take.

When an asker's re-check stage by stage names a stage (``bad_result``, attributed; the evidence
rule is in reports.py), the host does not take its word: it checks the stage itself, the way the
asker did. It draws ``RECHECK_TOKENS`` random token ids, runs them through the embedding and
layers [0, start) on its own copy of the model (the stage's input as a real request would bring
it), sends those activations to the stage as a request of its own that comes back from that stage
alone (ONE_STAGE, exactly the step an asker's re-check sends, on the stage's connection to the
host), and compares the rows with its own run of layers [start, stop) by the askers' rule
(swarmctl/asker/verify.py ``judge``: relative error <= 0.10, cosine >= 0.995). The layer checks of
layer_proof.py run on a trunk's proof path; this one runs on its serving path, where a trunk that
alters what it sends on does so (tests/test_verify_route.py: a trunk with SWARMCTL_TEST_CORRUPT
passes the layer proofs and fails this).

Only rows that come back wrong fail the check. No answer in time, a refusal (a stale plan, a
stage loading other layers, over budget) or a connection gone is "could not check": nothing
happens to the member. So a trunk can still dodge: it sees the request comes from the host (the
certificate) and may compute that one honestly or refuse it; then it stays in the plan, and the
askers that caught it route around it themselves (verify.py). The host evicts on its own
evidence only; what askers report only tells it where to look.

Cost to the host: ``stop`` layers over ``RECHECK_TOKENS`` tokens on its CPU per check (the
SmolLM2 stage of the tests: well under a second), at most one check at a time and one per member
per ``RECHECK_EVERY_S`` (checks.py).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass

import numpy as np

from kernels.gguf_file import GGUFFile
from kernels.slice import Placement, SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from net.protocol import SwarmProtocol
from net.wire import ActivationPacket, DType, Frame, FrameType, PacketKind, WireError, decode_packet, encode_packet
from plans.plan import Plan, StageAssignment
from swarmctl.asker.verify import Verdict, judge

log = logging.getLogger("swarmctl.host")

RECHECK_TOKENS = 8  # rows of the host's step: a short prompt
ANSWER_TIMEOUT_S = 60.0  # a busy stage may take a while; no answer is "could not check", never a failure


@dataclass(frozen=True)
class StageCheck:
    verdict: Verdict | None  # None: the host could not check (no answer, a refusal, an error on its side)
    why: str  # the verdict described, or why there is none

    @property
    def wrong(self) -> bool:
        return self.verdict is not None and not self.verdict.ok

    @property
    def passed(self) -> bool:
        return self.verdict is not None and self.verdict.ok


class StageAnswers:
    """Answers to the host's own steps: activation frames on streams the host opened on a trunk's
    connection (HostService.frame_received hands them here before anything else)."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[SwarmProtocol, int], asyncio.Future[Frame]] = {}

    def take(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> bool:
        waiter = self._waiting.pop((conn, stream_id), None)
        if waiter is None:
            return False
        if not waiter.done():
            waiter.set_result(frame)
        return True

    async def ask(self, conn: SwarmProtocol, packet: ActivationPacket, timeout: float) -> ActivationPacket:
        """Send one step on a new stream of ``conn`` and wait for the frame that answers it; then
        end the stream (the stage lets go of the request)."""
        stream_id = conn.open_stream()
        waiter = self._waiting[(conn, stream_id)] = asyncio.get_running_loop().create_future()
        try:
            conn.send(stream_id, encode_packet(packet))
            frame = await asyncio.wait_for(waiter, timeout)
        finally:
            self._waiting.pop((conn, stream_id), None)
            try:
                conn.send(stream_id, b"", end=True)
            except ConnectionError:  # (StreamClosedError too) the stage or the connection ended it already
                pass
        if frame.type != FrameType.ACTIVATION:
            raise WireError(f"answered with a {frame.type.name} frame")
        return decode_packet(frame.body)


def reference(gguf: GGUFFile, start: int, stop: int, tokens: list[int],
              kernels: str = "plain", attention: str = "plain") -> tuple[np.ndarray, np.ndarray]:
    """The stage's input for ``tokens`` (embedding and layers [0, start)) and its output (layers
    [start, stop)), on the host's copy of the model with the plan's ``kernels`` and ``attention``,
    as the askers and the stage compute: [n, n_embd] float32 each. Blocking."""
    placement = Placement(kernels=kernels, attention=attention)
    with SliceEngine(gguf, SliceSpec(0, start, has_embedding=True), max_context=256, placement=placement) as head:
        x = np.asarray(head.forward(b"host-recheck", start_pos=0, tokens=tokens), dtype=np.float32)
    with SliceEngine(gguf, SliceSpec(start, stop), max_context=256, placement=placement) as stage:
        want = np.asarray(stage.forward(b"host-recheck", start_pos=0, hidden=x), dtype=np.float32)
    return x, want


async def check_stage(gguf: GGUFFile, answers: StageAnswers, conn: SwarmProtocol, plan: Plan,
                      stage: StageAssignment, *, n_tokens: int = RECHECK_TOKENS,
                      timeout: float = ANSWER_TIMEOUT_S) -> StageCheck:
    """Run the host's step through ``stage`` alone and judge its rows (module docstring)."""
    n_vocab = ModelSpec.from_gguf(gguf).n_vocab
    tokens = [secrets.randbelow(n_vocab) for _ in range(n_tokens)]
    x, want = await asyncio.to_thread(reference, gguf, stage.start, stage.stop, tokens, plan.kernels, plan.attention)
    packet = ActivationPacket(PacketKind.PREFILL, secrets.token_bytes(16), plan.version, stage.start, 0, x,
                              DType.F32, secrets.token_hex(16), one_stage=True)
    try:
        answer = await answers.ask(conn, packet, timeout)
    except (ConnectionError, OSError, WireError) as e:
        return StageCheck(None, f"no answer: {e}")
    except asyncio.TimeoutError:
        return StageCheck(None, f"no answer within {timeout:.0f} s")
    if answer.kind == PacketKind.ERROR:
        return StageCheck(None, f"it refused the step: {answer.message[:200]}")
    if answer.kind != PacketKind.RESULT or answer.request_id != packet.request_id:
        return StageCheck(judge(np.zeros((0, 0)), want), f"answered with a {answer.kind.name} packet")
    verdict = judge(np.asarray(answer.data, dtype=np.float32), want)
    return StageCheck(verdict, verdict.describe())
