"""Results streams at the last stage: where each asker process wants its results.

An asker subscribes with a session (a random token, one per process) and sends the same token
as its packets' ``reply_to``; results go to ``member/session``, where the member part always
comes from the certificate of the connection, never from a packet. Several processes of one
member (two terminals, ``serve`` next to ``ask``) each get their own. No I/O here.
"""

from __future__ import annotations

from typing import Any

from swarmctl.trunk.routes import FinishStream

Conn = Any  # a net.protocol.SwarmProtocol


def results_key(member: str, session: str) -> str:
    return f"{member}/{session}"


def valid_session(session: object) -> bool:
    return isinstance(session, str) and 0 < len(session) <= 64 and all(c in "0123456789abcdef" for c in session)


class ResultStreams:
    def __init__(self) -> None:
        self._streams: dict[str, tuple[Conn, int]] = {}  # results_key → an asker's results stream

    def __len__(self) -> int:
        return len(self._streams)

    def subscribe(self, conn: Conn, stream_id: int, session: str) -> list[FinishStream]:
        """``conn``'s member, process ``session``, wants results on ``stream_id``. A re-subscription
        (the asker saw a new plan) ends the old stream, or it would leak."""
        key = results_key(conn.peer_name, session)
        old = self._streams.get(key)
        self._streams[key] = (conn, stream_id)
        if old is not None and old != (conn, stream_id) and old[0].is_open:
            return [FinishStream(*old)]
        return []

    def stream_for(self, key: str) -> tuple[Conn, int] | None:
        """The open results stream for ``member/session``, if there is one."""
        stream = self._streams.get(key)
        return stream if stream is not None and stream[0].is_open else None

    def connection_lost(self, conn: Conn) -> None:
        for key, (sub_conn, _) in list(self._streams.items()):
            if sub_conn is conn:
                del self._streams[key]
