"""`swarmctl serve`: the OpenAI-compatible API, driven by the official ``openai`` client.

The main server is the real command, run as a process on a loopback port with no swarm joined,
so it starts a local swarm (host + 2 trunk processes over QUIC). Its greedy answers must equal
`swarmctl ask --temperature 0`'s. Failures the swarm would rarely produce on cue (a link that
drops before or during a stream) come from a second server in this process whose trunk fails
when told to.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest

from swarmctl.api.errors import from_exception
from swarmctl.api.stops import StopScanner
from swarmctl.asker.head_tail import Asker, BusyError, TrunkResult
from swarmctl.commands.serve import is_loopback
from swarmctl.asker.link import SwarmError
from tests.serving import API_KEY, MODEL, Served, raw_request, served  # noqa: F401 - served: the shared fixture

CHAT_PROMPT = "Name the three primary colours."
RAW_PROMPT = "The three primary colours are"
MAX_TOKENS = 24
LOGPROB_TOLERANCE = 1e-3  # nats, the bound (measured here: 2e-7 at most)


def swarmctl(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swarmctl", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@dataclass
class AskResult:
    text: str
    prompt_tokens: int
    completion_tokens: int


def ask_greedy(prompt: str, *extra: str) -> AskResult:
    """`swarmctl ask --temperature 0` in one process; -v logs the token counts."""
    r = swarmctl("ask", "-v", "--transport", "inproc", "--temperature", "0", "--max-tokens", str(MAX_TOKENS),
                 *extra, prompt)
    assert r.returncode == 0, r.stderr
    counts = re.search(r"(\d+) prompt tokens, (\d+) generated", r.stderr)
    assert counts, r.stderr
    assert r.stdout.endswith("\n")
    return AskResult(r.stdout[:-1], int(counts[1]), int(counts[2]))


@pytest.fixture(scope="module")
def asked() -> dict[str, AskResult]:
    return {"chat": ask_greedy(CHAT_PROMPT), "raw": ask_greedy(RAW_PROMPT, "--raw")}


def assert_error_shape(body: dict, code: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


# --- against the real command and a local swarm ---


def test_models_lists_the_model_file_stem(served):
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.client().models.retrieve(MODEL).id == MODEL


def test_chat_greedy_equals_ask_streaming_or_not(served, asked):
    client = served.client()
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS)
    want = asked["chat"]
    assert whole.choices[0].message.content == want.text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == want.prompt_tokens
    assert whole.usage.completion_tokens == want.completion_tokens == MAX_TOKENS
    assert whole.usage.total_tokens == want.prompt_tokens + MAX_TOKENS
    assert whole.choices[0].finish_reason == "length"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                 max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_completion_greedy_equals_ask_raw_streaming_or_not(served, asked):
    client = served.client()
    want = asked["raw"]
    whole = client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0, max_tokens=MAX_TOKENS)
    assert whole.choices[0].text == want.text
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (want.prompt_tokens, MAX_TOKENS)
    assert whole.choices[0].finish_reason == "length"

    chunks = list(client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_cuts_the_text_where_it_first_appears(served, asked):
    client = served.client()
    full = asked["raw"].text
    stop = full[12:17]
    want = full[:full.index(stop)]
    whole = client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                      stop=[stop, "never appears"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (want, "stop")
    assert whole.usage.completion_tokens < MAX_TOKENS
    chunks = list(client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_repeats(served):
    client = served.client()

    def sample() -> str:
        return client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0.9, top_p=0.95, seed=7,
                                         max_tokens=12).choices[0].text

    assert sample() == sample()


def test_16_concurrent_streaming_clients_all_complete_with_their_solo_text(served, asked):
    """Half chat, half completion, all at once: each gets exactly its greedy solo answer (batches
    of quantized weights are bit-exact), and all are generating at the same time."""
    client = served.client()
    spans: list[tuple[float, float]] = []

    def one(i: int) -> str:
        if i % 2:
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                                    temperature=0, max_tokens=MAX_TOKENS, stream=True)
            texts = (c.choices[0].delta.content or "" for c in stream)
        else:
            stream = client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0,
                                               max_tokens=MAX_TOKENS, stream=True)
            texts = (c.choices[0].text for c in stream)
        text, first = "", None
        for piece in texts:
            first = first or (time.monotonic() if piece else None)
            text += piece
        spans.append((first, time.monotonic()))
        return text

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(16)))
    assert texts == [asked["chat" if i % 2 else "raw"].text for i in range(16)]
    # Batched, not one after another: every stream had started before the first one finished.
    assert max(start for start, _ in spans) < min(end for _, end in spans)


def test_error_cases_get_their_status_and_openai_shape(served):
    client = served.client()
    status, body = raw_request(served.base_url, "/chat/completions", b'{"model": ',
                               {"Authorization": f"Bearer {API_KEY}"})
    assert status == 400
    assert_error_shape(body)
    status, body = raw_request(served.base_url, "/completions", b'["a list"]', {"Authorization": f"Bearer {API_KEY}"})
    assert status == 400

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 5000, max_tokens=4)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=RAW_PROMPT, n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5)
    assert e.value.param == "temperature"

    with pytest.raises(openai.AuthenticationError) as e:
        served.client(api_key="wrong-key").models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    status, body = raw_request(served.base_url, "/models", None, method="GET")
    assert status == 401
    assert_error_shape(body, "invalid_api_key")

    status, body = raw_request(served.base_url, "/embeddings", b"{}", {"Authorization": f"Bearer {API_KEY}"})
    assert status == 404
    assert_error_shape(body)


def test_completion_logprobs_are_llama_cpp_pythons(served, oracle):
    """logprobs come from the logits the asker has: the model's log-softmax at each position, as
    llama-cpp-python reports it for the same greedy completion of the same GGUF."""
    got = served.client().completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0, max_tokens=MAX_TOKENS,
                                             logprobs=3)
    want = oracle.create_completion(RAW_PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=3)["choices"][0]
    assert got.choices[0].text == want["text"]
    ours, theirs = got.choices[0].logprobs, want["logprobs"]
    assert "".join(ours.tokens) == want["text"] and len(ours.tokens) == MAX_TOKENS
    gaps = [abs(a - b) for a, b in zip(ours.token_logprobs, theirs["token_logprobs"])]
    assert len(gaps) == MAX_TOKENS and max(gaps) < LOGPROB_TOLERANCE, gaps
    for mine, llama in zip(ours.top_logprobs, theirs["top_logprobs"]):
        assert len(mine) == 3
        shared = set(mine) & set(llama)
        assert len(shared) >= 2, (mine, llama)  # (a near tie for third place may differ)
        assert all(abs(mine[t] - llama[t]) < LOGPROB_TOLERANCE for t in shared)
    assert ours.text_offset == [sum(len(t) for t in ours.tokens[:i]) for i in range(MAX_TOKENS)]


def test_chat_logprobs_stream_or_not_and_greedy_picks_the_top_one(served, asked):
    client = served.client()
    messages = [{"role": "user", "content": CHAT_PROMPT}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == asked["chat"].text
    assert len(content) == MAX_TOKENS
    assert b"".join(bytes(c.bytes) for c in content).decode() == asked["chat"].text
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob == c.top_logprobs[0].logprob and c.token == c.top_logprobs[0].token  # greedy: the argmax
        assert c.logprob <= 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    assert plain.choices[0].logprobs is None
    for bad in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": 2}, {"logprobs": "yes"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **bad)
        assert e.value.param in ("logprobs", "top_logprobs"), bad
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=RAW_PROMPT, max_tokens=4, logprobs=6)
    assert e.value.param == "logprobs"


SCHEMAS = {  # bounded (maxLength, maxItems) so that a small model's answer ends within max_tokens
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                              "age": {"type": "integer"}}, "required": ["name", "age"]},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                              "sure": {"type": "boolean"}}, "required": ["colour", "sure"]},
    "nested": {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["name", "country"]}}, "required": ["city"]},
    "array": {"type": "object", "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                           "minItems": 1, "maxItems": 3}}, "required": ["colours"]},
    "number": {"type": "object", "properties": {"celsius": {"type": "integer", "minimum": -40, "maximum": 50},
                                                "ratio": {"type": "number"}, "unit": {"const": "C"}},
               "required": ["celsius", "ratio", "unit"]},
}
JSON_PROMPTS = ["Name the three primary colours.", "Describe the city of Paris in a few words."]


def test_json_schema_answers_validate_stream_or_not(served):
    """response_format at the asker: llama.cpp's grammar engine masks the logits, so even the
    135M model answers JSON that parses and validates, for every schema and prompt."""
    import jsonschema

    client = served.client()
    for name, schema in SCHEMAS.items():
        for prompt in JSON_PROMPTS:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0.7, seed=3,
                max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
            assert r.choices[0].finish_reason == "stop", (name, prompt, r.choices[0].message.content)
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": JSON_PROMPTS[1]}], max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "nested", "schema": SCHEMAS["nested"]}}))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)),
                        SCHEMAS["nested"])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": JSON_PROMPTS[0]}],
                                       max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": JSON_PROMPTS[0]}],
                                           temperature=0, max_tokens=12)
    assert not plain.choices[0].message.content.lstrip().startswith("{")  # (what the grammar changed)
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/gone"}}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           response_format=bad)
        assert e.value.param == "response_format", bad


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}


def _valid_call(call, tools=(WEATHER, CLOCK)):
    import jsonschema

    (tool,) = [t for t in tools if t["function"]["name"] == call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.type == "function" and call.id.startswith("call_")


def test_the_official_clients_tool_calling_loop(served):
    """tools with tool_choice required (or a named function): the answer is constrained to the
    tools' schemas, so the 135M model calls a tool with valid arguments; its result goes back as a
    role "tool" message, and the next answer is text."""
    client = served.client()
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                           tool_choice="required", max_tokens=120, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    _valid_call(call)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                            tool_choice="none", max_tokens=30, temperature=0)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls

    named = client.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER, CLOCK], max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    _valid_call(named.choices[0].message.tool_calls[0])

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER],
                                                 tool_choice="required", max_tokens=120, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0
    _valid_call(deltas[0][0], (WEATHER,))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
                {"tool_choice": "required"}, {"tools": [{"type": "function", "function": {}}]}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=4, **bad)
        assert e.value.param.startswith(("tool_choice", "tools")), bad


def test_server_logs_one_line_per_error_and_no_traceback(served):
    log = served.stderr.read_text()
    assert "Traceback" not in log
    assert "WITHOUT AN API KEY" not in log  # loopback, and a key: no warning
    assert re.search(r"POST /v1/chat/completions -> 404 The model 'gpt-4o' does not exist", log)


def test_a_client_polling_during_start_up_gets_503_with_retry_after(served):
    """Issue 29, item 14: while the local swarm came up, a polling client's requests waited in the
    listen backlog, gave up, and the server then logged each as "unreadable request -> 500"."""
    answers = served.starting
    assert any(status == 503 for status, _ in answers), answers
    before_ready = answers[:-1] if answers[-1][0] == 200 else answers  # the last may land just after "serving"
    assert all(status in (503, 0) for status, _ in before_ready), answers  # 0: the client gave up (a loaded box)
    assert all(retry_after == "2" for status, retry_after in before_ready if status == 503), answers
    log = served.stderr.read_text()
    assert "unreadable request" not in log and "-> 500" not in log, log


def test_the_root_says_what_the_server_is(served):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("", "/v1"):
        status, body = raw_request(served.base_url.removesuffix("/v1"), path or "/", None, headers, method="GET")
        assert status == 200, body
        assert body["model"] == MODEL
        assert {"GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions"} <= set(body["endpoints"])
    status, body = raw_request(served.base_url.removesuffix("/v1"), "/", None, method="GET")
    assert status == 401  # the key guards it too
    assert_error_shape(body, "invalid_api_key")


# --- in this process: a trunk that fails on cue ---


class CueTrunk:
    """The trunk of a model whose head and tail are all of it (head_layers = L/2): passes the
    activations through, or fails like a dropped swarm link after ``fail_after`` calls."""

    def __init__(self) -> None:
        self.fail_after: int | None = None
        self.calls = 0

    async def forward(self, request_id: bytes, hidden: np.ndarray, start_pos: int, *, rewind: bool = False,
                      verify: bool = False) -> TrunkResult:
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise SwarmError("lost the connection to trunk-1")
        return TrunkResult(hidden, (), 0.0)

    async def release(self, request_id: bytes) -> None:
        pass


class InprocServer:
    """An ApiServer on an event loop in a thread, so tests can also look at the asker."""

    def __init__(self, model: Path, head_layers: int = 15, model_id: str = MODEL) -> None:
        """``head_layers``: at each end; the two ends are the whole model (the trunk a cue only)."""
        from swarmctl.api.server import ApiServer

        self.trunk = CueTrunk()
        self.asker = Asker(model, head_layers, n_threads=1)
        self.api = ApiServer(self.asker, self.trunk, model_id)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = self.call(self.api.start("127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    def close(self) -> None:
        self.call(_cancel_other_tasks())
        self.server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.asker.close()


async def _cancel_other_tasks() -> None:
    """Kept-alive client connections end with the server."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def inproc(bundled_model):
    server = InprocServer(bundled_model)
    yield server
    server.close()


