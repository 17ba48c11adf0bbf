"""Datagrams by the batch, not one at a time.

asyncio hands a UDP protocol one datagram per socket wake-up, and aioquic answers every datagram
with a full send pass (build what is due, ACKs, arm the timer), although an ACK is due about one
time in ten: on the receiving end of an activation frame that pass was ~37 % of its QUIC time.
Here, the socket's reader drains what else is already waiting on the socket (up to ``MAX_BATCH``
datagrams in all), feeds each to its connection, and only then lets every connection that
received something transmit, once. Nothing waits for a batch to fill: it is what the kernel
already holds at that moment.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Callable, Protocol

MAX_BATCH = 64  # datagrams read per wake-up, at most (a bound, so one busy socket cannot starve the loop)
RECV_BYTES = 65535
# Windows' event loop reads by overlapped I/O of its own: a second reader there would race it.
_READ_MORE = sys.platform != "win32"


class Flushable(Protocol):
    def flush(self) -> None: ...  # transmit what the datagrams received made due


_pending: list[Flushable] | None = None  # the connections to flush at the end of the batch being read


def active() -> bool:
    """A batch is being read: a connection defers its transmit to the batch's end."""
    return _pending is not None


def defer(conn: Flushable) -> bool:
    """Flush ``conn`` at the end of the batch being read; False when none is (flush now)."""
    if _pending is None:
        return False
    if conn not in _pending:
        _pending.append(conn)
    return True


def readable(transport: asyncio.BaseTransport, sock: socket.socket) -> socket.socket | None:
    """``sock`` where ``transport`` reads it (asyncio's datagram transports say so: extra info
    "socket"); None where the transport gets its datagrams from elsewhere (an in-memory network's,
    harness/sim), so nothing waits on the socket and reading it for more would cost a failed
    system call per datagram."""
    return sock if transport.get_extra_info("socket") is not None else None


def drain(sock: socket.socket, data: bytes, addr, deliver: Callable[[bytes, tuple], None]) -> None:
    """Deliver ``data`` and what else waits on ``sock`` (up to MAX_BATCH in all), then flush every
    connection they were for, once each."""
    global _pending
    pending: list[Flushable] = []
    _pending = pending
    try:
        deliver(data, addr)
        for _ in range(MAX_BATCH - 1 if _READ_MORE else 0):
            try:
                data, addr = sock.recvfrom(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # an ICMP error queued on the socket: asyncio's reader reports it next time
                break
            deliver(data, addr)
    finally:
        _pending = None
        for conn in pending:  # (also when one datagram's handling raised: the others' answers go out)
            conn.flush()
