"""The OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions``, streamed or whole.

Every request is its own task and its own asker request, so concurrent requests share the
pipeline's batches. Errors come back in OpenAI's shape with one log line here; a stream that
fails after it has begun ends with an error event, as OpenAI's do.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import secrets
import socket
import ssl
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Sequence

from kernels.grammar import BUILD_BUDGET_S, STEP_BUDGET_S, Grammar, GrammarError, build_grammar
from swarmctl.api import browser, sse
from swarmctl.api.anthropic_routes import AnthropicRoutes
from swarmctl.api.anthropic_shapes import encode_error
from swarmctl.api.browser import HostPolicy, check_browser, check_json_body
from swarmctl.api.errors import (ApiError, bad_request, context_exceeded, from_exception, grammar_error_code,
                                 http_error_body)
from swarmctl.api.generation import TextGeneration, TextRequest
from swarmctl.api.http import DEFAULT_MAX_CONNECTIONS, Limits, Refusal, Request, Responder, start_server
from swarmctl.api.params import GenerationParams, parse_chat, parse_completion, parse_json
from swarmctl.api.shapes import Envelope, chat_logprobs, completion_logprobs, model_list, model_object
from swarmctl.api.prompting import render_chat
from swarmctl.api.tools import Tool, parse_call
from swarmctl.asker.head_tail import Asker, Trunk
from swarmctl.asker.prefixes import PrefixCache
from swarmctl.asker.speculate import Drafting
from swarmctl.asker.trace import TraceError, TraceFolder

log = logging.getLogger("swarmctl.serve")

DEFAULT_REQUEST_TIMEOUT_S = 600.0  # the whole request, the wait for a free slot included


@dataclass(frozen=True)
class ApiSettings:
    """How ``serve`` answers, beyond the model it runs."""

    api_key: str | None = None  # required of every request when set
    created: int = 0  # the model's timestamp in /v1/models
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S  # the whole request, the wait for a slot included
    drafting: Drafting | None = None  # speculative steps for every request (serve --speculate; default off)
    traces: TraceFolder | None = None  # write each request's per-token trace there (serve --trace DIR)
    ui: bool = False  # the web page at / (serve --ui; on by default for loopback)
    nodes: Callable[[], dict[str, str]] | None = None  # what each node holds (the page's swarm view)
    wire_dtype: str = "f32"  # how activations leave this asker (the page's swarm view)
    hosts: HostPolicy | None = HostPolicy()  # Host and Origin checks (swarmctl/api/browser.py); None: none
    grammar_build_s: float = BUILD_BUDGET_S  # structured output: time to build a request's grammar
    grammar_step_s: float = STEP_BUDGET_S  # and to mask and advance it for one step (kernels/grammar.py)


class ApiServer:
    def __init__(self, asker: Asker, trunk: Trunk | None, model_id: str, settings: ApiSettings = ApiSettings()) -> None:
        self.asker = asker
        self.traces = settings.traces
        self.drafting = settings.drafting or Drafting()
        self.trunk = trunk
        self.model_id = model_id
        self.api_key = settings.api_key or None
        # Conversations resend their history: each request starts from the longest kept prefix
        # of an earlier one (swarmctl/asker/prefixes.py). One cache: every client of this serve
        # holds its one key (and reaches the swarm as its one member).
        self.prefixes = PrefixCache()
        self.created = settings.created
        self.request_timeout = settings.request_timeout
        self.settings = settings
        self.routes: dict[str, tuple[str, Callable[[Request, Responder, str], Awaitable[None]]]] = {
            "/": ("GET", self._root),  # what this server is
            "/v1": ("GET", self._root),
            "/v1/models": ("GET", self._models),
            "/v1/swarm": ("GET", self._swarm),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions": ("POST", self._completions),
            **AnthropicRoutes(self).routes(),  # /v1/messages and its count_tokens (swarmctl/api/anthropic_routes.py)
        }

    async def start(self, host: str | None = None, port: int | None = None, *, sock: socket.socket | None = None,
                    max_connections: int = DEFAULT_MAX_CONNECTIONS, tls: ssl.SSLContext | None = None,
                    limits: Limits | None = None) -> asyncio.Server:
        """Listen on host:port, or on a socket already bound; HTTPS when given a TLS context."""
        limits = limits or Limits(max_connections=max_connections)
        return await start_server(self.handle, error_body=http_error_body, gate=self.check_head, host=host,
                                  port=port, sock=sock, tls=tls, limits=limits)

    def check_head(self, request: Request) -> Refusal | None:
        """Before the body is read: a request from another web page or by a name this server does
        not answer for, without the key, or with a body that is not JSON is refused on its head
        alone, so a stranger cannot make this server buffer bodies."""
        return check_head(request, self.api_key, self.settings.hosts)

    async def handle(self, request: Request, responder: Responder) -> None:
        """The HTTP handler: route, answer, and turn any failure into OpenAI's error shape."""
        request_id = "req_" + secrets.token_hex(12)
        try:
            self._authorize(request)
            path = "/" if request.path == "/" else _v1(request.path)
            method, route = self.routes.get(path) or self._model_route(path)
            if request.method != method:
                raise ApiError(405, f"{request.method} is not allowed on {path}; use {method}")
            await route(request, responder, request_id)
        except Exception as e:  # noqa: BLE001 - every failure becomes an error response, never a traceback
            if isinstance(e, ConnectionError) and responder.started:
                raise  # the client went away mid-response; the connection closes
            try:
                error = from_exception(e)
                detail = f" ({type(e).__name__})" if error.status >= 500 and not isinstance(e, ApiError) else ""
                log.warning("%s %s %s -> %d %s%s", request_id, request.method, request.path, error.status,
                            error.message, detail)
                if responder.started:
                    return  # the response is incomplete, so the connection closes
                await responder.send(error.status, encode_error(request.path, error),
                                     headers={"x-request-id": request_id})
            finally:
                _drop_tracebacks(e)

    def _authorize(self, request: Request) -> None:
        authorize(request, self.api_key)

    def _model_route(self, path: str) -> tuple[str, Callable[[Request, Responder, str], Awaitable[None]]]:
        if path.startswith("/v1/models/"):
            return "GET", self._model
        raise ApiError(404, f"Invalid URL ({path})", code="unknown_url")

    def check_model(self, model: str) -> None:
        if model not in (self.model_id, self.model_id + ".gguf"):
            raise ApiError(404, f"The model '{model}' does not exist; this server runs '{self.model_id}'",
                           param="model", code="model_not_found")

    # --- routes ---

    async def _root(self, request: Request, responder: Responder, request_id: str) -> None:
        """The web page for a browser (with --ui), else what this server is, as JSON."""
        if self.settings.ui and request.path == "/" and "text/html" in request.headers.get("accept", ""):
            page, headers = browser.page()
            await responder.send(200, page, "text/html; charset=utf-8", headers={**headers, "x-request-id": request_id})
            return
        endpoints = [f"{method} {path}" for path, (method, _) in self.routes.items() if path.startswith("/v1/")]
        await _send_json(responder, describe_server(self.model_id, endpoints), request_id)

    async def _swarm(self, request: Request, responder: Responder, request_id: str) -> None:
        """What the page's swarm view shows: the nodes and what each holds, the requests generating
        here, how activations leave, and the drafting in use."""
        nodes = self.settings.nodes() if self.settings.nodes is not None else {}
        spec = None if self.drafting.mode == "off" else {"mode": self.drafting.mode}
        await _send_json(responder, {"object": "swarm", "model": self.model_id,
                                     "nodes": [{"name": n, "holds": h} for n, h in nodes.items()],
                                     "in_flight": len(self.asker.in_flight), "wire_dtype": self.settings.wire_dtype,
                                     "speculation": spec}, request_id)

    async def _models(self, request: Request, responder: Responder, request_id: str) -> None:
        await _send_json(responder, model_list(self.model_id, self.created), request_id)

    async def _model(self, request: Request, responder: Responder, request_id: str) -> None:
        self.check_model(_v1(request.path).removeprefix("/v1/models/"))
        await _send_json(responder, model_object(self.model_id, self.created), request_id)

    async def _chat(self, request: Request, responder: Responder, request_id: str) -> None:
        chat = parse_chat(parse_json(request.body))
        self.check_model(chat.params.model)
        prompt = render_chat(self.asker.tokenizer, chat)  # swarmctl/api/prompting.py (tools too)
        await self._generate(Envelope(chat=True, model=self.model_id), prompt.tokens, prompt.params, responder,
                             request_id, prompt.tools, prompt.schema_param)

    async def _completions(self, request: Request, responder: Responder, request_id: str) -> None:
        completion = parse_completion(parse_json(request.body))
        self.check_model(completion.params.model)
        if isinstance(completion.prompt, str):
            prompt = self.asker.tokenizer.encode_prompt(completion.prompt)
        else:
            prompt = completion.prompt  # a tuple: no copy of what may be millions of ids
            if len(prompt) < self.asker.max_context and max(prompt) >= self.asker.tokenizer.n_vocab:
                raise bad_request(f"token ids must be below the vocabulary size {self.asker.tokenizer.n_vocab}",
                                  "prompt")
        await self._generate(Envelope(chat=False, model=self.model_id), prompt, completion.params, responder,
                             request_id)

    # --- generation ---

    async def _generate(self, envelope: Envelope, prompt: Sequence[int], params: GenerationParams,
                        responder: Responder, request_id: str, tools: tuple[Tool, ...] = (),
                        schema_param: str = "response_format") -> None:
        async with self.generation(prompt, params, request_id, schema_param) as generation:
            if params.stream and not tools:
                await self._stream(envelope, generation, params, responder, request_id)
            elif params.stream:
                await self._stream_call(envelope, generation, params, responder, request_id, tools)
            else:
                async with aclosing(generation.pieces()) as pieces:
                    text = "".join([piece async for piece in pieces])
                logprobs = self._logprobs(envelope, generation) if generation.wants_logprobs else None
                call = parse_call(text, tools) if tools else None
                await _send_json(responder, envelope.response(text, generation.finish_reason, generation.usage,
                                                              logprobs, [call.as_dict()] if call else None),
                                 request_id)

    @asynccontextmanager
    async def generation(self, prompt: Sequence[int], params: GenerationParams, request_id: str,
                         schema_param: str = "response_format") -> AsyncIterator[TextGeneration]:
        """A request's generation, checked and started (admitted, its prompt prefilled, its first
        token out), closed and traced on exit; every API's routes generate through this."""
        context = self.asker.max_context
        if params.max_tokens_param is not None and params.max_tokens is not None and params.max_tokens > context:
            # As OpenAI: a limit no request could reach is refused, naming the most there is.
            raise ApiError(400, f"{params.max_tokens_param} is too large: {params.max_tokens}. This model's "
                                f"maximum context length is {context} tokens, prompt and completion together.",
                           param=params.max_tokens_param, code="invalid_value")
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        if len(prompt) >= context:
            raise context_exceeded(f"This model's maximum context length is {context} tokens; the prompt has "
                                   f"{len(prompt)}, which leaves no room for the completion.")
        # Like llama.cpp's server (and `swarmctl ask`), a completion that reaches the end of the
        # context stops there with finish_reason "length" rather than being refused up front.
        grammar = await self._grammar(params, schema_param)
        request = TextRequest(prompt, max_tokens=params.max_tokens or context, sampling=params.sampling,
                              stops=params.stop, logprobs=params.logprobs, grammar=grammar)
        generation = TextGeneration(self.asker, self.trunk, request, timeout=self.request_timeout,
                                    speculation=self.drafting.for_request(),
                                    prefixes=self.prefixes if params.cache_prompt else None)
        try:
            await generation.start()
            yield generation
        finally:
            await generation.aclose()
            await self._write_trace(request_id, generation)

    async def _grammar(self, params: GenerationParams, param: str) -> Grammar | None:
        """response_format (or a required call's schema) as a grammar for this request, built in
        a worker thread within its budget (kernels/grammar.py); a schema beyond the limits, one
        llama.cpp's converter cannot take, or one too costly to build is a 400."""
        if params.json_schema is None:
            return None
        try:
            return await build_grammar(self.asker.tokenizer, params.json_schema, budget_s=self.settings.grammar_build_s,
                                       step_budget_s=self.settings.grammar_step_s)
        except GrammarError as e:
            raise bad_request(str(e), param, code=grammar_error_code(e)) from None

    def _logprobs(self, envelope: Envelope, generation: TextGeneration, offset: int = 0) -> dict:
        """The log-probabilities of the tokens whose text has gone out since the last call, in the
        endpoint's shape (swarmctl/asker/logprobs.py computes them from the asker's logits)."""
        taken = generation.take_logprobs()
        piece = self.asker.tokenizer.piece
        return chat_logprobs(taken, piece) if envelope.chat else completion_logprobs(taken, piece, offset)

    async def _write_trace(self, request_id: str, generation: TextGeneration) -> None:
        """serve --trace: the request's steps, whether it finished or not. The answer has gone out
        already, so a file that cannot be written costs a log line, not the request."""
        gen = generation.generation
        if self.traces is None or not (gen.timings or gen.fill_timings):
            return
        try:
            await asyncio.to_thread(self.traces.write, request_id, gen)  # off the loop: other streams go on
        except TraceError as e:
            log.warning("%s: %s", request_id, e)

    async def _stream_call(self, envelope: Envelope, generation: TextGeneration, params: GenerationParams,
                           responder: Responder, request_id: str, tools: tuple[Tool, ...]) -> None:
        """A stream that may be a tool call: the answer is read whole first (a call is only a call
        once it parses), then sent as one call delta, or as text."""
        events = sse.EventStream(await responder.stream(200, sse.CONTENT_TYPE,
                                                        {**sse.HEADERS, "x-request-id": request_id}))
        await events.send(envelope.chunk("", first=True))
        try:
            async with aclosing(generation.pieces()) as pieces:
                text = "".join([piece async for piece in pieces])
        except Exception as e:  # noqa: BLE001 - the status is out: the error goes in the stream
            await _end_with_error(events, e, envelope, request_id)
            return
        logprobs = self._logprobs(envelope, generation) if generation.wants_logprobs else None
        call = parse_call(text, tools)
        if call is not None:
            await events.send(envelope.chunk(None, tool_calls=[call.as_dict()], logprobs=logprobs))
            await events.send(envelope.chunk(None, "tool_calls"))
        else:
            await events.send(envelope.chunk(text, logprobs=logprobs))
            await events.send(envelope.chunk(None, generation.finish_reason))
        if params.include_usage:
            await events.send(envelope.usage_chunk(generation.usage))
        await events.close()

    async def _stream(self, envelope: Envelope, generation: TextGeneration, params: GenerationParams,
                      responder: Responder, request_id: str) -> None:
        events = sse.EventStream(await responder.stream(200, sse.CONTENT_TYPE,
                                                        {**sse.HEADERS, "x-request-id": request_id}))
        if envelope.chat:
            await events.send(envelope.chunk("", first=True))
        offset = 0  # (completions' text_offset)
        async with aclosing(generation.pieces()) as pieces:
            while True:
                try:
                    text = await anext(pieces)
                except StopAsyncIteration:
                    break
                except Exception as e:  # noqa: BLE001 - the status is out: the error goes in the stream
                    await _end_with_error(events, e, envelope, request_id)
                    return
                logprobs = self._logprobs(envelope, generation, offset) if generation.wants_logprobs else None
                offset += len(text)
                await events.send(envelope.chunk(text, logprobs=logprobs))  # a ConnectionError here: the client is gone
        rest = self._logprobs(envelope, generation, offset) if generation.wants_logprobs else None
        await events.send(envelope.chunk(None if envelope.chat else "", generation.finish_reason, logprobs=rest))
        if params.include_usage:
            await events.send(envelope.usage_chunk(generation.usage))
        await events.close()


