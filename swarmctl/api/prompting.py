"""A chat request → the prompt's tokens, the tools offered and the parameters to generate with.

Shared by OpenAI's /v1/chat/completions and Anthropic's /v1/messages (and its count_tokens):
both parse into a ``ChatRequest`` (swarmctl/api/params.py), so the same conversation renders to
the same tokens and, greedy, gets the same answer on either endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kernels.errors import ModelFileError
from swarmctl.api.errors import bad_request
from swarmctl.api.params import ChatRequest, GenerationParams
from swarmctl.api.tools import Tool, call_schema, tool_prompt

if TYPE_CHECKING:
    from kernels.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatPrompt:
    tokens: list[int]
    params: GenerationParams  # with a required call's schema as json_schema
    tools: tuple[Tool, ...]  # those the answer may call (none with tool_choice "none")
    schema_param: str  # the parameter a schema the grammar engine refuses is blamed on


def render_chat(tokenizer: Tokenizer, chat: ChatRequest) -> ChatPrompt:
    """The chat template applied to the messages, with the tools told to the model (by the
    template itself when it knows tools, else in the system message: swarmctl/api/tools.py)."""
    from jinja2 import TemplateError

    params, tools, shown, schema_param = chat.params, (), None, "response_format"
    native = bool(chat.tools) and tokenizer.knows_tools  # a template that renders tools itself
    messages = [m.as_template_input(native) for m in chat.messages]
    if chat.tools and chat.tool_choice.mode != "none":
        tools = chat.tools
        if native:
            shown = [t.as_openai() for t in tools]
        else:
            told = tool_prompt(tools, chat.tool_choice)
            if messages and messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{told}"}
            else:
                messages.insert(0, {"role": "system", "content": told})
        if chat.tool_choice.mode in ("required", "function"):
            params = replace(params, json_schema=call_schema(tools, chat.tool_choice))
            schema_param = "tools"
    try:
        tokens = tokenizer.encode_chat(messages, shown)
    except (TemplateError, ModelFileError) as e:
        raise bad_request(f"the model's chat template refused these messages: {e}", "messages") from None
    return ChatPrompt(tokens, params, tools, schema_param)
