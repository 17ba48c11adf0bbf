"""Tool calling (``tools``, ``tool_choice``), decided at the asker.

The model is told about the tools by its own chat template when that knows tools (it uses a
``tools`` variable: the tools go to it in OpenAI's shape), else in a system message
(``tool_prompt``: the fallback, which the bundled model gets) that asks for a call as one JSON object
``{"name": ..., "arguments": {...}}``. With ``tool_choice`` ``required``
or a named function, the answer is constrained to exactly that shape by the grammar of the tools'
own JSON schemas (``call_schema`` → kernels/grammar.py), so even a small model returns a valid
call; with ``auto`` the answer is parsed (``parse_call``) and becomes a call when it is one. A
call comes back as OpenAI's ``tool_calls``; earlier calls and ``role: "tool"`` results in the
history are written into the prompt the same way.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from kernels.grammar_limits import GrammarLimitError, check_schema
from swarmctl.api.errors import bad_request

MAX_TOOLS = 64


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema for the arguments

    def as_openai(self) -> dict:
        """As OpenAI's requests (and chat templates that know tools) write it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto", "none", "required" or "function"
    name: str | None = None  # with "function": the one to call


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(body: dict[str, Any]) -> tuple[Tool, ...]:
    raw = body.get("tools")
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name or len(name) > 64:
            raise bad_request(f"tools.[{i}] must be a function with a name of 1 to 64 characters", f"tools.[{i}]")
        parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"tools.[{i}].function.parameters must be a JSON schema object", f"tools.[{i}]")
        tools.append(Tool(name, str(fn.get("description") or ""), parameters))
    if len({t.name for t in tools}) != len(tools):
        raise bad_request("two tools have the same name", "tools")
    return tuple(tools)


def parse_tool_choice(body: dict[str, Any], tools: tuple[Tool, ...]) -> ToolChoice:
    raw = body.get("tool_choice")
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if raw in ("auto", "none", "required"):
        if raw != "none" and not tools:
            raise bad_request(f"tool_choice {raw!r} needs 'tools'", "tool_choice")
        return ToolChoice(raw)
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", "tool_choice")
    if name not in {t.name for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return ToolChoice("function", name)


def check_tool_schemas(tools: tuple[Tool, ...], choice: ToolChoice) -> None:
    """A required call is constrained by the grammar of its tools' schemas: each must be within
    what llama.cpp's grammar engine can take safely (kernels/grammar_limits.py), a 400 naming the
    tool and the limit otherwise. (With ``auto`` the schemas only go into the prompt.)"""
    if choice.mode not in ("required", "function"):
        return
    for i, tool in enumerate(tools):
        if choice.mode == "function" and tool.name != choice.name:
            continue
        try:
            check_schema(tool.parameters)
        except GrammarLimitError as e:
            raise bad_request(f"tools.[{i}].function.parameters: {e}", f"tools.[{i}]",
                              code="schema_too_complex") from None


def tool_prompt(tools: tuple[Tool, ...], choice: ToolChoice) -> str:
    """The system message that tells the model about the tools (the fallback for templates that
    know none)."""
    listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
                       for t in tools)
    must = {"required": "You must call one of them.",
            "function": f"You must call {choice.name}."}.get(choice.mode, "Call one if it helps; else answer in text.")
    return (f"You can call these tools:\n{listed}\n{must} To call a tool, answer with only a JSON object: "
            '{"name": <tool name>, "arguments": <its arguments>}.')


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (for earlier calls in the history)."""
    try:
        args = json.loads(arguments)
    except (TypeError, ValueError):
        args = arguments
    return json.dumps({"name": name, "arguments": args})


def call_schema(tools: tuple[Tool, ...], choice: ToolChoice) -> dict:
    """The JSON schema an answer must follow when a call is required (or a named one)."""
    chosen = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    shapes = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
               "required": ["name", "arguments"]} for t in chosen]
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def parse_call(text: str, tools: tuple[Tool, ...]) -> ToolCall | None:
    """The model's answer as a call, if it is one: a JSON object naming one of the tools, bare (the
    fallback's and the grammar's form) or inside ``<tool_call>…</tool_call>`` (the form of chat
    templates that know tools, Hermes and Qwen among them); ``parameters`` is taken for
    ``arguments`` (Llama 3.1's form)."""
    body = text.strip()
    tagged = re.fullmatch(r"<tool_call>\s*(.*?)\s*</tool_call>", body, re.DOTALL)
    try:
        value = json.loads(tagged[1] if tagged else body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in {t.name for t in tools}:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall("call_" + secrets.token_hex(12), value["name"], json.dumps(arguments))
