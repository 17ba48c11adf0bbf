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
from swarmctl.asker.head_tail import PREFILL_CHUNK
from swarmctl.batching import SPLIT_ROWS, FairShare, _Pending, fair_batch
from swarmctl.trunk.budget import MEMBER_SHARE_OF_STREAMS, Limits
from swarmctl.node.home import SwarmHome
from harness.swarm import Swarm, swarmctl

ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "4")
PROMPT = "The capital of France is"


def _pending(member: str, n_tokens: int, split: bool = False) -> _Pending:
    step = Step(secrets.token_bytes(16), 0, hidden=np.zeros((n_tokens, 4), np.float32))
    return _Pending(step, n_tokens, None, member, split=split)  # (fair_batch never looks at the future)


def _run_batches(pending: list[_Pending], share: FairShare, until: _Pending, max_tokens: int = 1024,
                 rows: list[int] | None = None) -> int:
    """Drain ``pending`` batch by batch as BatchRunner does, until ``until`` has run all its rows;
    in which batch that happened. ``rows``: each batch's rows are appended to it."""
    for n in range(1, 10_000):
        batch = fair_batch(pending, max_tokens, share)
        assert batch, "nothing could run"
        for p, k in batch:
            p.done += k
            if p.rows_left == 0:
                pending.remove(p)
        if rows is not None:
            rows.append(sum(k for _, k in batch))
        if until.rows_left == 0:
            return n
    raise AssertionError("never ran")


def _batches_until(pending: list[_Pending], wanted: _Pending, max_tokens: int = 1024) -> int:
    return _run_batches(pending, FairShare(), wanted, max_tokens)


def test_a_member_with_a_long_queue_delays_another_by_one_batch_at_most():
    eve = [_pending("eve", 1024) for _ in range(10)]  # ten full prefills queued first
    alice = _pending("alice", 1)
    assert _batches_until([*eve, alice], alice) == 2  # (first come, first served: batch 11)
    # within one member, its own steps keep their order, and a request's steps never share a batch
    mine = [_pending("bob", 1) for _ in range(3)]
    twice = _pending("bob", 1)
    twice.step = mine[0].step
    batch = fair_batch([*mine, twice], 1024, FairShare())
    assert [p for p, _ in batch] == mine


def _small_ask_behind_huge_prefills(split: bool, steps: int = 5) -> tuple[int, int]:
    """Eve keeps 32 prefills of 4096 rows queued; alice runs ``steps`` one-row steps, each sent
    when the one before has run (an ask: its prompt, then a token at a time), and arriving while
    a batch of eve's runs. The rows the stage computes from alice's first step's arrival until her
    last has run, and the most rows in one batch she waited for."""
    pending = [_pending("eve", 4096, split) for _ in range(32)]
    share, computed, worst = FairShare(), 0, 0
    for _ in range(steps):
        batch = fair_batch(pending, 1024, share)  # the batch running when alice's step comes
        for p, k in batch:
            p.done += k
            if p.rows_left == 0:
                pending.remove(p)
        alice = _pending("alice", 1)
        pending.append(alice)
        rows = [sum(k for _, k in batch)]
        _run_batches(pending, share, alice, rows=rows)
        computed += sum(rows)
        worst = max(worst, *rows)
    return computed, worst


def test_a_huge_prefill_runs_in_chunks_and_a_small_ask_waits_little():
    """Issue 43: one member's 4096-row prefills, sent straight to the last stage, kept another's
    4-token ask there for 52 s instead of 2.2: turns were fair by steps, and each of eve's steps
    was 4096 rows, so each of alice's waited out a whole one. A step over SPLIT_ROWS now runs in
    chunks, other members' steps between them, and one member's rows in a batch are at most
    SPLIT_ROWS (an equal share while others wait)."""
    before, before_worst = _small_ask_behind_huge_prefills(split=False)  # (as it ran before: whole steps)
    after, after_worst = _small_ask_behind_huge_prefills(split=True)
    print(f"alice's 5 one-row steps behind eve's 4096-row prefills: {before} rows computed meanwhile, "
          f"batches of up to {before_worst}; in chunks: {after} rows, batches of up to {after_worst}")
    assert before_worst == 4096 and after_worst <= SPLIT_ROWS + 1
    # each of alice's steps: the batch running when it came (eve's chunk), then hers (1 row and eve's share)
    assert after <= 5 * (SPLIT_ROWS + 1 + SPLIT_ROWS) < before // 3


