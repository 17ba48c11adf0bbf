"""Issue 30, item 3: Slowloris on `swarmctl serve`. Clients without the key that open connections
and trickle header lines must not keep a client with the key out: the whole head has a
deadline, the slots that connections without the key may hold are capped per client address, and
a head with the key takes a slot from a connection without it when none is free.

Real sockets on loopback against the real HTTP layer and the real key check (`check_key`, the
gate `serve` uses); distinct client addresses are distinct loopback addresses (127.0.0.x), which
Linux routes to lo without any set-up. Every test is bounded: at most 112 sockets, seconds each.
"""

from __future__ import annotations

import socket
import time
from contextlib import ExitStack

import pytest

from swarmctl.api.http import client_address
from swarmctl.api.startup import StartingServer
from tests.test_http_server import EchoServer, error_code, read_all, status_of

KEY = "sk-slowloris-test"
CLIENT, ATTACKER, OTHERS, STRANGER = "127.0.0.1", "127.0.0.2", ("127.0.0.3", "127.0.0.4", "127.0.0.5"), "127.0.0.6"
REFILL = ("127.0.0.7", "127.0.0.8")
PARTIAL_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow-1: a\r\n"  # never ended: a trickler's start


FRONT = StartingServer(KEY)  # serve's gate: the API key checked on the head


class KeyedServer(EchoServer):
    """The echo server of test_http_server behind serve's own key check."""

    gate = staticmethod(FRONT.check_head)


def connect(server: EchoServer, source: str, stack: ExitStack) -> socket.socket:
    s = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=10,
                                                     source_address=(source, 0)))
    return s


def ask(s: socket.socket, key: str | None, close: bool = False) -> bytes:
    """One GET on the socket; the whole reply (this server's replies are small: one recv each)."""
    headers = b"Host: x\r\n" + (b"Authorization: Bearer %s\r\n" % key.encode() if key else b"") + \
        (b"Connection: close\r\n" if close else b"")
    s.sendall(b"GET /v1/models HTTP/1.1\r\n" + headers + b"\r\n")
    if close:
        return read_all(s)[0]
    s.settimeout(10)
    return s.recv(65536)


def finish_head(s: socket.socket, key: str | None = None) -> bytes:
    """End a trickler's head (with the key or not) and read what the server answers until it closes."""
    try:
        s.sendall((b"Authorization: Bearer %s\r\n" % key.encode() if key else b"") + b"Connection: close\r\n\r\n")
    except OSError:
        return b""  # closed already
    return read_all(s)[0]


def closed(s: socket.socket) -> bool:
    """Whether the server has closed this socket (it has sent nothing: these sockets never sent a head)."""
    s.settimeout(10)
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@pytest.fixture
def keyed_server():
    # Tricklers must not be cut by a deadline while the test runs: that is checked on its own below.
    server = KeyedServer(idle_timeout=120, head_timeout=120)
    yield server
    server.close()


