"""`swarmctl serve`'s Anthropic Messages API, driven by the official ``anthropic`` client against
the real command with a local swarm behind it (tests/serving.py). Greedy answers must equal the
OpenAI endpoint's for the same conversation: the two APIs render one chat template and share one
generation path.

(The client has no ``temperature``/``top_k`` arguments any more; they go in ``extra_body``, as
the API still takes them.)
"""

from __future__ import annotations

import json
import socket
import urllib.request

import anthropic
import jsonschema
import pytest

from tests.serving import API_KEY, MODEL, raw_request, served  # noqa: F401 - served: the shared fixture

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "Name the three primary colours."
GREEDY = {"temperature": 0}
MAX_TOKENS = 24
WEATHER = {"name": "get_weather", "description": "The weather now in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"]}}


def client(served, **kwargs) -> anthropic.Anthropic:
    """Its base URL is the server's root: the client adds /v1/messages."""
    kwargs.setdefault("api_key", API_KEY)
    return anthropic.Anthropic(base_url=served.base_url.removesuffix("/v1"), max_retries=0, timeout=120, **kwargs)


def openai_greedy(served, messages: list[dict], max_tokens: int = MAX_TOKENS, **extra):
    return served.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                   max_tokens=max_tokens, **extra)


def sse_events(base_url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed request's (event name, data) pairs, read off the wire."""
    request = urllib.request.Request(base_url.removesuffix("/v1") + "/v1/messages", data=json.dumps(body).encode(),
                                     headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = response.read().decode()
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_plain_greedy_answer_equals_the_openai_endpoints(served):
    want = openai_greedy(served, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    got = client(served).messages.create(model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM, extra_body=GREEDY,
                                         messages=[{"role": "user", "content": QUESTION}],
                                         extra_headers={"anthropic-version": "2023-06-01"})
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_") and got.model == MODEL
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.choices[0].message.content
    # The OpenAI request kept this prompt's cells: computed and taken from the kept prefix add up to it.
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert got.usage.cache_read_input_tokens > 0
    assert got.usage.output_tokens == want.usage.completion_tokens
    finish = want.choices[0].finish_reason
    assert got.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish] and got.stop_sequence is None
    # system as text blocks is the same system
    blocks = client(served).messages.create(model=MODEL, max_tokens=MAX_TOKENS, extra_body=GREEDY,
                                            system=[{"type": "text", "text": SYSTEM}],
                                            messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert blocks.content[0].text == got.content[0].text


def test_multi_turn_with_stop_sequences_and_sampling_parameters(served):
    history = [{"role": "user", "content": "My name is Ada. Remember it."},
               {"role": "assistant", "content": "Nice to meet you, Ada."},
               {"role": "user", "content": "Write a sentence that uses my name."}]
    want = openai_greedy(served, history, max_tokens=40).choices[0].message.content
    c = client(served)
    whole = c.messages.create(model=MODEL, max_tokens=40, messages=history, extra_body=GREEDY)
    assert whole.content[0].text == want
    stop = want[10:14]
    cut = c.messages.create(model=MODEL, max_tokens=40, messages=history, stop_sequences=["never there", stop],
                            extra_body={"temperature": 0, "top_p": 0.5, "top_k": 5})
    assert cut.content[0].text == want[:want.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    short = c.messages.create(model=MODEL, max_tokens=3, messages=history, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_streamed_events_carry_the_same_answer(served):
    messages = [{"role": "user", "content": QUESTION}]
    want = client(served).messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages, extra_body=GREEDY)
    with client(served).messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                                        extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.content[0].text == final.content[0].text
    assert final.stop_reason == want.stop_reason
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        want.usage.input_tokens + want.usage.cache_read_input_tokens
    assert final.usage.output_tokens == want.usage.output_tokens

    events = sse_events(served.base_url, {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": messages,
                                          "temperature": 0, "stream": True})
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == \
        want.usage.input_tokens + want.usage.cache_read_input_tokens
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == want.content[0].text
    assert events[-2][1]["delta"]["stop_reason"] == want.stop_reason


def test_a_tool_loop_use_then_result_then_answer(served):
    """tool_choice any: the answer is constrained to the tools' schemas, so the 135M model calls a
    tool with valid arguments; the tool_result goes back in a user turn and the next answer is text,
    the same text the OpenAI endpoint gives for the same conversation."""
    c = client(served)
    question = "What is the weather in Paris right now?"
    messages = [{"role": "user", "content": question}]
    first = c.messages.create(model=MODEL, max_tokens=120, messages=messages, tools=[WEATHER],
                              tool_choice={"type": "any"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    result = json.dumps({"temperature": 18, "sky": "clear"})
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": result}]}]
    second = c.messages.create(model=MODEL, max_tokens=30, messages=messages, tools=[WEATHER],
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in second.content] == ["text"] and second.content[0].text
    openai_messages = [{"role": "user", "content": question},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": result}]
    want = openai_greedy(served, openai_messages, max_tokens=30,
                         tools=[{"type": "function", "function": {"name": WEATHER["name"],
                                                                  "description": WEATHER["description"],
                                                                  "parameters": WEATHER["input_schema"]}}],
                         tool_choice="none")
    assert second.content[0].text == want.choices[0].message.content

    named = c.messages.create(model=MODEL, max_tokens=120, messages=messages[:1], tools=[WEATHER],
                              tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert named.content[0].input == use.input  # greedy: the same call
    with c.messages.stream(model=MODEL, max_tokens=120, messages=messages[:1], tools=[WEATHER],
                           tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input
    events = sse_events(served.base_url, {"model": MODEL, "max_tokens": 120, "messages": messages[:1],
                                          "tools": [WEATHER], "tool_choice": {"type": "any"}, "temperature": 0,
                                          "stream": True})
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert events[2][1]["content_block"]["type"] == "tool_use" and events[2][1]["content_block"]["input"] == {}
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in deltas)) == use.input


def test_count_tokens_is_what_the_message_is_charged(served):
    c = client(served)
    messages = [{"role": "user", "content": QUESTION}]
    counted = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    charged = c.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=messages, extra_body=GREEDY)
    assert counted.input_tokens == charged.usage.input_tokens + charged.usage.cache_read_input_tokens > 0
    with_tools = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens  # the tools are told to the model


def test_bearer_works_as_well_as_x_api_key(served):
    c = anthropic.Anthropic(base_url=served.base_url.removesuffix("/v1"), auth_token=API_KEY, api_key=None,
                            max_retries=0, timeout=120)
    assert c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0


def assert_anthropic_error(body: dict, kind: str) -> None:
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == kind and isinstance(body["error"]["message"], str) and body["error"]["message"]


@pytest.mark.parametrize("body, says", [
    (b'{"model": ', "not valid JSON"),
    (b'["a list"]', "JSON object"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": []}, "messages"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages.0"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "image"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "tool_use_id"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "He"}]}, "last message"),
    ({"model": MODEL, "max_tokens": 4, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]},
     "temperature"),
    ({"model": MODEL, "max_tokens": 4, "stop_sequences": "x", "messages": [{"role": "user", "content": "hi"}]},
     "stop_sequences"),
    ({"model": MODEL, "max_tokens": 4, "tool_choice": {"type": "any"}, "messages": [{"role": "user", "content": "hi"}]},
     "tool_choice"),
    ({"model": MODEL, "max_tokens": 4, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "hi"}]},
     "input_schema"),
    ({"model": MODEL, "max_tokens": 4, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"},
      "messages": [{"role": "user", "content": "hi"}]}, "tool_choice"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 5000}]}, "context length"),
])
def test_malformed_requests_get_anthropic_shaped_400s(served, body, says):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = raw_request(served.base_url, "/messages", raw, {"x-api-key": API_KEY})
    assert status == 400, answer
    assert_anthropic_error(answer, "invalid_request_error")
    assert says in answer["error"]["message"]


