"""Grammar-constrained sampling with llama.cpp's grammar engine (through llama-cpp-python).

The asker has the logits, so structured output is decided there: before a token is chosen, the
grammar masks every token that cannot continue a valid text (its logit becomes -inf), and after,
it advances by the token chosen. The grammar is GBNF; a JSON schema becomes GBNF with
llama-cpp-python's converter (the one llama.cpp's server uses), and ``{"type": "json_object"}``
is llama.cpp's JSON grammar.

    grammar = Grammar.for_json_schema(tokenizer, schema)   # or Grammar.for_json(tokenizer)
    row = grammar.mask(logits_row); token = sample(row); grammar.accept(token)
    grammar.close()

Bounds. A schema comes from a client, and llama.cpp's grammar engine has no bounds of its own
that protect the process: the converter writes ``maxLength`` N (and a pattern's ``{0,N}``) as N
nested groups, which the engine's parser descends recursively (20,000 overflowed the stack:
SIGSEGV); an enum of 100,000 values took 12.9 s to build and 19.3 s per full-vocabulary mask.
So ``check_schema`` refuses, before the converter or the engine sees it, a schema beyond
``SchemaLimits`` (each refusal names its limit), and ``check_gbnf`` refuses any grammar text too
large or nested too deeply for the parser (the second line: a grammar not from a schema, or a
converter that nests in a new way). The work that remains runs in worker threads
(``build_grammar``, ``Grammar.run``), each call within a time budget, so the caller's event loop
never waits on it.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import numpy as np

from .grammar_limits import LIMITS, GrammarError, GrammarLimitError, GrammarLimits, check_gbnf, check_schema
from .tokenizer import Tokenizer

__all__ = ["Grammar", "GrammarBudgetError", "GrammarError", "GrammarLimitError", "GrammarLimits", "build_grammar",
           "check_gbnf", "check_schema"]

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data
PREFILTER = 64  # greedy: the likeliest tokens asked about first, before the whole vocabulary is masked
BUILD_BUDGET_S = 10.0  # turning a schema into a grammar and the engine's parse of it
STEP_BUDGET_S = 10.0  # one step's masking and advancing (a full mask at the limits: 0.4 s here)
WORKERS = 4  # threads for grammar work, all requests together
T = TypeVar("T")


class GrammarBudgetError(GrammarError):
    """Grammar work that ran past its time budget (the request ends; the thread finishes alone)."""


class Grammar:
    def __init__(self, tokenizer: Tokenizer, gbnf: str, root: str = "root", *,
                 step_budget_s: float = STEP_BUDGET_S, limits: GrammarLimits = LIMITS) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        self._sampler = None
        self._lock = threading.Lock()  # guards _sampler, _busy, _closing: a worker may hold the sampler
        self._busy = False
        self._closing = False
        check_gbnf(gbnf, limits)  # before the engine's recursive parser sees it
        self.gbnf = gbnf
        self.step_budget_s = step_budget_s
        self._sampler = llama_cpp.llama_sampler_init_grammar(tokenizer.vocab, gbnf.encode("utf-8"),
                                                             root.encode("utf-8"))
        if not self._sampler:
            raise GrammarError("llama.cpp's grammar engine refused the grammar")
        self._data = np.empty(tokenizer.n_vocab, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(tokenizer.n_vocab, dtype=np.int32)

    @classmethod
    def for_json(cls, tokenizer: Tokenizer, **kwargs) -> "Grammar":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        from llama_cpp.llama_grammar import JSON_GBNF

        return cls(tokenizer, JSON_GBNF, **kwargs)

    @classmethod
    def for_json_schema(cls, tokenizer: Tokenizer, schema: dict, *, limits: GrammarLimits = LIMITS,
                        **kwargs) -> "Grammar":
        """JSON that validates against ``schema`` (the subset llama.cpp's converter supports); a
        schema beyond ``limits`` is a GrammarLimitError, before the converter sees it."""
        from llama_cpp.llama_grammar import LlamaGrammar

        check_schema(schema, limits)
        try:
            gbnf = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)._grammar
        except Exception as e:  # noqa: BLE001 - the converter raises what it likes on schemas it cannot take
            message = "it nests too deeply" if isinstance(e, RecursionError) else e
            raise GrammarError(f"cannot turn this JSON schema into a grammar: {message}") from None
        return cls(tokenizer, _no_raw_control_characters(gbnf), limits=limits, **kwargs)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` (which masks and advances this grammar) in a grammar worker thread, off
        the caller's event loop, within ``step_budget_s`` of its start: GrammarBudgetError past it.
        The thread cannot be stopped; it finishes alone, and ``close`` frees the engine's state
        only once it has."""
        return await off_loop(lambda: self._holding(fn, *args), self.step_budget_s,
                              "masking the logits by the grammar for one step")

    def _holding(self, fn: Callable[..., T], *args) -> T:
        with self._lock:
            if self._sampler is None or self._closing:
                raise GrammarError("the grammar was closed")
            self._busy = True
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._busy = False
                if self._closing:
                    self._free()

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
        """Free the engine's state now, or, while a worker is using it, as soon as it is done."""
        with self._lock:
            self._closing = True
            if not self._busy:
                self._free()

    def _free(self) -> None:
        if self._sampler:
            self._llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def __del__(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self.close()


# The converter that llama-cpp-python 0.3.36 ships lets a JSON string hold any character but a
# quote or a backslash, raw newlines and tabs included, which JSON forbids (RFC 8259 section 7) and
# json.loads refuses: the bundled model, sampling at temperature 1, answered a maxLength-20 string
# as "France } }\n\nParis is". llama.cpp's own converter (and JSON_GBNF, for json_object) leaves
# out U+0000-U+001F and U+007F; so does ours, in the one rule where strings take their characters.
_CONVERTER_CHAR = r'char ::= [^"\\] |'
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] |'


def _no_raw_control_characters(gbnf: str) -> str:
    return "\n".join(_JSON_CHAR + line[len(_CONVERTER_CHAR):] if line.startswith(_CONVERTER_CHAR) else line
                     for line in gbnf.split("\n"))


async def build_grammar(tokenizer: Tokenizer, schema: dict | None, *, budget_s: float = BUILD_BUDGET_S,
                        step_budget_s: float = STEP_BUDGET_S, limits: GrammarLimits = LIMITS) -> Grammar:
    """The grammar for ``schema`` ({}: any JSON object), converted and parsed in a grammar worker
    thread within ``budget_s`` of its start (GrammarBudgetError past it, and the grammar, once the
    thread has made it, is freed)."""
    def build() -> Grammar:
        if not schema:
            return Grammar.for_json(tokenizer, step_budget_s=step_budget_s, limits=limits)
        return Grammar.for_json_schema(tokenizer, schema, step_budget_s=step_budget_s, limits=limits)

    return await off_loop(build, budget_s, "building the grammar for this schema", discard=Grammar.close)


_workers: ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="grammar")
        return _workers