def test_rows_are_shared_not_just_turns():
    """Fair by rows: bob's 512-row prompt chunks get as many rows as eve's 4096-row prefills (by
    turns alone he got an eighth: one 512 for each 4096 of hers)."""
    for split in (False, True):
        eve = [_pending("eve", 4096, split) for _ in range(40)]
        bob = [_pending("bob", 512) for _ in range(80)]
        pending = [*eve, *bob]
        share = FairShare()
        served = {"eve": 0, "bob": 0}
        for _ in range(40):
            for p, k in fair_batch(pending, 1024, share):
                p.done += k
                served[p.member] += k
                if p.rows_left == 0:
                    pending.remove(p)
        print(f"{'in chunks' if split else 'whole'}: {served}")
    assert abs(served["bob"] - served["eve"]) <= SPLIT_ROWS, served


def test_a_split_step_keeps_its_order_its_chunks_and_only_joinable_steps_split():
    huge = _pending("eve", 1300, split=True)
    huge.step = Step(huge.step.request_id, 7, hidden=np.arange(1300 * 4, dtype=np.float32).reshape(1300, 4),
                     rewind=True)
    share, rows = FairShare(), []
    pending = [huge]
    chunks = []
    while pending:
        batch = fair_batch(pending, 1024, share)
        assert len(batch) == 1  # (one step per request per batch)
        p, k = batch[0]
        chunks.append(p.chunk(k))
        p.done += k
        if p.rows_left == 0:
            pending.remove(p)
    assert [c.start_pos for c in chunks] == [7, 7 + SPLIT_ROWS, 7 + 2 * SPLIT_ROWS]
    assert [c.rewind for c in chunks] == [True, False, False]
    np.testing.assert_array_equal(np.concatenate([c.hidden for c in chunks]), huge.step.hidden)
    # a step that cannot be split (logits of its last row, say) still runs whole, alone
    whole = _pending("eve", 1300)
    assert fair_batch([whole, _pending("alice", 1)], 1024, FairShare()) == [(whole, 1300)]
    assert SPLIT_ROWS == PREFILL_CHUNK  # an attacker's huge step costs others what an honest prompt chunk does
    # a member alone still fills a batch with its (small) steps, as before: decode throughput
    assert sum(k for _, k in fair_batch([_pending("bob", 8) for _ in range(100)], 1024, FairShare())) == 800


@pytest.mark.slow  # the bundled model, chunked and whole: 3.5 s
def test_the_runner_joins_a_split_steps_chunks_into_its_own_output(bundled_model):
    """A trunk slice fed a prefill larger than a batch runs it in chunks, another member's step in
    between, and returns the rows it returns for the prefill run whole."""
    from kernels.slice import SliceEngine
    from kernels.spec import SliceSpec
    from swarmctl.batching import BatchRunner
    from tests.conftest import N_THREADS

    x = np.random.default_rng(3).standard_normal((1300, 576)).astype(np.float32)
    small = np.random.default_rng(4).standard_normal((1, 576)).astype(np.float32)
    with SliceEngine.open(bundled_model, SliceSpec(26, 30), n_threads=N_THREADS) as engine:
        whole = engine.forward(b"w" * 16, start_pos=0, hidden=x)
        alone = engine.forward(b"s" * 16, start_pos=0, hidden=small)
        engine.release(b"w" * 16)
        engine.release(b"s" * 16)
        runner = BatchRunner(engine)

        async def both():
            big = asyncio.ensure_future(runner.run(Step(b"w" * 16, 0, hidden=x), member="eve"))
            await asyncio.sleep(0)  # (eve's step is first in the queue)
            return await asyncio.gather(big, runner.run(Step(b"s" * 16, 0, hidden=small), member="alice"))

        (got, timing), (got_small, small_timing) = asyncio.run(both())
        batches = [r.request_ids for r in runner.stats.recent]
    assert [b"s" * 16 in ids for ids in batches] == [False, True, False]  # chunk, alice + chunk, chunk
    assert got.shape == whole.shape and timing.compute_s > 0
    np.testing.assert_array_equal(got, whole)  # (quantized weights: the same bits in chunks as whole)
    np.testing.assert_array_equal(got_small, alone)


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
