"""Anthropic's response objects: a message, its content blocks, stream events and errors.

A stream is server-sent events with an ``event:`` line naming each: ``message_start``, ``ping``,
then per content block ``content_block_start``, its ``content_block_delta``s (``text_delta`` or
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason, usage) and
``message_stop``; or an ``error`` event when it fails after it has begun.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from swarmctl.api import sse
from swarmctl.api.errors import ApiError
from swarmctl.api.shapes import Usage
from swarmctl.api.tools import ToolCall

# HTTP status → Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def error_payload(error: ApiError) -> dict:
    kind = ERROR_TYPES.get(error.status)
    if kind is None:
        busy = error.code == "swarm_busy"  # the swarm is at its bound of requests: retry later
        kind = "overloaded_error" if busy else "api_error" if error.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_body(error: ApiError) -> bytes:
    return json.dumps(error_payload(error)).encode("utf-8")


def stop_reason(finish_reason: str | None, stop_sequence: str | None, called: bool) -> str:
    """The generation's end → Anthropic's stop_reason."""
    if called:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def usage(counts: Usage, *, output: bool = True) -> dict:
    """As Anthropic counts: ``input_tokens`` are those computed, the ones taken from a kept prefix
    of an earlier request are ``cache_read_input_tokens`` (the prompt is their sum). ``output``
    False: as message_start reports it, before any answer."""
    return {"input_tokens": counts.prompt_tokens - counts.cached_tokens,
            "cache_read_input_tokens": counts.cached_tokens,
            "output_tokens": counts.completion_tokens if output else 0}


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def tool_use_block(call: ToolCall, *, started: bool = False) -> dict:
    """``started``: as content_block_start gives it, its input to come in input_json_delta events."""
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name,
            "input": {} if started else json.loads(call.arguments)}


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


@dataclass(frozen=True)
class MessageEnvelope:
    """What a message and its stream events share."""

    model: str
    id: str = field(default_factory=lambda: "msg_" + secrets.token_hex(12))

    def message(self, content: list[dict], reason: str | None, stop_sequence: str | None, counts: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop_sequence, "usage": counts}

    def start(self, counts: dict) -> bytes:
        return event("message_start", {"type": "message_start", "message": self.message([], None, None, counts)})


def event(name: str, payload: dict) -> bytes:
    return f"event: {name}\n".encode() + sse.event(payload)


def ping() -> bytes:
    return event("ping", {"type": "ping"})


def block_start(index: int, block: dict) -> bytes:
    return event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def text_delta(index: int, text: str) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": "text_delta", "text": text}})


def json_delta(index: int, partial_json: str) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": "input_json_delta", "partial_json": partial_json}})


def block_stop(index: int) -> bytes:
    return event("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(reason: str, stop_sequence: str | None, counts: dict) -> bytes:
    return event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                      "stop_sequence": stop_sequence},
                                    "usage": counts})


def message_stop() -> bytes:
    return event("message_stop", {"type": "message_stop"})


def error_event(error: ApiError) -> bytes:
    return event("error", error_payload(error))


def is_anthropic(path: str) -> bool:
    """The routes that answer in Anthropic's shapes (with or without the /v1 of a base URL)."""
    path = path.rstrip("/").removeprefix("/v1")
    return path == "/messages" or path.startswith("/messages/")


def encode_error(path: str, error: ApiError) -> bytes:
    """An error's body in the shape of the API its path belongs to."""
    return error_body(error) if is_anthropic(path) else error.encode()