@pytest.fixture
def trunk(inproc):
    inproc.trunk.fail_after, inproc.trunk.calls = None, 0
    yield inproc.trunk
    inproc.trunk.fail_after = None


def test_swarm_unavailable_is_503_streaming_or_not(inproc, trunk):
    trunk.fail_after = 0
    client = inproc.client()
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt=RAW_PROMPT, max_tokens=4)
    assert e.value.status_code == 503 and e.value.code == "swarm_unavailable"
    assert "lost the connection to trunk-1" in e.value.message
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    assert e.value.status_code == 503
    assert not inproc.asker.in_flight


def test_link_lost_mid_stream_ends_it_with_an_error_event(inproc, trunk):
    trunk.fail_after = 4
    stream = inproc.client().completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0, max_tokens=20,
                                                stream=True)
    pieces = []
    with pytest.raises(openai.APIError, match="lost the connection to trunk-1"):
        for chunk in stream:
            pieces.append(chunk.choices[0].text)
    assert len(pieces) == 4
    assert not inproc.asker.in_flight


def test_client_leaving_mid_stream_frees_its_request(inproc, trunk):
    stream = inproc.client().completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=500,
                                                stream=True)
    for _, chunk in zip(range(3), stream):
        pass
    assert len(inproc.asker.in_flight) == 1
    generation = next(iter(inproc.asker.in_flight.values()))
    stream.close()
    deadline = time.monotonic() + 10
    while inproc.asker.in_flight:
        assert time.monotonic() < deadline, "the request kept running after its client left"
        time.sleep(0.05)
    assert len(generation.tokens) < 100 and generation.finish_reason is None


