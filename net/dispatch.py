"""One way to answer control messages: a table from message type to handler.

Each role (host, trunk, asker) builds one ``Dispatcher`` from its handlers; what it accepts is
derived from that table, so a new message is one struct in net/messages.py and one entry here,
and nothing else lists it. The dispatcher does what every role did by hand before: parse against
the accepted set (one line for an unknown or malformed message), refuse a sender whose certificate
role the struct does not allow (``Message.senders``), and call the handler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from . import messages as m

Handler = Callable[..., Any]


class Dispatcher:
    def __init__(self, handlers: Mapping[type[m.Message], Handler]) -> None:
        self._handlers = dict(handlers)
        self.accepted: m.Kinds = m.kinds(*self._handlers)

    def __contains__(self, kind: type[m.Message]) -> bool:
        return kind in self._handlers

    def parse(self, message: dict[str, Any]) -> m.Message:
        """The struct of a decoded control message this dispatcher answers; UnknownMessage or
        MalformedMessage (one line each) otherwise."""
        return m.parse(message, self.accepted)

    @staticmethod
    def refusal(request: m.Message, role: str | None, peer: str | None = None) -> str | None:
        """Why a sender with certificate role ``role`` may not send ``request`` (None: it may)."""
        if not request.senders or role in request.senders:
            return None
        kind = type(request).__struct_config__.tag
        return f"{kind!r} needs a {' or '.join(request.senders)} certificate; {peer or 'the sender'} joined as {role}"

    def dispatch(self, request: m.Message, *context: Any) -> Any:
        """Call the handler for ``request``'s type as ``handler(*context, request)``."""
        return self._handlers[type(request)](*context, request)