def test_keyless_tricklers_cannot_keep_a_keyed_client_out(keyed_server):
    """The attack of the issue: 64 keyless connections from one address that trickle header lines,
    plus 16 more from each of three other addresses, against the default 64 slots. Before the fix
    the first 64 took every slot and a client with the key got 503 for as long as they trickled."""
    server = keyed_server
    with ExitStack() as stack:
        early = connect(server, CLIENT, stack)  # a keyed client already connected, kept alive
        assert status_of(ask(early, KEY)) == 200

        attacker = [connect(server, ATTACKER, stack) for _ in range(64)]
        others = {address: [connect(server, address, stack) for _ in range(16)] for address in OTHERS}
        for s in attacker + [s for group in others.values() for s in group]:
            s.sendall(PARTIAL_HEAD)
        for s in attacker + [s for group in others.values() for s in group]:
            s.sendall(b"X-Slow-2: b\r\n")  # still trickling

        # Per address: the attacker's first 16 (a quarter of 64) hold slots; the other 48 hold
        # none and are answered 503 when their head ends (without the key).
        assert status_of(finish_head(attacker[5])) == 401  # held a slot: the key check answered
        for index in (16, 63):
            reply = finish_head(attacker[index])
            assert status_of(reply) == 503 and error_code(reply) == "too_many_connections"
        # The other addresses got slots, the attacker's 64 connections notwithstanding.
        assert status_of(finish_head(others[OTHERS[0]][3])) == 401

        # Those two answers closed their connections: two more tricklers fill the slots again.
        for address in REFILL:
            connect(server, address, stack).sendall(PARTIAL_HEAD)

        # Every slot is now held by a connection without the key: a keyless newcomer gets none...
        reply = ask(connect(server, STRANGER, stack), None, close=True)
        assert status_of(reply) == 503 and error_code(reply) == "too_many_connections"
        # ...and a newcomer with the key is answered, taking the slot of the oldest trickler of
        # the address that holds the most slots without the key (the second of the others: 16).
        # (It is kept alive, so it keeps that slot and the next one has to take another.)
        assert status_of(ask(connect(server, CLIENT, stack), KEY)) == 200
        assert closed(others[OTHERS[1]][0])
        # Then every address holds 15 or fewer: the oldest of those with 15 goes, the attacker's first.
        # (Its 46 connections without a slot are no candidates: they hold nothing to give.)
        assert status_of(ask(connect(server, STRANGER, stack), KEY)) == 200
        assert closed(attacker[0])
        # A client with the key behind the attacker's own address (one NAT) is served as well: its
        # connection waits without a slot like the attacker's, and its key takes one.
        assert status_of(ask(connect(server, ATTACKER, stack), KEY)) == 200
        assert closed(others[OTHERS[0]][0])  # 15 each now; the oldest of those goes
        # The keyed connection of before was never a candidate: it still answers.
        assert status_of(ask(early, KEY)) == 200
        # Tricklers that were not evicted are still open (nothing was closed wholesale).
        assert status_of(finish_head(others[OTHERS[1]][7])) == 401


def test_a_keyed_connection_is_refused_only_when_the_slots_are_keyed():
    """Eviction only ever takes a slot from a connection without the key: once every slot is keyed,
    a keyed newcomer is answered 503, and the keyed connections go on being served."""
    server = KeyedServer(idle_timeout=120, head_timeout=120, max_connections=4)  # one per address without the key
    try:
        with ExitStack() as stack:
            keyed = [connect(server, CLIENT, stack) for _ in range(2)]
            for s in keyed:
                assert status_of(ask(s, KEY)) == 200
            tricklers = [connect(server, address, stack) for address in OTHERS[:2]]
            for s in tricklers:
                s.sendall(PARTIAL_HEAD)
            # The slots are full (2 keyed + 2 tricklers); each keyed newcomer evicts one trickler.
            newcomers = [connect(server, address, stack) for address in REFILL]
            for s in newcomers:
                assert status_of(ask(s, KEY)) == 200
            assert all(closed(s) for s in tricklers)
            reply = ask(connect(server, OTHERS[2], stack), KEY, close=True)
            assert status_of(reply) == 503 and error_code(reply) == "too_many_connections"
            for s in keyed + newcomers:
                assert status_of(ask(s, KEY)) == 200
    finally:
        server.close()


def test_one_address_waiting_beyond_the_slots_is_closed_at_once():
    """Connections from one address that get no slot may wait for their head up to
    max_connections of them; beyond that they are closed at once, unanswered."""
    server = KeyedServer(idle_timeout=120, head_timeout=120, max_connections=4)
    try:
        with ExitStack() as stack:
            flood = [connect(server, ATTACKER, stack) for _ in range(6)]  # 1 slot, 4 waiting, 1 closed
            assert closed(flood[5])
            for s in flood[:5]:
                s.sendall(PARTIAL_HEAD)
            reply = finish_head(flood[4])
            assert status_of(reply) == 503 and error_code(reply) == "too_many_connections"
            assert status_of(finish_head(flood[0])) == 401  # the one with a slot
            # A waiting one with the key from that address is served (there is a free slot now).
            assert status_of(finish_head(flood[1], KEY)) == 200
    finally:
        server.close()