async def _end_with_error(events: sse.EventStream, e: Exception, envelope: Envelope, request_id: str) -> None:
    """A stream whose status is out already ends with an error event, as OpenAI's do."""
    error = from_exception(e)
    log.warning("%s %s stream -> %s", request_id, envelope.id, error.message)
    await events.send(error.body())
    await events.close(done=False)


def authorize(request: Request, api_key: str | None) -> None:
    """ApiError 401 unless the request carries the key (or no key is set)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "basic":  # a browser on the web page: any user name, the key as password
        try:
            key = base64.b64decode(key.strip(), validate=True).decode("utf-8").partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            key = ""
        scheme = "bearer"
    # Constant-time comparison: response timing says nothing about how much of a guess matched.
    if scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), api_key.encode()):
        return
    anthropic_key = request.headers.get("x-api-key")  # how Anthropic's clients send it
    if anthropic_key is not None and hmac.compare_digest(anthropic_key.strip().encode(), api_key.encode()):
        return
    message = "Incorrect API key provided." if header or anthropic_key is not None else \
        "You didn't provide an API key. Send it in an Authorization header: Bearer YOUR_KEY (or in x-api-key)."
    raise ApiError(401, message, code="invalid_api_key")


def check_key(request: Request, api_key: str | None) -> Refusal | None:
    """The gate on a request's head (its body unread): a Refusal, logged, when the key is missing or
    wrong. A request it lets through makes its connection trusted with a slot (swarmctl/api/http.py)."""
    try:
        authorize(request, api_key)
    except ApiError as error:
        # (a browser asks its user for the key: any user name, the key as password)
        return _refusal(request, error, {"WWW-Authenticate": 'Basic realm="swarmctl serve"'})
    return None


def check_head(request: Request, api_key: str | None, hosts: HostPolicy | None, *,
               bodies: bool = True) -> Refusal | None:
    """`serve`'s whole gate: a web page of another origin or a Host it does not answer for
    (swarmctl/api/browser.py), then the key, then (``bodies``) a body not declared JSON."""
    error = check_browser(request, hosts)
    if error is not None:
        return _refusal(request, error)
    refusal = check_key(request, api_key)
    if refusal is not None or not bodies:
        return refusal
    error = check_json_body(request)
    return _refusal(request, error) if error is not None else None


def _refusal(request: Request, error: ApiError, headers: dict[str, str] | None = None) -> Refusal:
    request_id = "req_" + secrets.token_hex(12)
    log.warning("%s %s %s -> %d %s", request_id, request.method, request.path[:200], error.status, error.message)
    return Refusal(error.status, encode_error(request.path, error), {"x-request-id": request_id, **(headers or {})})


def _drop_tracebacks(error: BaseException) -> None:
    """A handled error's traceback, and those of the errors it was raised from, hold the frames
    it passed through, and with them the request's body, its parsed JSON and its prompt, in
    reference cycles that only the garbage collector breaks, late (+180 MB per 16 MiB body of token
    ids, seen). Cut them now, so memory goes back as soon as the error has been answered."""
    pending, seen = [error], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        pending += [e.__cause__, e.__context__]


def describe_server(model_id: str, endpoints: list[str]) -> dict:
    """GET /: what this server is, for a person or a script that finds the address."""
    return {"object": "server", "name": "swarmctl serve", "model": model_id,
            "api": "OpenAI-compatible: use this address with /v1 as the base URL; Anthropic Messages API: "
                   "this address as the base URL", "endpoints": endpoints}


def _v1(path: str) -> str:
    """Clients whose base URL lacks /v1 still find the routes."""
    path = path.rstrip("/") or "/"
    return path if path == "/v1" or path.startswith("/v1/") else "/v1" + path


async def _send_json(responder: Responder, payload: dict, request_id: str) -> None:
    await responder.send(200, json.dumps(payload, ensure_ascii=False).encode("utf-8"),
                         headers={"x-request-id": request_id})
