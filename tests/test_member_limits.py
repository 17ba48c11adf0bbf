"""A real swarm on loopback (host + 2 trunks, an honest asker, a hostile one): what one member may
hold at a stage is bounded (issue 14, finding 5), and a revoked member loses every connection it
holds, at the host and at every trunk (issue 14, "revocation is complete")."""

from __future__ import annotations

import asyncio
import secrets
import time

import numpy as np
import pytest

from net.endpoint import Address, close, connect_member
from net.identity import is_revocation
from net.protocol import RequestOnlyHandler
from net.wire import ActivationPacket, PacketKind, decode_control, decode_packet, encode_control, encode_packet
from swarmctl.node.home import SwarmHome
from harness.swarm import Swarm, swarmctl

# A small plan, so that the budget is reached in a few requests: the stages reserve KV for 1
# request of 4096 tokens, and a member may hold twice that (8192 positions: 32 caches of 256 cells).
PLAN = ("--concurrent", "1", "--context", "4096")
ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "12")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    with Swarm.two_trunks(tmp_path_factory.mktemp("limits"), askers=("alice", "eve", "mallory"), init=PLAN) as s:
        yield s


async def _plan(swarm: Swarm, creds) -> dict:
    conn = await connect_member(Address("127.0.0.1", swarm.host_port), creds, "host", RequestOnlyHandler())
    try:
        return decode_control((await conn.request(encode_control({"type": "get_plan"}))).body)["plan"]
    finally:
        await close(conn)


class _Collect(RequestOnlyHandler):
    def __init__(self) -> None:
        self.packets: list[ActivationPacket] = []

    def frame_received(self, conn, stream_id, frame) -> None:
        self.packets.append(decode_packet(frame.body))


async def _keep_alive(conn) -> None:
    """Pings: a connection left silent closes after QUIC's idle timeout (8 s), which a busy
    machine can reach while it computes."""
    while conn.is_open:
        try:
            await asyncio.wait_for(conn.ping(), 1)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.5)


