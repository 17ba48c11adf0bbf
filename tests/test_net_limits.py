"""What a peer can make a node hold, and what hostile bytes get: real QUIC on loopback between a
server and clients made here (no swarm processes needed)."""

from __future__ import annotations

import asyncio
import json

import pytest

from net.endpoint import Address, _connect, close, close_all, connect_member, serve_member
from net.identity import Credentials, IdentityError, check_name, make_ca, new_private_key, sign_member
from net.protocol import ANONYMOUS_BUFFER_BUDGET, ANONYMOUS_MAX_FRAME, RequestOnlyHandler, SwarmProtocol
from net.tls import join_configuration
from net.wire import FRAME_HEADER, Frame, FrameType, WireError, decode_control, encode_control


class Recorder(RequestOnlyHandler):
    """A server handler that answers every control frame with 'ok' and remembers connections."""

    def __init__(self) -> None:
        self.conns: list[SwarmProtocol] = []
        self.frames = 0

    def connection_made(self, conn: SwarmProtocol) -> None:
        self.conns.append(conn)

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        self.frames += 1
        try:
            decode_control(frame.body)
            conn.send(stream_id, encode_control({"type": "ok"}), end=True)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))


def _member(name, ca_key, ca_cert) -> Credentials:
    key = new_private_key()
    return Credentials(key, sign_member(ca_key, ca_cert, key.public_key(), name), ca_cert)


async def _server(accept_joins: bool = True):
    ca_key, ca_cert = make_ca("limits")
    host = _member("host", ca_key, ca_cert)
    handler = Recorder()
    server = await serve_member(Address("127.0.0.1", 0), host, handler, client_check=lambda cert: None,
                                accept_joins=accept_joins)
    port = server._transport.get_extra_info("sockname")[1]
    return server, Address("127.0.0.1", port), handler, (ca_key, ca_cert)


def test_an_anonymous_peer_cannot_make_the_host_buffer_a_large_frame():
    async def scenario() -> tuple[str, str, int]:
        server, address, handler, _ = await _server()
        conn = await _connect(address, join_configuration(), RequestOnlyHandler(), 1 << 26)
        try:
            # A frame announced at 56 MB: refused at its header, nothing buffered.
            stream = conn.open_stream()
            conn.send(stream, FRAME_HEADER.pack(56_000_000, FrameType.CONTROL) + b"x" * 4000)
            try:
                await conn.request(b"", timeout=3, stream_id=stream)
                big = "answered"
            except ConnectionError as e:
                big = f"reset: {e}"
            # Many frames just under the anonymous limit, each left unfinished: the budget closes the connection.
            for _ in range(ANONYMOUS_BUFFER_BUDGET // ANONYMOUS_MAX_FRAME + 2):
                conn.send(conn.open_stream(), FRAME_HEADER.pack(ANONYMOUS_MAX_FRAME - 1, FrameType.CONTROL)
                          + b"y" * (ANONYMOUS_MAX_FRAME - 100))
            try:
                await asyncio.wait_for(conn.wait_closed(), 5)
                budget = f"closed: {conn.close_reason}"
            except asyncio.TimeoutError:
                budget = "still open"
            held = sum(d.buffered for c in handler.conns for d in c._decoders.values())
            return big, budget, held
        finally:
            await close(conn)
            server.close()

    big, budget, held = asyncio.run(scenario())
    assert big.startswith("reset"), big
    assert budget.startswith("closed") and "buffered" in budget, budget
    assert held == 0


def test_deeply_nested_json_is_refused_not_raised():
    with pytest.raises(WireError, match="nested too deeply"):
        decode_control(b'{"type": "x", "a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}")

    async def scenario() -> str:
        server, address, handler, _ = await _server()
        conn = await _connect(address, join_configuration(), RequestOnlyHandler(), 1 << 26)
        try:
            body = b"[" * 50_000 + b"]" * 50_000  # under the anonymous frame limit, deep enough to recurse
            try:
                await conn.request(FRAME_HEADER.pack(len(body) + 1, FrameType.CONTROL) + body, timeout=5)
                return "answered"
            except ConnectionError as e:
                return f"reset: {e}"
            except asyncio.TimeoutError:
                return "left hanging"
        finally:
            await close(conn)
            server.close()

    assert asyncio.run(scenario()).startswith("reset")


def test_control_messages_have_a_size_limit():
    from net.wire import MAX_CONTROL_BYTES

    with pytest.raises(WireError, match="over the"):
        decode_control(json.dumps({"type": "x", "pad": "a" * MAX_CONTROL_BYTES}).encode())


def test_a_member_name_cannot_end_in_a_newline():
    assert check_name("t0") == "t0"
    for bad in ("t0\n", "t0\r\n", "T0", "-t0", "a" * 33, ""):
        with pytest.raises(IdentityError):
            check_name(bad)
    ca_key, ca_cert = make_ca("names")
    with pytest.raises(IdentityError):
        sign_member(ca_key, ca_cert, new_private_key().public_key(), "t0\n")


def test_a_closed_connection_lets_go_of_what_it_buffered():
    async def scenario() -> tuple[int, int]:
        server, address, handler, (ca_key, ca_cert) = await _server(accept_joins=False)
        alice = _member("alice", ca_key, ca_cert)
        conn = await connect_member(address, alice, "host", RequestOnlyHandler())
        conn.send(conn.open_stream(), FRAME_HEADER.pack(8_000_000, FrameType.ACTIVATION) + b"z" * 1_000_000)
        await asyncio.sleep(0.5)
        served = handler.conns[0]
        before = sum(d.buffered for d in served._decoders.values())
        await close(conn)
        for _ in range(50):
            if not served.is_open:
                break
            await asyncio.sleep(0.1)
        server.close()
        return before, sum(d.buffered for d in served._decoders.values())

    before, after = asyncio.run(scenario())
    assert before > 500_000  # the partial frame was held while the connection lived
    assert after == 0



def test_a_home_folder_is_made_private_even_if_it_existed_loose(tmp_path):
    import os
    import stat

    from swarmctl.node.home import SwarmHome
    from swarmctl.node.membership import create_swarm

    home = tmp_path / "loose"
    home.mkdir()
    os.chmod(home, 0o777)
    old = os.umask(0)
    try:
        create_swarm(SwarmHome(home), swarm_name="s", host_name="host", listen="127.0.0.1:0",
                     advertise=["127.0.0.1:7470"], model=None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / ".lock").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "ca.key").stat().st_mode) == 0o600


