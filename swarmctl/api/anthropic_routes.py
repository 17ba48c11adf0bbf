"""The Anthropic Messages API routes: ``POST /v1/messages`` (whole or streamed) and
``POST /v1/messages/count_tokens``.

A request parses into the same ``ChatRequest`` as OpenAI's chat completions
(swarmctl/api/anthropic_params.py), renders through the same template and tools prompt
(swarmctl/api/prompting.py) and generates through the server's one generation path
(``ApiServer.generation``: limits, grammar, admission, trace), so only the shapes differ.
Errors become Anthropic's in ``ApiServer.handle`` (swarmctl/api/anthropic_shapes.py).
"""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import TYPE_CHECKING

from swarmctl.api import anthropic_shapes as shapes
from swarmctl.api import sse
from swarmctl.api.anthropic_params import parse_messages
from swarmctl.api.errors import from_exception
from swarmctl.api.generation import TextGeneration
from swarmctl.api.http import ChunkedBody, Request, Responder
from swarmctl.api.params import parse_json
from swarmctl.api.prompting import ChatPrompt, render_chat
from swarmctl.api.tools import ToolCall, parse_call

if TYPE_CHECKING:
    from swarmctl.api.server import ApiServer

log = logging.getLogger("swarmctl.serve")


class AnthropicRoutes:
    def __init__(self, server: "ApiServer") -> None:
        self.server = server

    def routes(self) -> dict:
        return {"/v1/messages": ("POST", self.messages), "/v1/messages/count_tokens": ("POST", self.count_tokens)}

    def _prompt(self, request: Request, *, counting: bool = False) -> ChatPrompt:
        chat = parse_messages(parse_json(request.body), counting=counting)
        self.server.check_model(chat.params.model)
        return render_chat(self.server.asker.tokenizer, chat)

    async def count_tokens(self, request: Request, responder: Responder, request_id: str) -> None:
        """The prompt's tokens as /v1/messages would send them: template, system and tools included."""
        prompt = self._prompt(request, counting=True)
        await _send_json(responder, {"input_tokens": len(prompt.tokens)}, request_id)

    async def messages(self, request: Request, responder: Responder, request_id: str) -> None:
        prompt = self._prompt(request)
        envelope = shapes.MessageEnvelope(self.server.model_id)
        async with self.server.generation(prompt.tokens, prompt.params, request_id, prompt.schema_param) as gen:
            if not prompt.params.stream:
                text, call = await _whole(gen, prompt)
                content = [shapes.tool_use_block(call)] if call else [shapes.text_block(text)] if text else []
                reason = shapes.stop_reason(gen.finish_reason, gen.stop_sequence, call is not None)
                await _send_json(responder, envelope.message(content, reason, gen.stop_sequence,
                                                             shapes.usage(gen.usage)), request_id)
                return
            body = await responder.stream(200, sse.CONTENT_TYPE, {**sse.HEADERS, "x-request-id": request_id})
            await body.write(envelope.start(shapes.usage(gen.usage, output=False)))
            await body.write(shapes.ping())
            try:
                call = await (_stream_call(gen, prompt, body) if prompt.tools else _stream_text(gen, body))
            except Exception as e:  # noqa: BLE001 - the status is out: the error goes in the stream
                if isinstance(e, ConnectionError):
                    raise  # the client is gone: nobody to tell
                error = from_exception(e)
                log.warning("%s %s stream -> %s", request_id, envelope.id, error.message)
                await body.write(shapes.error_event(error))
                await body.end()
                return
            reason = shapes.stop_reason(gen.finish_reason, gen.stop_sequence, call is not None)
            await body.write(shapes.message_delta(reason, gen.stop_sequence, shapes.usage(gen.usage)))
            await body.write(shapes.message_stop())
            await body.end()


async def _whole(gen: TextGeneration, prompt: ChatPrompt) -> tuple[str, ToolCall | None]:
    async with aclosing(gen.pieces()) as pieces:
        text = "".join([piece async for piece in pieces])
    return text, parse_call(text, prompt.tools) if prompt.tools else None


async def _stream_text(gen: TextGeneration, body: ChunkedBody) -> None:
    """One text block, its deltas sent as the text becomes final."""
    await body.write(shapes.block_start(0, shapes.text_block("")))
    async with aclosing(gen.pieces()) as pieces:
        async for text in pieces:
            await body.write(shapes.text_delta(0, text))
    await body.write(shapes.block_stop(0))


async def _stream_call(gen: TextGeneration, prompt: ChatPrompt, body: ChunkedBody) -> ToolCall | None:
    """An answer that may be a call is read whole first (a call is only a call once it parses),
    then sent as a tool_use block with its input in one input_json_delta, or as one text block."""
    text, call = await _whole(gen, prompt)
    if call is not None:
        await body.write(shapes.block_start(0, shapes.tool_use_block(call, started=True)))
        await body.write(shapes.json_delta(0, call.arguments))
    else:
        await body.write(shapes.block_start(0, shapes.text_block("")))
        if text:
            await body.write(shapes.text_delta(0, text))
    await body.write(shapes.block_stop(0))
    return call


async def _send_json(responder: Responder, payload: dict, request_id: str) -> None:
    await responder.send(200, json.dumps(payload, ensure_ascii=False).encode("utf-8"),
                         headers={"x-request-id": request_id})