def _settled(swarm: Swarm, member: str, condition, within_s: float = 20.0) -> dict:
    deadline = time.monotonic() + within_s
    while True:
        stats = swarm.stats_of(member, via="alice")
        if condition(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_a_member_cannot_fill_a_stage_with_kv_caches(swarm):
    """Prefills with fresh request ids, many more than the plan reserves, from one member: the
    stage holds that member's budget and refuses the rest with a clear error; another member's
    ask still runs, the member's own `ask` is refused with the reason; the caches go when the
    member's connections do."""
    eve = SwarmHome(swarm.homes["eve"]).credentials()
    plan = asyncio.run(_plan(swarm, eve))
    first, second = plan["stages"][0], plan["stages"][1]
    n_attack = 48
    idle = swarm.stats_of(first["member"], via="alice")
    limits = idle["budget"]["limits"]
    per_request = 256 * 768 * (first["stop"] - first["start"])  # one 256-cell cache at the first stage
    assert limits["member_kv_bytes"] == 2 * 4096 * 768 * (first["stop"] - first["start"])  # from the plan

    async def attack() -> tuple[list[ActivationPacket], list[ActivationPacket], dict, dict, object]:
        errors, results = _Collect(), _Collect()
        conn = await connect_member(Address.parse(first["address"]), eve, first["member"], errors)
        last = await connect_member(Address.parse(second["address"]), eve, second["member"], results)
        keep_alive = [asyncio.ensure_future(_keep_alive(c)) for c in (conn, last)]
        try:  # (subscribed like a real asker: the requests that run stay held at both stages)
            await last.request(encode_control({"type": "subscribe", "session": "e0e0"}), timeout=10)
            x = np.random.default_rng(0).standard_normal((2, 576)).astype(np.float32)
            for _ in range(n_attack):
                packet = ActivationPacket(PacketKind.PREFILL, secrets.token_bytes(16), plan["version"],
                                          first["start"], 0, x, reply_to="e0e0")
                stream = conn.open_stream()
                conn.send(stream, encode_packet(packet))
            await conn.drain(stream, 0)
            deadline = asyncio.get_running_loop().time() + 60
            while len(errors.packets) + len(results.packets) < n_attack \
                    and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)  # every prefill is answered: refused, or its result
            held = await asyncio.to_thread(swarm.stats_of, first["member"], "alice")
            later = await asyncio.to_thread(swarm.stats_of, second["member"], "alice")
            r = await asyncio.to_thread(swarmctl, swarm.homes["alice"], *ASK, "The capital of France is")
            assert r.returncode == 0 and r.stdout.strip(), r.stderr  # another member is not starved
            # Eve's own `ask` (another process, the same member) is over her budget: a clear error,
            # at once rather than after retries.
            mine = await asyncio.to_thread(swarmctl, swarm.homes["eve"], *ASK, "The capital of France is")
            return errors.packets, results.packets, held, later, mine
        finally:
            for task in keep_alive:
                task.cancel()
            await close(conn)
            await close(last)

    answers, ran, held, later, mine = asyncio.run(attack())
    assert len(answers) + len(ran) == n_attack and all(p.kind == PacketKind.RESULT for p in ran)
    over = [p.message for p in answers if "over budget" in p.message]
    assert over and all(not p.retry for p in answers if "over budget" in p.message)
    assert f"over budget at {first['member']}: member 'eve' would hold" in over[0] and "over its limit of" in over[0]
    eve_held = held["budget"]["members"]["eve"]
    assert eve_held["kv_bytes"] <= limits["member_kv_bytes"]
    # Refusals other than the budget's: only a stage's "cannot reach the next stage" (a handshake
    # that timed out on a loaded box, seen once in CI), a retryable one for a request that was
    # admitted, and so still held here until the sender retries or leaves.
    others = [p for p in answers if "over budget" not in p.message]
    passed_on_failed = [p for p in others if p.retry and "cannot reach the next stage" in p.message]
    assert len(passed_on_failed) == len(others), [p.message for p in others]
    assert eve_held["requests"] == limits["member_kv_bytes"] // per_request == len(ran) + len(passed_on_failed) \
        == n_attack - len(over)
    assert held["kv_bytes"] == held["budget"]["charged_kv_bytes"]  # the books match the engine's own figure
    # The next stage charges the same member (carried in reply_to), not the stage that forwarded it.
    assert set(later["budget"]["members"]) <= {"eve", "alice"} and "trunk-a" not in later["budget"]["members"]
    assert later["budget"]["members"]["eve"]["requests"] == len(ran)
    print(f"eve's ask: {mine.stderr.strip()}")
    assert mine.returncode != 0 and mine.stdout == ""
    assert f"the swarm refused the request: over budget at {first['member']}: member 'eve'" in mine.stderr, mine.stderr
    # One line of error. Before it, at most the warnings of a connection that timed out and was tried
    # again: on a loaded box (two test workers on two cores) the busy first stage's handshake once
    # did; the refusal itself is never retried.
    *before, error_line = mine.stderr.strip().splitlines()
    assert error_line.startswith("swarmctl: error: the swarm refused the request: over budget"), mine.stderr
    assert all("cannot reach" in line and line.endswith("trying again") for line in before), mine.stderr
    # Eve's connections closed: what she held goes, at both stages (and Alice's ask ended: hers too).
    for stage in (first, second):
        stats = _settled(swarm, stage["member"], lambda s: not s["budget"]["members"] and not s["kv_bytes"])
        assert stats["budget"]["members"] == {} and stats["budget"]["charged_kv_bytes"] == 0, stats["budget"]
        assert stats["kv_bytes"] == 0 and stats["requests"] == 0


