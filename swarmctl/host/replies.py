"""How the host's handlers answer: one message on the request's stream. A handler that finishes
after its sender left (a fetch, a judged report, a route) has nobody to tell, so a closed
connection is answered with nothing."""

from __future__ import annotations

from net import messages as m
from net.protocol import SwarmProtocol


def reply(conn: SwarmProtocol, stream_id: int, message: m.Message, end: bool = False) -> None:
    if conn.is_open:
        conn.send(stream_id, m.encode(message), end=end)


def ok(conn: SwarmProtocol, stream_id: int, **fields) -> None:
    reply(conn, stream_id, m.Ok(**fields), end=True)


def error(conn: SwarmProtocol, stream_id: int, message: str) -> None:
    reply(conn, stream_id, m.Error(message=message), end=True)
