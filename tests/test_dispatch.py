"""net/dispatch.py: a message type and its handler are the only places a new message is written
(issue 31 item 3); the accepted set, parsing and the role check follow from the table."""

from __future__ import annotations

import pytest

from net import messages as m
from net.dispatch import Dispatcher


class Echo(m.Message, tag="echo"):  # a throwaway message: one struct ...
    senders = ("trunk",)
    text: m.Text


def test_a_new_message_is_one_struct_and_one_handler():
    seen = []
    dispatcher = Dispatcher({Echo: lambda conn, request: seen.append((conn, request.text)),  # ... and one handler
                             m.GetStatus: lambda conn, request: "status"})
    assert set(dispatcher.accepted) == {"echo", "status"}
    request = dispatcher.parse({"type": "echo", "text": "hi"})
    assert dispatcher.refusal(request, "trunk") is None
    dispatcher.dispatch(request, "conn-1")
    assert seen == [("conn-1", "hi")] and dispatcher.dispatch(dispatcher.parse({"type": "status"}), None) == "status"


def test_unknown_malformed_and_unentitled_messages_are_one_line_refusals():
    dispatcher = Dispatcher({Echo: lambda conn, request: None})
    with pytest.raises(m.UnknownMessage, match="unknown request 'register'"):
        dispatcher.parse({"type": "register", "listen": "x", "memory": 1})
    with pytest.raises(m.MalformedMessage, match="malformed echo"):
        dispatcher.parse({"type": "echo", "text": 3})
    refusal = dispatcher.refusal(dispatcher.parse({"type": "echo", "text": "hi"}), "asker", "carol")
    assert refusal == "'echo' needs a trunk certificate; carol joined as asker"