def test_keep_alive_serves_requests_one_after_another_on_one_connection(inproc):
    conn = http.client.HTTPConnection("127.0.0.1", inproc.port, timeout=30)
    body = json.dumps({"model": MODEL, "prompt": RAW_PROMPT, "temperature": 0, "max_tokens": 3})
    for _ in range(2):
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Connection") == "keep-alive"
        assert json.loads(response.read())["usage"]["completion_tokens"] == 3
    sock = conn.sock
    conn.request("GET", "/v1/models")
    assert conn.getresponse().read() and conn.sock is sock
    conn.close()


def test_malformed_http_gets_a_400_in_openai_shape(inproc):
    import socket

    with socket.create_connection(("127.0.0.1", inproc.port), timeout=10) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        reply = b""
        while data := s.recv(65536):  # the server closes the connection after answering
            reply += data
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 400 ")
    assert_error_shape(json.loads(reply.split("\r\n\r\n", 1)[1]))


def test_while_starting_every_request_is_a_503_with_retry_after_then_the_api_answers(inproc):
    """`serve`'s front door (swarmctl/api/startup.py): 503 + Retry-After and the key checked until
    the API is handed over, then the API's routes on the same listener."""
    from swarmctl.api.errors import http_error_body
    from swarmctl.api.http import start_server
    from swarmctl.api.server import ApiServer, ApiSettings
    from swarmctl.api.startup import StartingServer

    front = StartingServer(API_KEY)
    server = inproc.call(start_server(front.handle, error_body=http_error_body, gate=front.check_head,
                                      host="127.0.0.1", port=0))
    base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    key = {"Authorization": f"Bearer {API_KEY}"}
    body = json.dumps({"model": MODEL, "prompt": RAW_PROMPT, "max_tokens": 2}).encode()
    try:
        for path, data in (("/", None), ("/v1/models", None), ("/v1/completions", body)):
            request = urllib.request.Request(base + path, data=data, headers=key)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=30)
            assert e.value.code == 503 and e.value.headers["Retry-After"] == "2"
            assert_error_shape(json.loads(e.value.read()), "starting")
        assert raw_request(base, "/v1/models", None, method="GET")[0] == 401  # no key: refused, starting or not
        front.ready(ApiServer(inproc.asker, inproc.trunk, MODEL, ApiSettings(api_key=API_KEY)))
        assert raw_request(base, "/v1/completions", body, key)[0] == 200
        status, described = raw_request(base, "/", None, key, method="GET")
        assert status == 200 and described["model"] == MODEL
    finally:
        server.close()
        inproc.call(server.wait_closed())