def test_without_a_key_one_client_may_open_a_burst_of_connections():
    """With no key set, a complete request is all the trust there is: a client opening 48
    connections at once from one address (a pool starting up) is served on all of them, although
    only 16 could take a slot before sending their heads."""
    server = EchoServer(idle_timeout=30, head_timeout=30)  # lets every request through: no key
    try:
        with ExitStack() as stack:
            burst = [connect(server, CLIENT, stack) for _ in range(48)]
            for s in burst:
                assert status_of(ask(s, None)) == 200
            for s in burst:  # and they stay served: kept alive, none evicted
                assert status_of(ask(s, None)) == 200
    finally:
        server.close()


HEAD_DEADLINE = 1.5  # the head deadline of the server under test (the default is 10 s)


@pytest.fixture
def deadline_server():
    server = KeyedServer(idle_timeout=60, head_timeout=HEAD_DEADLINE)  # 60 s: the keep-alive timer plays no part
    yield server
    server.close()


def trickle_until_closed(s: socket.socket, limit_s: float = 20) -> tuple[bool, int]:
    """A header line every 0.2 s (each far inside any per-read timeout) until the server closes the
    connection or limit_s passes: (closed, lines sent)."""
    start, lines = time.monotonic(), 0
    s.settimeout(0.2)
    while time.monotonic() - start < limit_s:
        try:
            s.sendall(b"X-Trickle-%d: a\r\n" % lines)
            lines += 1
            if s.recv(65536) == b"":
                return True, lines
        except socket.timeout:
            continue
        except OSError:
            return True, lines
    return False, lines


def test_a_trickled_head_is_cut_at_the_head_deadline(deadline_server):
    """The deadline is for the whole head, not per line: a line every 0.2 s is cut once the head
    deadline has passed since the connection opened, long before the 60 s keep-alive timer."""
    with socket.create_connection(("127.0.0.1", deadline_server.port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        was_closed, lines = trickle_until_closed(s)
    assert was_closed, f"a head trickled for 20 s ({lines} lines) was never cut"


@pytest.mark.slow  # waits out a head deadline: 4.5 s
def test_a_kept_alive_connection_waits_idle_but_its_next_head_has_the_deadline(deadline_server):
    """After an answer, a kept-alive connection may wait in silence (the keep-alive timer, not the
    head deadline); the deadline starts at the first byte of its next head."""
    with socket.create_connection(("127.0.0.1", deadline_server.port), timeout=10) as s:
        assert status_of(ask(s, KEY)) == 200
        time.sleep(2 * HEAD_DEADLINE)
        assert status_of(ask(s, KEY)) == 200  # idle past the head deadline: still open
        s.sendall(b"GET /v1/models HTTP/1.1\r\n")
        was_closed, lines = trickle_until_closed(s)
    assert was_closed, f"a kept-alive connection's head trickled for 20 s ({lines} lines) was never cut"


@pytest.mark.parametrize("peer, address", [
    (("203.0.113.7", 5000), "203.0.113.7"),
    (("::ffff:203.0.113.7", 5000, 0, 0), "203.0.113.7"),
    (("2001:db8:1:2:aaaa::1", 5000, 0, 0), "2001:db8:1:2::/64"),
    (("2001:db8:1:2:bbbb::9", 5001, 0, 0), "2001:db8:1:2::/64"),  # the same /64: one address
    (("fe80::1%eth0", 5000, 0, 2), "fe80::/64"),
    ("/run/swarmctl.sock", ""),
])
def test_connections_are_counted_per_ip_and_per_ipv6_64(peer, address):
    assert client_address(peer) == address