def test_anonymous_connections_are_capped_and_a_member_still_gets_in():
    """Issue 30 item 5: 200 connections without a member's certificate (joiners) added 63 MB to the
    host. A server keeps at most MAX_ANONYMOUS_CONNECTIONS of them (the oldest are closed), and a
    member connecting meanwhile is served."""
    from net.endpoint import MAX_ANONYMOUS_CONNECTIONS

    async def scenario() -> tuple[int, int, str]:
        server, address, handler, (ca_key, ca_cert) = await _server()
        flood = []
        try:
            for _ in range(MAX_ANONYMOUS_CONNECTIONS + 36):
                flood.append(await _connect(address, join_configuration(), RequestOnlyHandler(), 1 << 20))
            for _ in range(50):  # the closes reach the clients (a loaded machine takes its time)
                still_open = sum(c.is_open for c in flood)
                if still_open <= MAX_ANONYMOUS_CONNECTIONS:
                    break
                await asyncio.sleep(0.1)
            member = await connect_member(address, _member("alice", ca_key, ca_cert), "host", RequestOnlyHandler())
            answer = decode_control((await member.request(encode_control({"type": "status"}), timeout=5)).body)
            await close(member)
            held = sum(1 for c in handler.conns if not c.peer_name and c.is_open)
            return still_open, held, answer["type"]
        finally:
            await close_all(flood)
            server.close()

    still_open, held, answer = asyncio.run(scenario())
    assert still_open <= MAX_ANONYMOUS_CONNECTIONS and held <= MAX_ANONYMOUS_CONNECTIONS, (still_open, held)
    assert answer == "ok"


def test_a_members_unfinished_frames_are_bounded_over_all_its_connections(monkeypatch):
    """Issue 30 item 5: two connections of one member with 150 MB of unfinished frames each held
    305 MB. The member's budget covers all its connections to a node (here made 1 MiB, so that the
    test sends little): the connection that takes it over is closed, and the node serves on."""
    import net.protocol

    monkeypatch.setattr(net.protocol, "MEMBER_BUFFER_BUDGET", 1 << 20)

    async def scenario() -> tuple[list[bool], str]:
        server, address, handler, (ca_key, ca_cert) = await _server()
        alice = _member("alice", ca_key, ca_cert)
        conns = [await connect_member(address, alice, "host", RequestOnlyHandler()) for _ in range(2)]
        try:
            for conn in conns:  # 700 KB of a 4 MB frame on each: each alone is under the budget
                stream = conn.open_stream()
                conn.send(stream, FRAME_HEADER.pack(4_000_000, FrameType.CONTROL) + b"x" * 700_000)
                await conn.drain(stream, 0)
                await asyncio.sleep(0.3)
            await asyncio.sleep(0.5)
            bob = await connect_member(address, _member("bob", ca_key, ca_cert), "host", RequestOnlyHandler())
            answer = decode_control((await bob.request(encode_control({"type": "status"}), timeout=5)).body)["type"]
            await close(bob)
            return [c.is_open for c in conns], answer
        finally:
            for conn in conns:
                await close(conn)
            server.close()

    still_open, answer = asyncio.run(scenario())
    assert still_open.count(False) == 1 and answer == "ok", still_open


