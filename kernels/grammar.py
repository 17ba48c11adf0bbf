"""Grammar-constrained sampling with llama.cpp's grammar engine (through llama-cpp-python).

The asker has the logits, so structured output is decided there: before a token is chosen, the
grammar masks every token that cannot continue a valid text (its logit becomes -inf), and after,
it advances by the token chosen. The grammar is GBNF; a JSON schema becomes GBNF with
llama-cpp-python's converter (the one llama.cpp's server uses), and ``{"type": "json_object"}``
is llama.cpp's JSON grammar.

    grammar = Grammar.for_json_schema(tokenizer, schema)   # or Grammar.for_json(tokenizer)
    row = grammar.mask(logits_row); token = sample(row); grammar.accept(token)
    grammar.close()
"""

from __future__ import annotations

import ctypes
import json

import numpy as np

from .errors import EngineError
from .tokenizer import Tokenizer

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data
PREFILTER = 64  # greedy: the likeliest tokens asked about first, before the whole vocabulary is masked


class GrammarError(EngineError):
    """A grammar (or schema) llama.cpp's engine cannot take."""


class Grammar:
    def __init__(self, tokenizer: Tokenizer, gbnf: str, root: str = "root") -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self.gbnf = gbnf
        self._sampler = llama_cpp.llama_sampler_init_grammar(tokenizer.vocab, gbnf.encode("utf-8"),
                                                             root.encode("utf-8"))
        if not self._sampler:
            raise GrammarError("llama.cpp's grammar engine refused the grammar")
        self._data = np.empty(tokenizer.n_vocab, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(tokenizer.n_vocab, dtype=np.int32)

    @classmethod
    def for_json(cls, tokenizer: Tokenizer) -> "Grammar":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        from llama_cpp.llama_grammar import JSON_GBNF

        return cls(tokenizer, JSON_GBNF)

    @classmethod
    def for_json_schema(cls, tokenizer: Tokenizer, schema: dict) -> "Grammar":
        """JSON that validates against ``schema`` (the subset llama.cpp's converter supports)."""
        from llama_cpp.llama_grammar import LlamaGrammar

        try:
            gbnf = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)._grammar
        except Exception as e:  # noqa: BLE001 - the converter raises what it likes on schemas it cannot take
            raise GrammarError(f"cannot turn this JSON schema into a grammar: {e}") from None
        return cls(tokenizer, gbnf)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` (one row) with every token the grammar forbids next at -inf."""
        llama_cpp = self._llama_cpp
        data = self._data
        data["logit"] = logits
        data["p"] = 0.0
        array = llama_cpp.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(data), selected=-1,
            sorted=False)
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        if array.size != len(data):  # (the engine masks in place; it never drops or reorders here)
            raise GrammarError("llama.cpp's grammar engine changed the candidates' layout")
        return data["logit"].copy()

    def best_allowed(self, logits: np.ndarray, among: int = PREFILTER) -> int | None:
        """The likeliest token the grammar allows next, if one of the ``among`` likeliest is (the
        engine asked about those alone: microseconds, where masking the whole vocabulary costs
        milliseconds); None when none of them is. Exact: any token outside them is less likely."""
        llama_cpp = self._llama_cpp
        top = np.argpartition(-logits, min(among, len(logits) - 1))[:among]
        top = top[np.argsort(-logits[top], kind="stable")]
        few = np.zeros(len(top), dtype=_TOKEN_DATA)
        few["id"], few["logit"] = top, logits[top]
        array = llama_cpp.llama_token_data_array(
            data=few.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(few), selected=-1,
            sorted=False)
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))
        allowed = np.flatnonzero(np.isfinite(few["logit"]))
        return int(few["id"][allowed[0]]) if len(allowed) else None

    def accept(self, token: int) -> None:
        self._llama_cpp.llama_sampler_accept(self._sampler, int(token))

    def close(self) -> None:
        if self._sampler:
            self._llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        self.close()