async def off_loop(fn: Callable[[], T], budget_s: float, what: str,
                   discard: Callable[[T], None] | None = None) -> T:
    """``fn()`` in a grammar worker thread, its event loop free meanwhile. The budget counts from
    when a worker starts it (a wait for a free worker is bounded by the request's own deadline,
    not by this): past it, GrammarBudgetError, at once (the thread cannot be stopped: what ``fn``
    returns later goes to ``discard``), or when it returns having taken longer. Cancelling the
    caller leaves a started call to finish alone likewise."""
    loop = asyncio.get_running_loop()
    started = loop.create_future()
    given_up = threading.Event()

    def work() -> tuple[T, float]:
        began = time.monotonic()
        loop.call_soon_threadsafe(lambda: started.done() or started.set_result(began))
        result = fn()
        if given_up.is_set() and discard is not None:
            discard(result)
        return result, time.monotonic() - began

    future = asyncio.wrap_future(_executor().submit(work))
    over = GrammarBudgetError(f"{what} took longer than its budget of {budget_s:g} s; use a simpler schema")
    try:
        await asyncio.wait([started, future], return_when=asyncio.FIRST_COMPLETED)
        if not future.done():
            remaining = budget_s - (time.monotonic() - started.result())
            await asyncio.wait_for(asyncio.shield(future), max(0.0, remaining))
        result, took = future.result()
    except asyncio.TimeoutError:
        raise over from None
    finally:
        if not future.done():
            given_up.set()
            future.cancel()  # (a call not yet started never starts; a started one runs to its end)
        if not started.done():
            started.cancel()
    if took > budget_s:
        if discard is not None:
            discard(result)
        raise over
    return result