# --- hostile clients (issue 14, finding 9): each of these failed on the code before the fix ---

MIB = 1024 * 1024


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def port_of(base_url: str) -> int:
    return int(base_url.rsplit(":", 1)[1].split("/")[0])


def read_response(sock) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response with a Content-Length body, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without answering: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(lines[0].split(" ")[1]), headers, body


def head_bytes(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def still_serves(base_url: str) -> None:
    """Other clients are undisturbed: a fresh one is answered, and correctly."""
    client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
    try:
        assert [m.id for m in client.models.list().data] == [MODEL]
        done = client.completions.create(model=MODEL, prompt=RAW_PROMPT, temperature=0, max_tokens=2)
        assert done.usage.completion_tokens == 2
    finally:
        client.close()


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key"])
def test_a_bad_key_is_refused_before_the_body_is_read(served, authorization):
    """A client without the key announces a 16 MiB body and sends 1 KiB of it: the 401 comes at
    once, from the head alone, and the connection closes (its unread body cannot be mistaken for
    a next request)."""
    import socket

    from swarmctl.api.http import MAX_BODY_BYTES

    headers = {"Content-Type": "application/json", "Content-Length": str(MAX_BODY_BYTES)}
    if authorization:
        headers["Authorization"] = authorization
    with socket.create_connection(("127.0.0.1", port_of(served.base_url)), timeout=20) as s:
        s.sendall(head_bytes("POST", "/v1/chat/completions", headers) + b" " * 1024)
        status, reply_headers, body = read_response(s)  # before: no answer until the whole body came
        assert status == 401 and reply_headers["connection"] == "close"
        assert_error_shape(json.loads(body), "invalid_api_key")
    still_serves(served.base_url)


def test_keyless_clients_sending_large_bodies_do_not_grow_the_server(served):
    """20 connections without a key each send a 16 MiB body but its last byte and hold on. Before,
    the server buffered every one (+320 MB); now it answers 401 after the head and discards what
    follows. Bound: 80 MB over the serve process's RSS before, a quarter of what was buffered."""
    import socket

    from swarmctl.api.http import MAX_BODY_BYTES

    before = rss_mb(served.process.pid)
    body = b" " * (MAX_BODY_BYTES - 1)
    head = head_bytes("POST", "/v1/completions", {"Content-Type": "application/json",
                                                  "Content-Length": str(MAX_BODY_BYTES)})
    sockets = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port_of(served.base_url)), timeout=30)
            sockets.append(s)
            try:
                s.sendall(head + body)
            except OSError:
                pass  # the server may stop reading a refused body and close: that is fine
        after = rss_mb(served.process.pid)
    finally:
        for s in sockets:
            s.close()
    assert after - before < 80, f"serve grew from {before:.0f} to {after:.0f} MB"
    still_serves(served.base_url)


