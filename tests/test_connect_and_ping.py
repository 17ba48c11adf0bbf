"""The small connection helpers, without sockets: connect to the first host address that answers
(net.endpoint.connect_first, swarmctl.reaching.host_addresses) and the ping helpers (net.ping)."""

from __future__ import annotations

import asyncio

import pytest

from net.endpoint import Address, AddressError, NoAddressAnswered, connect_first
from net.identity import IdentityError
from net.ping import ping_ms, quiet_ping, round_trip_ms
from swarmctl.node.home import NodeConfig
from swarmctl.reaching.host_addresses import host_addresses


def node(role: str, listen: str, advertised: list[str]) -> NodeConfig:
    return NodeConfig(name="n", role=role, swarm_name="s", ca_fingerprint="f", host_name="h",
                      host_addresses=advertised, listen=listen)


def test_the_host_tries_its_own_listen_address_first_and_members_only_the_advertised_ones():
    advertised = ["10.0.0.1:7470", "192.168.1.2:7470"]
    assert host_addresses(node("host", "0.0.0.0:7470", advertised)) == ["127.0.0.1:7470", *advertised]
    assert host_addresses(node("host", "10.0.0.1:7470", advertised)) == advertised  # no address twice
    assert host_addresses(node("member", "0.0.0.0:7471", advertised)) == advertised


def connector(answers: dict[str, object]):
    """A fake connect: each address answers with a value or raises the exception given for it."""
    tried: list[Address] = []

    async def connect(address: Address):
        tried.append(address)
        answer = answers[str(address)]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return connect, tried


def test_the_first_address_that_answers_wins_and_later_ones_are_not_tried():
    connect, tried = connector({"a:1": ConnectionError("no answer from a:1"), "b:2": "conn-b", "c:3": "conn-c"})
    assert asyncio.run(connect_first(["a:1", "b:2", "c:3"], connect)) == "conn-b"
    assert tried == [Address("a", 1), Address("b", 2)]


def test_when_none_answers_every_failure_is_kept_in_order():
    connect, _ = connector({"a:1": ConnectionError("no answer from a:1"), "b:2": OSError("network unreachable")})
    with pytest.raises(NoAddressAnswered) as caught:
        asyncio.run(connect_first(["a:1", "b:2"], connect))
    assert str(caught.value) == "no answer from a:1; network unreachable"
    assert [text for text, _ in caught.value.failures] == ["a:1", "b:2"]
    assert isinstance(caught.value, ConnectionError)
    with pytest.raises(NoAddressAnswered, match="no host address"):
        asyncio.run(connect_first([], connect))


def test_only_the_named_failures_move_on_to_the_next_address():
    connect, tried = connector({"a:1": IdentityError("not the pinned CA"), "b:2": "conn-b"})
    assert asyncio.run(connect_first(["a:1", "b:2"], connect, failures=(IdentityError,))) == "conn-b"
    with pytest.raises(IdentityError):
        asyncio.run(connect_first(["a:1", "b:2"], connect))
    with pytest.raises(AddressError):  # a malformed address is a mistake to report, not a host to skip
        asyncio.run(connect_first(["no-port", "b:2"], connect))


class FakeConn:
    """Answers pings after the given delays (seconds), or never (None), or fails (an exception)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)

    async def ping(self) -> None:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        await asyncio.sleep(3600 if answer is None else answer)


def test_a_quiet_ping_swallows_a_lost_connection_and_a_timeout_but_a_timed_ping_does_not():
    asyncio.run(quiet_ping(FakeConn(ConnectionError("closed"))))
    asyncio.run(quiet_ping(FakeConn(None), timeout=0.01))
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(ping_ms(FakeConn(None), timeout=0.01))
    with pytest.raises(ConnectionError):
        asyncio.run(ping_ms(FakeConn(ConnectionError("closed"))))


def test_the_round_trip_is_the_median_ping():
    rtt = asyncio.run(round_trip_ms(FakeConn(0.0, 0.5, 0.02)))
    assert 20 <= rtt < 500  # the 0.02 s ping: neither the instant one nor the slow one