def test_the_client_sees_anthropics_error_types(served):
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(served, api_key="wrong-key").messages.count_tokens(model=MODEL, messages=[{"role": "user",
                                                                                          "content": "hi"}])
    assert_anthropic_error(e.value.body, "authentication_error")
    with pytest.raises(anthropic.NotFoundError) as e:
        client(served).messages.create(model="claude-sonnet-4-5", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert_anthropic_error(e.value.body, "not_found_error")
    with pytest.raises(anthropic.BadRequestError) as e:
        client(served).messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"top_k": -1})
    assert_anthropic_error(e.value.body, "invalid_request_error")
    status, body = raw_request(served.base_url, "/messages", b"{}", {})  # no key at all, refused on the head
    assert status == 401
    assert_anthropic_error(body, "authentication_error")
    status, body = raw_request(served.base_url, "/messages/batches", b"{}", {"x-api-key": API_KEY})
    assert status == 404
    assert_anthropic_error(body, "not_found_error")
    # Refused below the routes, its body never read: still Anthropic's shape on Anthropic's route.
    from tests.test_api import port_of, read_response

    with socket.create_connection(("127.0.0.1", port_of(served.base_url)), timeout=20) as sock:
        sock.sendall(f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: {API_KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {64 * 1024 * 1024}\r\n\r\n".encode())
        status, _, body = read_response(sock)
    assert status == 413
    assert_anthropic_error(json.loads(body), "request_too_large")
    log = served.stderr.read_text()
    assert "Traceback" not in log and "-> 500" not in log


# --- in this process: a trunk that fails on cue (tests/test_api.py's) ---


@pytest.fixture(scope="module")
def inproc(bundled_model):
    from tests.test_api import InprocServer

    server = InprocServer(bundled_model)
    yield server
    server.close()


def test_a_swarm_that_fails_is_an_anthropic_error_before_or_during_the_stream(inproc):
    c = anthropic.Anthropic(base_url=inproc.base_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": QUESTION}]
    inproc.trunk.fail_after, inproc.trunk.calls = 0, 0
    try:
        with pytest.raises(anthropic.APIStatusError) as e:
            c.messages.create(model=MODEL, max_tokens=8, messages=messages, stream=True)
        assert e.value.status_code == 503
        assert_anthropic_error(e.value.body, "api_error")
        assert "lost the connection to trunk-1" in e.value.body["error"]["message"]

        inproc.trunk.fail_after, inproc.trunk.calls = 4, 0  # the prefill and 3 steps, then the link drops
        texts = []
        with pytest.raises(anthropic.APIStatusError, match="lost the connection to trunk-1"):
            with c.messages.stream(model=MODEL, max_tokens=20, messages=messages, extra_body=GREEDY) as stream:
                texts += stream.text_stream
        assert texts  # it had begun
        inproc.trunk.calls = 0
        events = sse_events(inproc.base_url, {"model": MODEL, "max_tokens": 20, "messages": messages, "stream": True})
        assert events[-1][0] == "error" and "message_stop" not in [name for name, _ in events]
        assert_anthropic_error(events[-1][1], "api_error")
    finally:
        inproc.trunk.fail_after = None
    assert not inproc.asker.in_flight