def test_large_bodies_with_the_key_are_held_within_a_budget(served):
    """24 connections with the key each send a 16 MiB body but its last byte and hold on. Before,
    the server buffered all of them (+384 MB); now bodies held at once are capped at 64 MiB (4 of
    these), and the rest are answered 503 at once. Bound: 150 MB over the RSS before."""
    import socket

    from swarmctl.api.http import MAX_BODY_BYTES

    before = rss_mb(served.process.pid)
    body = b" " * (MAX_BODY_BYTES - 1)
    head = head_bytes("POST", "/v1/completions", {"Content-Type": "application/json", "Authorization":
                                                  f"Bearer {API_KEY}", "Content-Length": str(MAX_BODY_BYTES)})
    sockets, answers = [], []
    try:
        for _ in range(24):
            s = socket.create_connection(("127.0.0.1", port_of(served.base_url)), timeout=30)
            sockets.append(s)
            try:
                s.sendall(head + body)
            except OSError:
                pass  # the server may stop reading a refused body and close: that is fine
        after = rss_mb(served.process.pid)
        for s in sockets[4:]:
            try:
                status, _, reply = read_response(s)
                answers.append((status, json.loads(reply)["error"]["code"]))
            except (OSError, AssertionError):
                pass  # a reset after the server stopped draining; the answer may be lost with it
    finally:
        for s in sockets:
            s.close()
    assert after - before < 150, f"serve grew from {before:.0f} to {after:.0f} MB"
    assert answers and set(answers) == {(503, "too_many_large_requests")}
    still_serves(served.base_url)


def test_a_refused_huge_prompt_is_freed_once_answered(served):
    """Three 16 MiB bodies of token ids, one after another, each refused for its length (400). The
    parsed ids (~150 MB each) used to stay in reference cycles through the error's traceback until
    the garbage collector ran (+470 MB after three); now they go when the 400 is out. Bound: 300 MB
    over the RSS before, for all three (the allocator keeps some of what was freed)."""
    import socket

    from swarmctl.api.http import MAX_BODY_BYTES

    ids = (MAX_BODY_BYTES - 200) // 2
    body = b'{"model": "%s", "prompt": [' % MODEL.encode() + b"1," * ids + b'1]}'
    assert len(body) <= MAX_BODY_BYTES
    head = head_bytes("POST", "/v1/completions", {"Content-Type": "application/json", "Authorization":
                                                  f"Bearer {API_KEY}", "Content-Length": str(len(body))})
    before = rss_mb(served.process.pid)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port_of(served.base_url)), timeout=60) as s:
            s.sendall(head + body)
            status, _, reply = read_response(s)
        assert status == 400 and json.loads(reply)["error"]["code"] == "context_length_exceeded"
    after = rss_mb(served.process.pid)
    assert after - before < 300, f"serve grew from {before:.0f} to {after:.0f} MB"
    still_serves(served.base_url)


