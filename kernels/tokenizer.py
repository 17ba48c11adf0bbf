"""Tokenizer and chat template: llama.cpp's own, through llama-cpp-python with ``vocab_only``.

No hand-written BPE: the same code that tokenizes for the oracle tokenizes for us, and prompts
are built the way ``Llama.create_completion`` / ``create_chat_completion`` build them.
"""

from __future__ import annotations

import codecs
import ctypes
import logging
import os
import re
from typing import Iterable, Sequence

from .errors import ModelFileError

_log = logging.getLogger("llama.cpp")
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
    lambda level, text, user: _log.debug("%s", (text or b"").decode(errors="replace").rstrip())
)


def _quiet_llama_logs() -> None:
    """llama-cpp-python 0.3.36 maps ggml's log levels off by one and prints warnings to stderr even
    with verbose=False; send llama.cpp's log to Python logging (debug) instead."""
    import llama_cpp

    llama_cpp.llama_log_set(_LOG_CALLBACK, None)


class Tokenizer:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        from llama_cpp import Llama  # heavy import; only the client side needs it

        _quiet_llama_logs()
        try:
            self._llm = Llama(os.fspath(path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise ModelFileError(f"cannot load the tokenizer from {path}: {e}") from None
        self._model = self._llm._model  # llama-cpp-python's vocabulary accessors live here
        self.n_vocab = self._llm.n_vocab()
        self.bos_id = self._llm.token_bos()
        self.eos_id = self._llm.token_eos()
        self.chat_template: str | None = self._llm.metadata.get("tokenizer.chat_template")

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids for a raw completion prompt, exactly as ``Llama.create_completion`` makes them."""
        bos = [self.bos_id] if self._model.add_bos_token() and self.bos_id >= 0 else []
        body = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=True) if text else []
        eos = [self.eos_id] if self._model.add_eos_token() and self.eos_id >= 0 else []
        return bos + body + eos

    @property
    def knows_tools(self) -> bool:
        """Whether the model's chat template renders tools itself (it uses a ``tools`` variable)."""
        return bool(self.chat_template) and re.search(r"\btools\b", self.chat_template) is not None

    def encode_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids for a chat, rendered with the model's own template (GGUF metadata); ``tools``
        (OpenAI's shape) go to a template that knows them."""
        if not self.chat_template:
            raise ModelFileError("the model has no chat template; use --raw for a plain completion")
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        formatter = Jinja2ChatFormatter(
            template=self.chat_template,
            eos_token=self._text_of(self.eos_id),
            bos_token=self._text_of(self.bos_id),
            add_generation_prompt=True,
        )
        rendered = formatter(messages=list(messages), tools=list(tools) if tools else None)
        return self._llm.tokenize(rendered.prompt.encode("utf-8"), add_bos=not rendered.added_special, special=True)

    @property
    def vocab(self):
        """llama.cpp's vocabulary handle (for its grammar engine: kernels/grammar.py)."""
        return self._model.vocab

    def is_end_of_generation(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._model.vocab, token))

    def decode(self, tokens: Iterable[int]) -> str:
        return self._llm.detokenize(list(tokens)).decode("utf-8", errors="replace")

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (llama.cpp's token_to_piece, as its CLI streams them)."""
        import llama_cpp

        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buf, len(buf), 0, False)
        if n < 0:  # buffer too small: -n is the size needed
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def _text_of(self, token: int) -> str:
        return self._model.token_get_text(token) if token >= 0 else ""

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens into text as they arrive, holding back bytes of an unfinished UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self._tokenizer.piece(token))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
