"""The rendezvous: how a member's socket looks from the public side, and the introduction of two
members that should punch a link between them.

The host answers "observe" datagrams with the source address it saw (the member's NAT mapping
for that socket towards the host). With a port-preserving NAT that is also how the member's
datagrams to anyone else will look, so the host can tell both ends of a link where to send their
probes. With a symmetric NAT each destination gets its own port and the observed one is useless
to the peer: punching fails there and the link goes through a relay (net.turn).

    echo = ObservedAddressEcho(); await echo.start(sock)        # on the host
    public = await observe(shared, Address("198.51.100.1", 3478))   # on a member (net.punch)
    ticket_a, ticket_b = introduce(public_a, public_b)           # the host, to each end
"""

from __future__ import annotations

import asyncio
import secrets
import socket

from .endpoint import Address
from .punch import NONCE_BYTES, PunchTicket, SharedSocket

OBSERVE = b"\x00swO"
OBSERVED = b"\x00swA"
QUERY_ID_BYTES = 8
OBSERVE_TIMEOUT = 2.0
OBSERVE_RETRY = 0.2  # a lost datagram is sent again this often, until the timeout


def observed_reply(data: bytes, addr: tuple) -> bytes | None:
    """The answer to an observe datagram from ``addr``, or None for anything else. Pure, so the
    host can answer on a socket of its own or on its QUIC socket (a SharedSocket handler)."""
    if len(data) != len(OBSERVE) + QUERY_ID_BYTES or not data.startswith(OBSERVE):
        return None
    return OBSERVED + data[len(OBSERVE):] + str(Address(addr[0], int(addr[1]))).encode()


class ObservedAddressEcho:
    """A UDP echo that replies to each observe datagram with the sender's observed ip:port."""

    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None
        self.answered = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        reply = observed_reply(data, addr)
        if reply is not None:
            self.transport.sendto(reply, addr)
            self.answered += 1

    def error_received(self, exc: Exception) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        pass

    async def start(self, sock: socket.socket) -> Address:
        sock.setblocking(False)
        await asyncio.get_running_loop().create_datagram_endpoint(lambda: self, sock=sock)
        host, port = self.transport.get_extra_info("sockname")[:2]
        return Address(host, port)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def observe(shared: SharedSocket, echo: Address, timeout: float = OBSERVE_TIMEOUT) -> Address:
    """Ask the echo how this socket's datagrams look from the public side."""
    query_id = secrets.token_bytes(QUERY_ID_BYTES)

    def accept(body: bytes) -> Address | None:
        if body[:QUERY_ID_BYTES] != query_id:
            return None
        return Address.parse(body[QUERY_ID_BYTES:].decode(errors="replace"))

    return await shared.ask(OBSERVE + query_id, echo, OBSERVED, accept, retry=OBSERVE_RETRY, timeout=timeout,
                            who="the rendezvous")


def introduce(a: Address, b: Address) -> tuple[PunchTicket, PunchTicket]:
    """The two tickets for a link between the members seen at ``a`` and ``b``: each names the
    other's public address, and both carry one fresh nonce."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return PunchTicket(peer=b, nonce=nonce, side=0), PunchTicket(peer=a, nonce=nonce, side=1)