def test_connections_beyond_the_limit_get_a_quick_503(served):
    """`serve` caps concurrent connections (--max-connections, default 64): opening more, each
    with a request, the 65th at the latest is answered 503 in OpenAI's shape and closed; once
    connections close, new ones are served again."""
    import socket

    request = head_bytes("GET", "/v1/models", {"Authorization": f"Bearer {API_KEY}"})
    held, refused = [], None
    try:
        for _ in range(65):
            s = socket.create_connection(("127.0.0.1", port_of(served.base_url)), timeout=20)
            s.sendall(request)
            status, headers, body = read_response(s)
            if status != 200:
                s.close()
                refused = (status, headers, body)
                break
            held.append(s)
    finally:
        for s in held:
            s.close()
    assert refused is not None, "65 connections at once were all served"
    status, headers, body = refused
    assert status == 503 and headers["connection"] == "close"
    assert_error_shape(json.loads(body), "too_many_connections")
    assert 0 < len(held) <= 64
    for _ in range(100):  # the server notices the closed connections a moment later
        status, _ = raw_request(served.base_url, "/models", None, {"Authorization": f"Bearer {API_KEY}"}, "GET")
        if status == 200:
            break
        time.sleep(0.1)
    assert status == 200
    still_serves(served.base_url)


def test_the_head_limit_is_the_configured_one(inproc):
    """A request head of exactly MAX_HEAD_BYTES is read; one byte more gets 431 (before, heads of
    up to about twice the limit were read)."""
    import socket

    from swarmctl.api.http import MAX_HEAD_BYTES

    def head_of(size: int) -> bytes:
        base = head_bytes("GET", "/v1/models", {"X-Filler": ""})
        return base.replace(b"X-Filler: ", b"X-Filler: " + b"a" * (size - len(base)))

    for size, want in ((MAX_HEAD_BYTES, 200), (MAX_HEAD_BYTES + 1, 431), (MAX_HEAD_BYTES + 1024, 431)):
        head = head_of(size)
        assert len(head) == size
        with socket.create_connection(("127.0.0.1", inproc.port), timeout=20) as s:
            s.sendall(head)
            status, _, body = read_response(s)
        assert status == want, f"a head of {size} bytes got {status}"
        if want != 200:
            assert_error_shape(json.loads(body))


@pytest.mark.parametrize("content_length", ["\xb2", "\u0661", "9" * 400])
def test_a_malformed_content_length_is_a_400(inproc, content_length):
    """Before: "²" passed str.isdigit() and then int() raised in the connection: no answer at all."""
    import socket

    with socket.create_connection(("127.0.0.1", inproc.port), timeout=20) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {content_length}\r\n\r\n"
                  .encode("utf-8" if content_length == "\u0661" else "latin-1"))
        status, headers, body = read_response(s)
    assert status in (400, 413) and headers["connection"] == "close"
    assert_error_shape(json.loads(body))


NESTING = 100_000


@pytest.mark.parametrize("body", [
    b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode(),
    b'{"model": "%s", "prompt": "a lone \\udc00 surrogate", "max_tokens": 2}' % MODEL.encode(),
    b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}' % MODEL.encode(),
    b"[" * NESTING + b"]" * NESTING,
    b'{"a": ' * NESTING + b"1" + b"}" * NESTING,
    b'{"model": "%s", "messages": [{"role": "user", "content": "\xff\xfe"}]}' % MODEL.encode(),
    b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (MODEL.encode(), b"7" * 5000),
    b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % MODEL.encode(),
    json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode("utf-16"),
], ids=["surrogate-chat", "surrogate-prompt", "surrogate-key", "nested-arrays", "nested-objects",
        "invalid-utf8", "5000-digits", "nan", "utf16"])
