"""Server-sent events as OpenAI streams them: one ``data: {json}`` event per chunk, then
``data: [DONE]``, over a chunked HTTP body."""

from __future__ import annotations

import json

from swarmctl.api.http import ChunkedBody

CONTENT_TYPE = "text/event-stream; charset=utf-8"
HEADERS = {"Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"


def event(payload: dict) -> bytes:
    # json.dumps escapes newlines inside strings, so an event is always one "data:" line.
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class EventStream:
    def __init__(self, body: ChunkedBody) -> None:
        self._body = body

    async def send(self, payload: dict) -> None:
        await self._body.write(event(payload))

    async def close(self, *, done: bool = True) -> None:
        """End the stream: after ``[DONE]``, or without it when the stream ends in an error event."""
        if done:
            await self._body.write(DONE)
        await self._body.end()
