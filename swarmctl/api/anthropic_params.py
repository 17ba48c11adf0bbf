"""Anthropic Messages API request bodies → the ``ChatRequest`` the OpenAI path generates from.

``system`` becomes the first message; an assistant's ``tool_use`` blocks become its calls and a
user's ``tool_result`` blocks become ``tool`` messages, so the chat template sees one conversation
whichever API sent it. Anything wrong is a 400 naming the field (an ``ApiError``, shaped as
Anthropic's by swarmctl/api/anthropic_shapes.py).

Sampling a request leaves out takes serve's defaults (swarmctl/api/params.py), not Anthropic's
temperature 1.0: small models ramble at 1. ``max_tokens`` is required, as Anthropic's is; one past
the context is not refused (agents ask for 32,000 whatever the model): the answer stops where the
context ends, with ``stop_reason`` "max_tokens".
"""

from __future__ import annotations

import json
from typing import Any

from kernels.grammar_limits import GrammarLimitError, check_schema
from kernels.sampling import SamplingParams
from swarmctl.api.errors import bad_request
from swarmctl.api.params import DEFAULT_SAMPLING, ChatRequest, GenerationParams, Message
from swarmctl.api.tools import MAX_TOOLS, Tool, ToolChoice, check_tool_schemas

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 1000  # characters of one stop sequence
UNSUPPORTED = ("mcp_servers", "container")  # what this server cannot honour: refused, not ignored
# Ignored as harmless: metadata, service_tier, speed, cache_control, output_config.effort, and
# thinking (this model's answers carry no thinking blocks).
CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


def parse_messages(body: dict[str, Any], *, counting: bool = False) -> ChatRequest:
    """POST /v1/messages (or, ``counting``, /v1/messages/count_tokens: no max_tokens needed);
    ``params.stream`` says whether the answer streams."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: Field required (a string)", "model")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise bad_request(f"{name}: not supported by this server", name)
    max_tokens = body.get("max_tokens")
    if not counting and not (_is_int(max_tokens) and max_tokens >= 1):
        raise bad_request("max_tokens: Field required (a whole number, 1 or more)", "max_tokens")
    stream = body.get("stream") or False  # (null: not streamed)
    if not isinstance(stream, bool):
        raise bad_request("stream: must be true or false", "stream")
    tools = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    check_tool_schemas(tools, choice)
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    params = GenerationParams(model=model, max_tokens=max_tokens if _is_int(max_tokens) else None,
                              max_tokens_param=None, sampling=_sampling(body), stop=_stops(body.get("stop_sequences")),
                              stream=stream, include_usage=True, json_schema=_output_format(body.get("output_config")))
    if choice.mode in ("required", "function") and params.json_schema is not None:
        raise bad_request("tool_choice: a required tool call and output_config.format cannot both shape the answer",
                          "tool_choice")
    return ChatRequest(tuple(messages), params, tools, choice)


def _system(value: Any) -> list[Message]:
    if value is None or value == "" or value == []:
        return []
    return [Message("system", _text(value, "system"))]


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages: must be a non-empty list", "messages")
    out: list[Message] = []
    for i, m in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}: must be an object with role \"user\" or \"assistant\"", where)
        content = m.get("content")
        if isinstance(content, str):
            out.append(Message(m["role"], content))
        elif isinstance(content, list):
            out += _user_blocks(content, where) if m["role"] == "user" else [_assistant_blocks(content, where)]
        else:
            raise bad_request(f"{where}.content: must be a string or a list of content blocks", f"{where}.content")
    if value[-1]["role"] != "user":
        # Anthropic continues a last assistant message (a prefill); the chat template closes it.
        raise bad_request("messages: the last message must be the user's (continuing an assistant message "
                          "is not supported)", "messages")
    return out


def _user_blocks(blocks: list, where: str) -> list[Message]:
    """tool_result blocks → "tool" messages (the calls' results), then the text as the user's."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.content.{j}.tool_use_id: Field required", f"{where}.content.{j}")
            text = _text(block.get("content", ""), f"{where}.content.{j}.content")
            results.append(Message("tool", f"Error: {text}" if block.get("is_error") else text, tool_call_id=call_id))
        else:
            texts.append(_text_block(block, f"{where}.content.{j}"))
    return results + ([Message("user", "".join(texts))] if texts or not results else [])