def test_an_undecodable_body_is_a_400(inproc, body):
    path = "/completions" if b'"prompt"' in body or b'"\x00p' in body else "/chat/completions"
    status, reply = raw_request(inproc.base_url, path, body)
    assert status == 400, reply
    assert_error_shape(reply)
    assert reply["error"]["type"] == "invalid_request_error"
    assert inproc.client().completions.create(model=MODEL, prompt=RAW_PROMPT, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("route, name", [("chat", "max_tokens"), ("chat", "max_completion_tokens"),
                                         ("completions", "max_tokens")])
def test_max_tokens_beyond_the_context_is_a_400_naming_the_maximum(inproc, route, name):
    """As OpenAI: a max_tokens no request could reach is refused, and the message says the limit."""
    client = inproc.client()
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           stream=True, **{name: 10**12})
        else:
            client.completions.create(model=MODEL, prompt=RAW_PROMPT, stream=True, **{name: 10**12})
    assert e.value.param == name
    assert f"{inproc.asker.max_context}" in e.value.message
    assert not inproc.asker.in_flight


def test_hostile_bodies_leave_one_log_line_each_and_no_traceback(served):
    for body in (b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode(),
                 b"[" * NESTING + b"]" * NESTING):
        status, reply = raw_request(served.base_url, "/chat/completions", body,
                                    {"Authorization": f"Bearer {API_KEY}"})
        assert status == 400
        assert_error_shape(reply)
    log = served.stderr.read_text()
    assert "Traceback" not in log and "internal error" not in log
    still_serves(served.base_url)


# --- small parts ---


def test_busy_maps_to_503():
    error = from_exception(BusyError("the swarm is busy (16 requests in flight); gave up after waiting 600s"))
    assert error.status == 503 and error.body()["error"]["type"] == "server_error"


@pytest.mark.parametrize("pieces, stops, want", [
    (["Hello", " wor", "ld", "!"], ["world"], ("Hello ", True)),
    (["a\n", "\nb"], ["\n\n"], ("a", True)),
    (["EN", "x", "D"], ["END"], ("ENxD", False)),
    (["abc"], [], ("abc", False)),
    (["xy", "z"], ["yz", "xyz!"], ("x", True)),
])
def test_stop_scanner_never_releases_a_stop_string(pieces, stops, want):
    scanner, text, stopped = StopScanner(stops), "", False
    for piece in pieces:
        released, stopped = scanner.push(piece)
        text += released
        assert not any(s in text for s in stops)
        if stopped:
            break
    if not stopped:
        text += scanner.flush()
    assert (text, stopped) == want


def test_open_address_without_a_key_warns_loudly(tmp_path):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    # The warning comes before anything else; a missing model then stops the command.
    r = swarmctl("serve", "--host", "0.0.0.0", "--port", "0", "--transport", "inproc",
                 "--model", str(tmp_path / "none.gguf"))
    assert r.returncode == 1
    assert "WARNING: serving on 0.0.0.0 WITHOUT AN API KEY" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("swarmctl: error: model file not found")


def test_speculative_steps_report_predictions_in_usage_and_keep_the_text(inproc, trunk):
    """serve --speculate ngram: the same greedy text, and usage says how many drafted tokens were
    kept and thrown away (OpenAI's completion_tokens_details names for predicted outputs)."""
    from swarmctl.asker.speculate import Drafting

    prompt = "Repeat after me: red green blue, red green blue, red green blue, red green blue,"
    client = inproc.client()
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert plain.usage.completion_tokens_details is None
    inproc.api.drafting = Drafting("ngram")
    try:
        spec = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    finally:
        inproc.api.drafting = Drafting()
    assert spec.choices[0].text == plain.choices[0].text
    details = spec.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    assert spec.usage.completion_tokens == plain.usage.completion_tokens


def test_drafts_are_checked_against_the_grammar_too(inproc, trunk):
    """serve --speculate ngram with response_format: a draft the grammar forbids is never kept, so
    greedy structured answers are the same with speculation as without, and still validate."""
    import jsonschema

    from swarmctl.asker.speculate import Drafting

    schema = {"type": "object", "properties": {"colours": {"type": "array", "maxItems": 6, "items": {
        "enum": ["red", "green", "blue"]}}}, "required": ["colours"]}
    prompt = "Repeat after me: red green blue, red green blue, red green blue. Now as JSON:"
    fmt = {"type": "json_schema", "json_schema": {"name": "colours", "schema": schema}}
    client = inproc.client()
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0,
                                      extra_body={"response_format": fmt})
    inproc.api.drafting = Drafting("ngram")
    try:
        spec = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, temperature=0,
                                         extra_body={"response_format": fmt})
    finally:
        inproc.api.drafting = Drafting()
    assert spec.choices[0].text == plain.choices[0].text
    jsonschema.validate(json.loads(spec.choices[0].text), schema)
    assert spec.usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_tool_choice_auto_takes_an_answer_as_a_call_only_when_it_is_one():
    from swarmctl.api.tools import Tool, parse_call

    tools = (Tool("get_weather", "", {"type": "object"}),)
    call = parse_call(' {"name": "get_weather", "arguments": {"city": "Oslo"}}\n', tools)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert parse_call('{"name": "rm_rf", "arguments": {}}', tools) is None
    assert parse_call("It is sunny in Oslo.", tools) is None
    assert parse_call('["get_weather"]', tools) is None


