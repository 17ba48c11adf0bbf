"""The soak's HTTP client for `swarmctl serve`: one HTTP/1.1 request on a connection of its own,
stdlib asyncio only, reading streamed (server-sent events) answers as they arrive."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from harness.soak.records import Request


class HttpError(Exception):
    """A streamed answer that ended badly: an error event, or a stream cut short."""


async def _read_http_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise HttpError("the server closed the connection without answering")
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = (await reader.readline()).decode("latin-1").strip()
        if not line:
            return status, headers
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives (chunked or with a Content-Length or until close)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise HttpError("the connection closed inside a chunked body")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def api_request(port: int, path: str, body: dict | None, req: Request | None = None,
                      t0: float = 0.0) -> tuple[int, str]:
    """One HTTP/1.1 request to 127.0.0.1:port. Streaming (SSE) answers are parsed: returns the
    status and the text of the deltas; an error event or a stream without [DONE] raises HttpError.
    A non-2xx answer returns (status, the error message)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = json.dumps(body).encode() if body is not None else b""
        method = "POST" if body is not None else "GET"
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status, headers = await _read_http_head(reader)
        if not headers.get("content-type", "").startswith("text/event-stream"):
            raw = b"".join([c async for c in _body_chunks(reader, headers)])
            if status >= 300:
                try:
                    return status, json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    return status, raw.decode(errors="replace")[:200]
            return status, raw.decode()
        pieces, buffer, done = [], b"", False
        async for chunk in _body_chunks(reader, headers):
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.decode().splitlines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        done = True
                        continue
                    message = json.loads(payload)
                    if "error" in message:
                        raise HttpError(f"error event in the stream: {message['error'].get('message')}")
                    for choice in message.get("choices") or []:
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if text:
                            if req is not None and req.ttft_s is None:
                                req.ttft_s = time.monotonic() - t0 - req.started_s
                            pieces.append(text)
        if not done:
            raise HttpError("the stream ended without [DONE] and without an error event")
        return status, "".join(pieces)
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 2)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
