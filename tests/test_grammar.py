"""Structured output's grammar (kernels/grammar.py) against what JSON itself allows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kernels.grammar import Grammar
from kernels.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 20}}, "required": ["country"]}


@pytest.fixture(scope="module")
def tokenizer(bundled_model):
    return Tokenizer(bundled_model)


def _single_token(tokenizer: Tokenizer, text: str) -> int:
    ids = [t for t in range(tokenizer.n_vocab) if tokenizer.piece(t) == text.encode()]
    assert ids, f"no single token for {text!r}"
    return ids[0]


@pytest.mark.parametrize("make", [lambda tok: Grammar.for_json_schema(tok, SCHEMA), Grammar.for_json],
                         ids=["json_schema", "json_object"])
def test_a_string_refuses_raw_control_characters_as_json_does(tokenizer, make):
    """The schema converter llama-cpp-python 0.3.36 ships let strings hold raw newlines, and the
    bundled model answered {"city": {"country": "France } }\\n\\nParis is"}}: JSON that json.loads
    refuses (test_api's streamed answer failed so once). Inside a string, a raw newline or tab is
    now refused and its escape allowed, as in llama.cpp's own converter and JSON_GBNF."""
    grammar = make(tokenizer)
    try:
        for token in tokenizer.encode_prompt('{"country": "Fr'):
            assert np.isfinite(grammar.mask(np.zeros(tokenizer.n_vocab, dtype=np.float32))[token])
            grammar.accept(token)
        allowed = np.isfinite(grammar.mask(np.zeros(tokenizer.n_vocab, dtype=np.float32)))
        assert allowed[_single_token(tokenizer, "ance")]
        assert not allowed[_single_token(tokenizer, "\n")] and not allowed[_single_token(tokenizer, "\t")]
        assert allowed[_single_token(tokenizer, "\\")]  # (the start of "\n", the escape, is fine)
        assert json.loads('{"country": "Fr\\nance"}')  # (what that escape gives: valid JSON)
    finally:
        grammar.close()