def test_revocation_closes_every_connection_at_the_host_and_every_trunk(swarm):
    """Three connections per node, each kept busy, every one closed *by the revocation* (its close
    reason says so: not idle, not by the test), at the host and at every trunk."""
    mallory = SwarmHome(swarm.homes["mallory"]).credentials()
    plan = asyncio.run(_plan(swarm, mallory))
    targets = [(Address("127.0.0.1", swarm.host_port), "host", {"type": "status"})] + \
        [(Address.parse(s["address"]), s["member"], {"type": "stats"}) for s in plan["stages"]]

    async def scenario() -> tuple[list[str], float, list[str]]:
        conns = []
        for address, peer, question in targets:
            for _ in range(3):  # several connections per identity at every node
                conn = await connect_member(address, mallory, peer, RequestOnlyHandler())
                await conn.request(encode_control(question), timeout=10)
                conns.append((peer, conn))
        assert all(c.is_open for _, c in conns)
        r = await asyncio.to_thread(swarmctl, swarm.host_home, "revoke", "mallory")
        assert r.returncode == 0 and "revoked mallory" in r.stdout, r.stderr
        keep_alive = [asyncio.ensure_future(_keep_alive(c)) for _, c in conns]  # none may end by going idle
        t0 = time.monotonic()
        deadline = t0 + 10
        while any(c.is_open for _, c in conns) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - t0
        for task in keep_alive:
            task.cancel()
        still_open = [f"{peer} ({c.close_reason or 'open'})" for peer, c in conns
                      if c.is_open or not is_revocation(c.close_reason)]
        for _, c in conns:
            await close(c)
        refused = []  # and no new connection gets anywhere
        for address, peer, question in targets:
            try:
                conn = await connect_member(address, mallory, peer, RequestOnlyHandler())
            except ConnectionError as e:
                refused.append(str(e))
                continue
            try:
                await conn.request(encode_control(question), timeout=3)
                refused.append("ANSWERED")
            except (ConnectionError, asyncio.TimeoutError) as e:
                refused.append(str(e))
            finally:
                await close(conn)
        return still_open, elapsed, refused

    still_open, elapsed, refused = asyncio.run(scenario())
    print(f"{3 * len(targets) - len(still_open)} of {3 * len(targets)} connections of the revoked member closed "
          f"by the revocation, the last {elapsed:.2f} s after `revoke` returned")
    assert still_open == [], f"not closed by the revocation ({elapsed:.1f} s after it): {still_open}"
    assert len(refused) == len(targets) and "ANSWERED" not in refused, refused


def test_the_names_of_one_invite_share_one_budget(swarm):
    """Issue 30 item 5: one invite issued with --uses 3 gave three names, each with its own KV
    budget (830 MB at one trunk). Every name of an invite spends the budget of the first that
    joined with it, at every stage."""
    code = swarm.invite("--role", "asker", "--uses", "3")
    names = ("ivy", "ivy-2", "ivy-3")
    for name in names:
        home = swarm.root / name
        swarmctl(home, "join", code, "--name", name, check=True)
        swarm.homes[name] = home
    plan = asyncio.run(_plan(swarm, SwarmHome(swarm.homes["ivy"]).credentials()))
    assert plan["accounts"] == {"ivy-2": "ivy", "ivy-3": "ivy"}
    first, second = plan["stages"][0], plan["stages"][1]
    limits = swarm.stats_of(first["member"], via="alice")["budget"]["limits"]
    per_request = 256 * 768 * (first["stop"] - first["start"])
    each = 16  # three names × 16 one-cache prefills: 48, over the 32 caches one budget allows

    async def attack() -> tuple[int, int, dict]:
        answers = _Collect()
        conns = []
        try:
            for i, name in enumerate(names):
                creds = SwarmHome(swarm.homes[name]).credentials()
                conn = await connect_member(Address.parse(first["address"]), creds, first["member"], answers)
                last = await connect_member(Address.parse(second["address"]), creds, second["member"], answers)
                conns += [conn, last]
                await last.request(encode_control({"type": "subscribe", "session": f"{i}0{i}0"}), timeout=10)
                x = np.random.default_rng(i).standard_normal((2, 576)).astype(np.float32)
                for _ in range(each):
                    stream = conn.open_stream()
                    conn.send(stream, encode_packet(ActivationPacket(PacketKind.PREFILL, secrets.token_bytes(16),
                                                                     plan["version"], first["start"], 0, x,
                                                                     reply_to=f"{i}0{i}0")))
            keep_alive = [asyncio.ensure_future(_keep_alive(c)) for c in conns]
            deadline = asyncio.get_running_loop().time() + 60
            while len(answers.packets) < len(names) * each and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
            held = await asyncio.to_thread(swarm.stats_of, first["member"], "alice")
            for task in keep_alive:
                task.cancel()
            ran = sum(p.kind == PacketKind.RESULT for p in answers.packets)
            refused = sum("over budget" in p.message for p in answers.packets if p.kind != PacketKind.RESULT)
            return ran, refused, held
        finally:
            for conn in conns:
                await close(conn)

    ran, refused, held = asyncio.run(attack())
    members = held["budget"]["members"]
    assert set(members) <= {"ivy", "alice"} and members["ivy"]["kv_bytes"] <= limits["member_kv_bytes"], members
    assert ran == members["ivy"]["requests"] == limits["member_kv_bytes"] // per_request < len(names) * each
    assert refused == len(names) * each - ran