TOOLS_TEMPLATE = (  # a chat template that knows tools, Hermes style (written into a tiny model below)
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_knows_tools_renders_them_and_its_calls_parse(tmp_path, bundled_model):
    """A GGUF whose chat template knows tools gets them through the template (no fallback prompt),
    earlier calls as tool_calls; a call in its <tool_call> form is parsed; auto answers whatever the
    (random, tiny) model says, required gives a valid call, and a tool's result goes back."""
    from harness.tiny_models import TinyConfig, write_tiny_model
    from kernels.tokenizer import Tokenizer
    from swarmctl.api.tools import Tool, parse_call

    model = write_tiny_model(tmp_path / "tools.gguf", TinyConfig(chat_template=TOOLS_TEMPLATE), bundled_model)
    tokenizer = Tokenizer(model)
    assert tokenizer.knows_tools and not Tokenizer(bundled_model).knows_tools
    tools = (Tool("get_weather", "The weather now", WEATHER["function"]["parameters"]),)
    rendered = tokenizer.decode(tokenizer.encode_chat([{"role": "user", "content": "Weather in Oslo?"}],
                                                      [t.as_openai() for t in tools]))
    assert '"name": "get_weather"' in rendered and "You can call these tools" not in rendered
    call = parse_call('<tool_call>\n{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}\n'
                      '</tool_call>', tools)
    assert call is not None and json.loads(call.arguments) == {"city": "Oslo", "unit": "celsius"}

    server = InprocServer(model, head_layers=2, model_id="tools")
    try:
        client = server.client()
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        auto = client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER], max_tokens=8,
                                              temperature=0)
        assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
        required = client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER], max_tokens=120,
                                                  tool_choice="required", temperature=0)
        (call,) = required.choices[0].message.tool_calls
        _valid_call(call, (WEATHER,))
        messages += [required.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, clear"}]
        after = client.chat.completions.create(model="tools", messages=messages, tools=[WEATHER], max_tokens=4,
                                               tool_choice="none", temperature=0)
        assert after.choices[0].finish_reason in ("length", "stop")
    finally:
        server.close()


def test_a_conversation_reuses_its_prefix_and_answers_as_without(served):
    """serve keeps each prompt's cells at the asker and every stage (swarmctl/asker/prefixes.py):
    a conversation's next turn reports the reused prompt tokens as OpenAI does
    (usage.prompt_tokens_details.cached_tokens) and answers as a request without reuse
    (llama.cpp's cache_prompt false); a client that edits an earlier turn reuses up to the edit."""
    client = served.client()
    messages = [{"role": "system", "content": "You are a terse assistant. " * 20},
                {"role": "user", "content": "Name a colour."}]
    cached = []
    for turn in ("Name another one.", "And a third?"):
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                               extra_body={"cache_prompt": False})
        reused = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        assert reused.choices[0].message.content == plain.choices[0].message.content
        assert plain.usage.prompt_tokens_details.cached_tokens == 0
        cached.append(reused.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < reused.usage.prompt_tokens
        messages += [{"role": "assistant", "content": reused.choices[0].message.content},
                     {"role": "user", "content": turn}]
    edited = [messages[0], {"role": "user", "content": "Name a fruit."}, *messages[2:]]
    plain = client.chat.completions.create(model=MODEL, messages=edited, max_tokens=8, temperature=0,
                                           extra_body={"cache_prompt": False})
    reused = client.chat.completions.create(model=MODEL, messages=edited, max_tokens=8, temperature=0)
    assert reused.choices[0].message.content == plain.choices[0].message.content
    # the first turn shares at most the chat template's opening with earlier requests; the second
    # reuses the whole first prompt; the edit keeps only what comes before the edited turn
    assert cached[0] < 10 and cached[1] > 100
    assert 100 < reused.usage.prompt_tokens_details.cached_tokens < cached[1]
    status, body = raw_request(served.base_url, "/chat/completions",
                               json.dumps({"model": MODEL, "messages": messages, "cache_prompt": "yes"}).encode(),
                               {"Authorization": f"Bearer {API_KEY}"})
    assert status == 400 and body["error"]["param"] == "cache_prompt"
