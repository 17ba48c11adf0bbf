"""One member cannot starve the others (issue 30 item 1). An asker held 128 requests open at the
first stage (its budget allowed it); stage-to-stage traffic of every member rides one QUIC
connection, and aioquic let a peer hold 128 streams, so the 128 filled it: another member's `ask`
got no answer in 100 s. Now a swarm connection carries MAX_STREAMS streams, a member holds at most
an eighth of them at a stage, and a stage's batches take members by turns."""

from __future__ import annotations

import asyncio
import secrets
import time

import numpy as np
import pytest

from kernels.slice import Step
from net.endpoint import Address, close, connect_member
from net.protocol import RequestOnlyHandler
from net.tls import MAX_STREAMS
from net.wire import ActivationPacket, PacketKind, decode_control, decode_packet, encode_control, encode_packet
from swarmctl.batching import _Pending, fair_batch
from swarmctl.budget import MEMBER_SHARE_OF_STREAMS, Limits
from swarmctl.home import SwarmHome
from harness.swarm import Swarm, swarmctl

ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "4")
PROMPT = "The capital of France is"


def _pending(member: str, n_tokens: int) -> _Pending:
    step = Step(secrets.token_bytes(16), 0, hidden=np.zeros((n_tokens, 4), np.float32))
    return _Pending(step, n_tokens, None, member)  # (fair_batch never looks at the future)


def _batches_until(pending: list[_Pending], wanted: _Pending, max_tokens: int = 1024) -> int:
    """Drain ``pending`` batch by batch as BatchRunner does; in which batch ``wanted`` runs."""
    last_turn: dict[str, int] = {}
    for n in range(1, len(pending) + 1):
        batch = fair_batch(pending, max_tokens, last_turn)
        for p in batch:
            pending.remove(p)
            last_turn[p.member] = n
        if wanted in batch:
            return n
    raise AssertionError("never ran")


def test_a_member_with_a_long_queue_delays_another_by_one_batch_at_most():
    eve = [_pending("eve", 1024) for _ in range(10)]  # ten full prefills queued first
    alice = _pending("alice", 1)
    assert _batches_until([*eve, alice], alice) == 2  # (first come, first served: batch 11)
    # within one member, its own steps keep their order, and a request's steps never share a batch
    mine = [_pending("bob", 1) for _ in range(3)]
    twice = _pending("bob", 1)
    twice.step = mine[0].step
    batch = fair_batch([*mine, twice], 1024, {})
    assert batch == mine


def test_a_members_share_of_a_stage_is_well_below_what_a_connection_carries():
    limits = Limits.derive(kv_bytes_per_position=1, smallest_cache_bytes=1, context_tokens=4096, concurrent=64)
    assert limits.member_requests == MAX_STREAMS // MEMBER_SHARE_OF_STREAMS <= MAX_STREAMS // 8


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with Swarm.two_trunks(tmp_path_factory.mktemp("fair"), askers=("alice", "eve")) as s:
        yield s


class _Count(RequestOnlyHandler):
    def __init__(self) -> None:
        self.results = self.errors = 0

    def frame_received(self, conn, stream_id, frame) -> None:
        packet = decode_packet(frame.body)
        if packet.kind == PacketKind.RESULT:
            self.results += 1
        else:
            self.errors += 1


def _timed_ask(swarm: Swarm) -> tuple[float, str]:
    t0 = time.monotonic()
    r = swarmctl(swarm.homes["alice"], *ASK, PROMPT, timeout=240)
    assert r.returncode == 0, r.stderr
    return time.monotonic() - t0, r.stdout


def test_one_asker_holding_its_maximum_does_not_starve_another(swarm):
    idle_s, idle_answer = _timed_ask(swarm)
    eve = SwarmHome(swarm.homes["eve"]).credentials()

    async def attack() -> tuple[int, dict, float, str]:
        host = await connect_member(Address("127.0.0.1", swarm.host_port), eve, "host", RequestOnlyHandler())
        plan = decode_control((await host.request(encode_control({"type": "get_plan"}))).body)["plan"]
        await close(host)
        first, last = plan["stages"][0], plan["stages"][-1]
        counts = _Count()
        conn = await connect_member(Address.parse(first["address"]), eve, first["member"], counts)
        results = await connect_member(Address.parse(last["address"]), eve, last["member"], counts)
        try:  # subscribed like a real asker: requests that ran stay held (and their streams open) at both stages
            await results.request(encode_control({"type": "subscribe", "session": "e0e0"}), timeout=10)
            stats = await asyncio.to_thread(swarm.stats_of, first["member"], "alice")
            limit = stats["budget"]["limits"]["member_requests"]
            x = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)
            for _ in range(limit):
                stream = conn.open_stream()
                conn.send(stream, encode_packet(ActivationPacket(PacketKind.PREFILL, secrets.token_bytes(16),
                                                                 plan["version"], first["start"], 0, x,
                                                                 reply_to="e0e0")))
            deadline = time.monotonic() + 120
            while counts.results + counts.errors < limit and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            held = await asyncio.to_thread(swarm.stats_of, last["member"], "alice")
            attacked_s, answer = await asyncio.to_thread(_timed_ask, swarm)
            return counts.results, held, attacked_s, answer
        finally:
            await close(conn)
            await close(results)

    held_results, held, attacked_s, answer = asyncio.run(attack())
    print(f"alice's 4-token ask: {idle_s:.2f} s on the idle swarm, {attacked_s:.2f} s while eve held "
          f"{held['budget']['members'].get('eve', {}).get('requests')} requests at the last stage")
    assert held_results >= 128  # eve really holds what filled the path before (aioquic's 128 streams)
    assert held["budget"]["members"]["eve"]["requests"] >= 128
    assert answer == idle_answer
    # Before, the held requests filled the path between the stages: alice's step waited for a
    # stream there until it was sent again (7.2 s against 1.8 s idle, measured; the issue's own
    # attack kept it waiting 100 s). A liveness bound, not a speed target: seconds of margin.
    assert attacked_s < idle_s + 4.0, (idle_s, attacked_s)
