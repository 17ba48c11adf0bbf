"""OpenAI's response objects: models, completions, chat completions and their stream chunks."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from swarmctl.asker.logprobs import TokenLogprob

# The asker's finish reasons → OpenAI's. "context": the context filled up, which OpenAI also
# reports as "length".
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    drafted: int | None = None  # with speculative steps (serve --speculate): tokens drafted, and kept
    accepted: int = 0
    cached_tokens: int = 0  # prompt tokens taken from a kept prefix of an earlier request

    def as_dict(self) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.drafted is not None:  # OpenAI's names for predicted tokens kept and thrown away
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": self.accepted,
                                                  "rejected_prediction_tokens": self.drafted - self.accepted}
        return usage


@dataclass(frozen=True)
class Envelope:
    """What every object of one response shares: its id, creation time and model."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12))

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def response(self, text: str, finish_reason: str, usage: Usage, logprobs: dict | None = None,
                 tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": None if tool_calls else text, "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": "tool_calls" if tool_calls else finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage.as_dict()}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage.as_dict()}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, first: bool = False,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        """A stream chunk carrying ``text`` (chat: a delta; the first also names the role) or
        ``tool_calls`` (each with its index in the list, as OpenAI streams them)."""
        if self.chat:
            delta: dict = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk when the client asked for usage (stream_options.include_usage)."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage.as_dict()}


def model_object(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "swarmctl"}


def model_list(model_id: str, created: int) -> dict:
    return {"object": "list", "data": [model_object(model_id, created)]}


def chat_logprobs(items: Sequence[TokenLogprob], piece: Callable[[int], bytes]) -> dict:
    """OpenAI's chat ``logprobs``: each token with its text, log-probability, UTF-8 bytes and the
    alternatives asked for (``top_logprobs``)."""
    def entry(token: int, logprob: float) -> dict:
        raw = piece(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
                        for i in items], "refusal": None}


def completion_logprobs(items: Sequence[TokenLogprob], piece: Callable[[int], bytes], offset: int = 0) -> dict:
    """OpenAI's (legacy) completions ``logprobs``: parallel lists; ``text_offset`` counts characters
    from the start of the completion's text (``offset``: where this part of it starts)."""
    texts = [piece(i.token).decode("utf-8", errors="replace") for i in items]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{piece(t).decode("utf-8", errors="replace"): lp for t, lp in i.top} for i in items],
            "text_offset": offsets}

