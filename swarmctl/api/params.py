"""Request bodies → typed, validated parameters. Anything wrong is a 400 naming the parameter.

Sampling parameters a request leaves out take ``swarmctl ask``'s defaults (temperature 0.2,
top-p 0.9, top-k 40, as the SmolLM2 model card recommends), not OpenAI's (1.0, 1.0): small models
ramble at temperature 1. ``top_k`` is accepted as an extension, as llama.cpp's server does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any

from kernels.grammar_limits import GrammarLimitError, check_schema
from kernels.sampling import SamplingParams
from swarmctl.api.errors import bad_request
from swarmctl.api.tools import Tool, ToolChoice, call_text, check_tool_schemas, parse_tool_choice, parse_tools

DEFAULT_SAMPLING = SamplingParams(temperature=0.2, top_k=40, top_p=0.9)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context's end
MAX_STOPS = 4  # as OpenAI
SEED_MASK = 2**64 - 1  # numpy's generators take seeds of 0 or more; negative ones wrap
ROLES = {"system", "developer", "user", "assistant", "tool"}
# Parameters whose meaning we cannot honour: refused rather than silently ignored.
UNSUPPORTED = ("echo", "suffix", "functions", "logit_bias")
MAX_TOP_LOGPROBS = {"chat": 20, "completion": 5}  # as OpenAI


@dataclass(frozen=True)
class GenerationParams:
    model: str
    max_tokens: int | None  # None: until the context is full
    max_tokens_param: str | None  # the parameter that set max_tokens; None: a default
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage counts
    logprobs: int | None = None  # each token's log-probability and this many alternatives (None: not asked)
    json_schema: dict | None = None  # response_format: {} for any JSON object, else the schema to follow
    cache_prompt: bool = True  # llama.cpp's name: start from a kept prefix of an earlier prompt (the same bits)


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[tuple[str, str], ...] = ()  # an assistant's earlier calls: (name, arguments JSON)
    tool_call_id: str = ""  # a tool's result: the call it answers

    def as_template_input(self, native_tools: bool = False) -> dict:
        """The message as the chat template takes it. Templates know system/user/assistant; OpenAI's
        newer "developer" role is a system message. An assistant's calls go to a template that knows
        tools as OpenAI's ``tool_calls``, else they are written as the model writes them
        (swarmctl/api/tools.py)."""
        role = "system" if self.role == "developer" else self.role
        if native_tools:
            out: dict = {"role": role, "content": self.content}
            if self.tool_calls:
                out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                                     for n, a in self.tool_calls]
            if self.tool_call_id:
                out["tool_call_id"] = self.tool_call_id
            return out
        content = "\n".join([self.content] * bool(self.content) + [call_text(n, a) for n, a in self.tool_calls])
        return {"role": role, "content": content}


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    params: GenerationParams
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]  # text, or token ids as OpenAI also accepts
    params: GenerationParams


def parse_json(body: bytes) -> dict[str, Any]:
    """A request body → its JSON object. Anything undecodable is a 400: bytes that are not UTF-8,
    text that is not JSON (NaN and Infinity included), numbers too long to convert, nesting too
    deep for the parser, and \\u escapes that leave a lone UTF-16 surrogate (no text can hold one)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
        if _SURROGATE_ESCAPE.search(text):  # cheap test first; the thorough one re-encodes everything
            json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise bad_request("the request body is not valid JSON: it is nested too deeply") from None
    except UnicodeEncodeError:
        raise bad_request("the request body is not valid JSON text: a \\u escape leaves a lone UTF-16 "
                          "surrogate") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    except ValueError as e:  # e.g. an integer longer than Python converts (4300 digits)
        message = "a number in it has too many digits" if "digits" in str(e) else str(e)
        raise bad_request(f"the request body is not valid JSON: {message}") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    return value


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800 to \udfff: paired or not, look closer


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON value")


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    name = next((n for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None), None)
    params = replace(_generation(body, max_tokens, name), logprobs=_chat_logprobs(body))
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    if choice.mode in ("required", "function") and params.json_schema is not None:
        raise bad_request("a required tool call and response_format cannot both shape the answer", "tool_choice")
    check_tool_schemas(tools, choice)
    return ChatRequest(tuple(_message(m, i) for i, m in enumerate(messages)), params, tools, choice)


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    if _is_int(body.get("best_of")) and body["best_of"] != 1:
        raise bad_request("only best_of = 1 is supported", "best_of")
    max_tokens = _positive_int(body, "max_tokens")
    name = None if max_tokens is None else "max_tokens"
    params = replace(_generation(body, max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, name),
                     logprobs=_completion_logprobs(body))
    return CompletionRequest(prompt, params)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: ``logprobs`` true asks for them, ``top_logprobs`` (0 to 20) for alternatives too."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request("'logprobs' must be true or false", "logprobs")
    if top is not None and not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS["chat"]):
        raise bad_request(f"'top_logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS['chat']}",
                          "top_logprobs")
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    return (top or 0) if wanted else None


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions: ``logprobs`` N (0 to 5) asks for them with N alternatives."""
    n = body.get("logprobs")
    if n is None:
        return None
    if not (_is_int(n) and 0 <= n <= MAX_TOP_LOGPROBS["completion"]):
        raise bad_request(f"'logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS['completion']}",
                          "logprobs")
    return n


def _generation(body: dict[str, Any], max_tokens: int | None, max_tokens_param: str | None) -> GenerationParams:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("you must provide a model parameter", "model")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise bad_request(f"'{name}' is not supported by this server", name)
    n = body.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise bad_request("only n = 1 is supported", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise bad_request("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return GenerationParams(model=model, max_tokens=max_tokens, max_tokens_param=max_tokens_param,
                            sampling=_sampling(body), stop=_stops(body),
                            stream=bool(stream), include_usage=bool(options.get("include_usage")),
                            json_schema=_response_format(body), cache_prompt=_cache_prompt(body))


def _cache_prompt(body: dict[str, Any]) -> bool:
    """``cache_prompt`` (llama.cpp server's field, default true): false computes the whole prompt."""
    value = body.get("cache_prompt", True)
    if not isinstance(value, bool):
        raise bad_request("'cache_prompt' must be true or false", "cache_prompt")
    return value


def _response_format(body: dict[str, Any]) -> dict | None:
    """``response_format``: text (None), ``json_object`` ({}: any JSON object) or ``json_schema``
    (the schema); constrained at the asker by llama.cpp's grammar engine (kernels/grammar.py)."""
    value = body.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("'response_format.json_schema.schema' must be a JSON schema object",
                              "response_format")
        try:
            check_schema(schema)  # kernels/grammar_limits.py: what llama.cpp's grammar engine can take safely
        except GrammarLimitError as e:
            raise bad_request(f"response_format.json_schema.schema: {e}", "response_format",
                              code="schema_too_complex") from None
        return schema
    raise bad_request("'response_format.type' must be text, json_object or json_schema", "response_format")


def _sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = _number(body, "temperature", DEFAULT_SAMPLING.temperature)
    if not 0.0 <= temperature <= 2.0:
        raise bad_request("'temperature' must be between 0 and 2", "temperature")
    top_p = _number(body, "top_p", DEFAULT_SAMPLING.top_p)
    if not 0.0 < top_p <= 1.0:
        raise bad_request("'top_p' must be in (0, 1]", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and top_k >= 0):
        raise bad_request("'top_k' must be a whole number, 0 or more", "top_k")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_request("'seed' must be an integer", "seed")
    return SamplingParams(temperature=temperature, top_k=DEFAULT_SAMPLING.top_k if top_k is None else top_k,
                          top_p=top_p, seed=None if seed is None else seed & SEED_MASK)


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} sequences", "stop")
    return tuple(stops)


def _message(value: Any, index: int) -> Message:
    param = f"messages.[{index}]"
    if not isinstance(value, dict) or value.get("role") not in ROLES:
        raise bad_request(f"{param} must be an object with a role ({', '.join(sorted(ROLES))})", param)
    content = value.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):  # content parts: only text parts can reach this model
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad_request(f"{param}.content: only text content parts are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    elif not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    calls = value.get("tool_calls") or []
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), str) for c in calls):
        raise bad_request(f"{param}.tool_calls must be a list of function calls", f"{param}.tool_calls")
    call_id = value.get("tool_call_id")
    return Message(value["role"], content, tuple((c["function"]["name"], c["function"].get("arguments", "{}"))
                                                 for c in calls), call_id if isinstance(call_id, str) else "")


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise bad_request(f"'{name}' must be a positive whole number", name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be a number", name)
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