def test_the_names_of_one_invite_share_one_budget_of_unfinished_frames(monkeypatch):
    """Issue 43: the budget was per name, so the four names of one invite held 960 MB of unfinished
    frames at the host against a 256 MiB budget. A certificate names the invite its holder joined
    with, and every name of that invite spends one budget (here made 1 MiB, so that the test
    sends little); a name of another invite keeps its own."""
    import net.protocol

    monkeypatch.setattr(net.protocol, "MEMBER_BUFFER_BUDGET", 1 << 20)

    def joined(name, ca_key, ca_cert, invite) -> Credentials:
        key = new_private_key()
        return Credentials(key, sign_member(ca_key, ca_cert, key.public_key(), name, role="asker", invite=invite),
                           ca_cert)

    async def scenario() -> tuple[list[bool], bool, str]:
        server, address, handler, (ca_key, ca_cert) = await _server()
        names = [joined(name, ca_key, ca_cert, "0a1b2c3d4e5f6071") for name in ("ivy", "ivy-2")]
        other = joined("olga", ca_key, ca_cert, "99aa88bb77cc66dd")
        conns = [await connect_member(address, creds, "host", RequestOnlyHandler()) for creds in (*names, other)]
        try:
            for conn in conns:  # 700 KB of a 4 MB frame on each: each alone is under the budget
                stream = conn.open_stream()
                conn.send(stream, FRAME_HEADER.pack(4_000_000, FrameType.CONTROL) + b"x" * 700_000)
                await conn.drain(stream, 0)
                await asyncio.sleep(0.3)
            await asyncio.sleep(0.5)
            bob = await connect_member(address, _member("bob", ca_key, ca_cert), "host", RequestOnlyHandler())
            answer = decode_control((await bob.request(encode_control({"type": "status"}), timeout=5)).body)["type"]
            await close(bob)
            return [c.is_open for c in conns[:2]], conns[2].is_open, answer
        finally:
            for conn in conns:
                await close(conn)
            server.close()

    invite_open, other_open, answer = asyncio.run(scenario())
    assert invite_open.count(False) == 1 and other_open and answer == "ok", (invite_open, other_open)


def test_a_certificate_names_its_invite_and_the_account_follows_it(tmp_path):
    from cryptography.hazmat.primitives import serialization

    from net.identity import make_csr, member_account
    from swarmctl.node.home import SwarmHome
    from swarmctl.node.membership import admit, create_swarm, issue_invite

    home = SwarmHome(tmp_path / "host")
    create_swarm(home, swarm_name="s", host_name="host", listen="127.0.0.1:0", advertise=["127.0.0.1:7470"],
                 model=None)
    invite = issue_invite(home, ttl_seconds=60, uses=2, role="asker")
    joined = [admit(home, token_id=invite.token_id, secret=invite.secret, name=name,
                    csr_pem=make_csr(new_private_key(), name).public_bytes(serialization.Encoding.PEM))
              for name in ("ivy", "ivy-2")]
    assert {member_account(cert) for cert in joined} == {f"invite:{invite.token_id}"}
    assert member_account(home.credentials().cert) == "host"  # no invite: its own name

    ca_key, ca_cert = make_ca("accounts")
    key = new_private_key().public_key()
    assert member_account(sign_member(ca_key, ca_cert, key, "ivy", invite="0a1b")) == "invite:0a1b"
    assert member_account(sign_member(ca_key, ca_cert, key, "ivy-2", invite="0a1b")) == "invite:0a1b"
    assert member_account(sign_member(ca_key, ca_cert, key, "host", role="host")) == "host"  # no invite: its name
    with pytest.raises(IdentityError):
        sign_member(ca_key, ca_cert, key, "ivy", invite="not hex\n")