def _assistant_blocks(blocks: list, where: str) -> Message:
    """text and tool_use blocks → one assistant message with its calls."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise bad_request(f"{where}.content.{j}: a tool_use block needs a name and an input object",
                                  f"{where}.content.{j}")
            calls.append((name, json.dumps(arguments)))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # another model's reasoning, sent back by a client: not this model's to read
        else:
            texts.append(_text_block(block, f"{where}.content.{j}"))
    return Message("assistant", "".join(texts), tuple(calls))


def _text_block(block: Any, where: str) -> str:
    if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
        return block["text"]
    kind = block.get("type") if isinstance(block, dict) else None
    if isinstance(kind, str):
        raise bad_request(f"{where}: content blocks of type {kind[:40]!r} are not supported here (text, tool_use "
                          f"and tool_result are)", where)
    raise bad_request(f"{where}: must be a content block with a type", where)


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks (system, a tool result's content)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text_block(b, f"{where}.{i}") for i, b in enumerate(value))
    raise bad_request(f"{where}: must be a string or a list of text blocks", where)


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"tools: must be a list of at most {MAX_TOOLS} tools", "tools")
    tools = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            raise bad_request(f"tools.{i}: only custom tools (name, description, input_schema) are supported",
                              f"tools.{i}")
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not 1 <= len(name) <= 64:
            raise bad_request(f"tools.{i}.name: must be 1 to 64 characters", f"tools.{i}")
        if not isinstance(schema, dict):
            raise bad_request(f"tools.{i}.input_schema: Field required (a JSON schema object)", f"tools.{i}")
        tools.append(Tool(name, str(t.get("description") or ""), schema))
    if len({t.name for t in tools}) != len(tools):
        raise bad_request("tools: two tools have the same name", "tools")
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in CHOICES:
        raise bad_request("tool_choice: type must be auto, any, tool or none", "tool_choice")
    if kind != "none" and not tools:
        raise bad_request(f"tool_choice: {kind!r} needs tools", "tool_choice")
    if kind == "tool" and value.get("name") not in {t.name for t in tools}:
        raise bad_request("tool_choice.name: must name one of the tools", "tool_choice")
    return ToolChoice(CHOICES[kind], value["name"] if kind == "tool" else None)


def _output_format(value: Any) -> dict | None:
    """output_config.format (structured outputs): a JSON schema the answer follows, constrained at
    the asker by llama.cpp's grammar engine as OpenAI's response_format is."""
    spec = value.get("format") if isinstance(value, dict) else None
    if spec is None:
        return None
    schema = spec.get("schema") if isinstance(spec, dict) and spec.get("type") == "json_schema" else None
    if not isinstance(schema, dict):
        raise bad_request("output_config.format: must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config")
    try:
        check_schema(schema)  # kernels/grammar_limits.py: what llama.cpp's grammar engine can take safely
    except GrammarLimitError as e:
        raise bad_request(f"output_config.format.schema: {e}", "output_config", code="schema_too_complex") from None
    return schema


def _sampling(body: dict[str, Any]) -> SamplingParams:
    temperature = _number(body, "temperature", DEFAULT_SAMPLING.temperature)
    if not 0.0 <= temperature <= 1.0:
        raise bad_request("temperature: must be between 0 and 1", "temperature")
    top_p = _number(body, "top_p", DEFAULT_SAMPLING.top_p)
    if not 0.0 < top_p <= 1.0:
        raise bad_request("top_p: must be in (0, 1]", "top_p")
    top_k = DEFAULT_SAMPLING.top_k if body.get("top_k") is None else body["top_k"]
    if not (_is_int(top_k) and top_k >= 0):
        raise bad_request("top_k: must be a whole number, 0 or more", "top_k")
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_LENGTH for s in value):
        raise bad_request(f"stop_sequences: must be a list of non-empty strings of at most {MAX_STOP_LENGTH} "
                          "characters", "stop_sequences")
    if len(value) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop_sequences: at most {MAX_STOP_SEQUENCES}", "stop_sequences")
    return tuple(value)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad_request(f"{name}: must be a number", name)
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
