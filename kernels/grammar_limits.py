"""How large a grammar llama.cpp's grammar engine may be given, checked before it sees one.

A JSON schema (a request's ``response_format``, or its tools' parameters) becomes GBNF through
llama-cpp-python's converter, and the engine parses and runs that GBNF in C++ with no bounds that
protect the process running it:

- the converter writes ``maxLength``/``minLength``/``maxItems``/``minItems`` N, and a pattern's
  ``{m,N}``, as up to N nested groups, and the engine's parser descends them recursively: 20,000
  overflowed the stack of `serve`'s thread (SIGSEGV, the whole server gone);
- the engine keeps one parse stack per alternative still open and, for every token of the
  vocabulary, tries each: an enum of 100,000 values took 12.9 s to build and 19.3 s per
  full-vocabulary mask; alternatives inside alternatives (``anyOf`` in ``anyOf``, often through
  ``$ref``, or a quantified group inside a quantified group in a pattern) multiply;
- the converter itself is recursive Python, quadratic in an object's optional properties.

``check_schema`` walks a schema the way the converter will, and refuses one beyond
``GrammarLimits`` with a ``GrammarLimitError`` whose message names the limit and where the schema
passes it. ``check_gbnf`` bounds any grammar text itself (size, and nesting of groups, which is
what the parser recurses on): the second line, for grammars not made from a schema or a converter
that nests in a new way. Cost at the limits, measured on the development machine (SmolLM2's 49k
vocabulary): 1,000 alternatives open at once, 0.4 s per full mask (a greedy step asks about the
64 likeliest tokens first: under 1 ms); ``maxLength`` 1,000, 3 ms; 1,000 optional properties,
1 s to convert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import EngineError


class GrammarError(EngineError):
    """A grammar (or schema) llama.cpp's engine cannot take."""


class GrammarLimitError(GrammarError):
    """A schema or grammar beyond one of ``GrammarLimits``; the message names the limit."""


@dataclass(frozen=True)
class GrammarLimits:
    repetition: int = 1000  # maxLength, minLength, maxItems, minItems, and a pattern's {m,n} counts
    alternatives: int = 1000  # parse paths open at once: enum values, anyOf/oneOf branches (multiplied when nested)
    depth: int = 64  # nesting of the schema's JSON (objects and lists within one another)
    nodes: int = 20_000  # values in the schema's JSON, all levels together
    pattern_chars: int = 4096  # one regular expression
    refs: int = 32  # $ref resolved within $ref (a chain of definitions)
    gbnf_bytes: int = 512 * 1024  # the grammar text
    gbnf_nesting: int = 1200  # groups within groups in the grammar text (the parser recurses on these)


LIMITS = GrammarLimits()
_REPETITION_KEYWORDS = ("maxLength", "minLength", "maxItems", "minItems")


def check_schema(schema: Any, limits: GrammarLimits = LIMITS) -> None:
    """Raise GrammarLimitError if ``schema`` would make a grammar beyond ``limits``. Cheap: one
    walk of its JSON (bounded by ``limits.nodes``), then one of the schema as the converter reads
    it (each subschema once)."""
    _check_size(schema, limits)
    try:
        _Paths(schema, limits).width(schema, "#", 0)
    except RecursionError:  # (deep nesting reached through $ref chains)
        raise GrammarLimitError("the schema nests too deeply through its $refs") from None


def check_gbnf(gbnf: str, limits: GrammarLimits = LIMITS) -> None:
    """Raise GrammarLimitError if the grammar text is too large, or nests groups too deeply for
    llama.cpp's recursive parser (string literals, character classes and comments skipped)."""
    size = len(gbnf.encode("utf-8"))
    if size > limits.gbnf_bytes:
        raise GrammarLimitError(f"the grammar is {size} bytes; at most {limits.gbnf_bytes} are allowed")
    depth = deepest = 0
    for paren in _GBNF_PARENS.findall(_GBNF_OPAQUE.sub("", gbnf)):
        depth += 1 if paren == "(" else -1
        deepest = max(deepest, depth)
    if deepest > limits.gbnf_nesting:
        raise GrammarLimitError(f"the grammar nests groups {deepest} deep; at most {limits.gbnf_nesting} are "
                                f"allowed")


_GBNF_OPAQUE = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', re.DOTALL)
_GBNF_PARENS = re.compile(r"[()]")


def _check_size(schema: Any, limits: GrammarLimits) -> None:
    """Depth and node count of the schema's JSON, walked without recursion."""
    pending = [(schema, 1)]
    nodes = 1
    while pending:
        value, depth = pending.pop()
        if depth > limits.depth:
            raise GrammarLimitError(f"the schema is nested more than {limits.depth} levels deep; at most "
                                    f"{limits.depth} are allowed")
        if isinstance(value, (dict, list)):
            nodes += len(value)  # counted before they are listed: a huge enum costs nothing to refuse
            if nodes > limits.nodes:
                raise GrammarLimitError(f"the schema has more than {limits.nodes} values (enum values, properties "
                                        f"and keywords, all levels together); at most {limits.nodes} are allowed")
            pending += [(v, depth + 1) for v in (value.values() if isinstance(value, dict) else value)]


class _Paths:
    """The schema as the converter reads it (llama_cpp/llama_grammar.py, ``SchemaConverter.visit``:
    the same keywords, in the same order of precedence), each subschema once: its repetition
    counts and patterns are checked, and ``width`` bounds the parse paths the engine may hold
    open at once within it. Alternatives add up; a nested schema's paths multiply its parent's,
    which ``width`` gets by summing over alternatives whose own widths already count what they
    nest; siblings in a sequence (an object's properties, a tuple's items) do not add, since one
    is open at a time."""

    def __init__(self, root: Any, limits: GrammarLimits) -> None:
        self.root = root
        self.limits = limits
        self.known: dict[int, int] = {}  # id(subschema) → its width
        self.open: set[int] = set()  # subschemas being measured (a $ref back into one: recursion)

    def width(self, schema: Any, where: str, refs: int) -> int:
        if not isinstance(schema, dict):
            return 1
        key = id(schema)
        if key in self.known:
            return self.known[key]
        if key in self.open:
            return 1  # a recursive schema: the engine's stacks for it grow with the text (the time budget bounds it)
        self.open.add(key)
        try:
            width = self._measure(schema, where, refs)
        finally:
            self.open.discard(key)
        if width > self.limits.alternatives:
            raise GrammarLimitError(f"the schema holds at least {width} alternatives open at once at {where} (enum "
                                    f"values and anyOf/oneOf branches, multiplied where they nest); at most "
                                    f"{self.limits.alternatives} are allowed")
        self.known[key] = width
        return width

    def _measure(self, schema: dict, where: str, refs: int) -> int:
        self._check_repetitions(schema, where)
        kind = schema.get("type")
        if isinstance(schema.get("$ref"), str):
            if refs >= self.limits.refs:
                raise GrammarLimitError(f"$ref at {where} resolves through more than {self.limits.refs} other "
                                        f"$refs; at most {self.limits.refs} are allowed")
            target = self._resolve(schema["$ref"])
            return self.width(target, schema["$ref"], refs + 1) if target is not None else 1
        for union in ("oneOf", "anyOf"):
            if union in schema:
                branches = schema.get("oneOf") or schema.get("anyOf")
                if isinstance(branches, list):
                    return self._sum([(b, f"{where}/{union}/{i}") for i, b in enumerate(branches)], where, refs)
                return 1
        if isinstance(kind, list):
            return max(1, len(kind))
        if "const" in schema:
            return 1
        if "enum" in schema:
            values = schema["enum"]
            return max(1, len(values)) if isinstance(values, (list, dict, str)) else 1
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        if kind in (None, "object") and ("properties" in schema or ("additionalProperties" in schema
                                                                     and extra is not True)):
            return self._object(properties if isinstance(properties, dict) else {}, schema.get("required"), extra,
                                where, refs)
        if kind in (None, "object") and isinstance(schema.get("allOf"), list):
            widths = [self.width(part, f"{where}/allOf/{i}", refs) for i, part in enumerate(schema["allOf"])]
            return max(widths, default=1)
        if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            items = schema.get("items") or schema.get("prefixItems")
            if isinstance(items, list):
                return max((self.width(item, f"{where}/items/{i}", refs) for i, item in enumerate(items)), default=1)
            return self.width(items, f"{where}/items", refs)
        if kind in (None, "string") and isinstance(schema.get("pattern"), str):
            return self._pattern(schema["pattern"], f"{where}/pattern")
        return 1

    def _sum(self, branches: list[tuple[Any, str]], where: str, refs: int) -> int:
        total = 0
        for branch, at in branches:
            total += self.width(branch, at, refs)
            if total > self.limits.alternatives:
                break  # (the caller refuses it, naming this schema)
        return total

    def _object(self, properties: dict, required: Any, extra: Any, where: str, refs: int) -> int:
        """One property is open at a time; before a key has been told apart, every optional
        property may come next (and the converter is quadratic in them)."""
        required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
        widths = [self.width(s, f"{where}/properties/{name}", refs) for name, s in properties.items()]
        if isinstance(extra, dict):
            widths.append(self.width(extra, f"{where}/additionalProperties", refs))
        optional = sum(name not in required for name in properties) + (extra is not False and extra is not None)
        if optional + 1 > self.limits.alternatives:
            raise GrammarLimitError(f"the object at {where} has {optional} optional properties; at most "
                                    f"{self.limits.alternatives - 1} are allowed")
        return max([optional + 1, *widths])

    def _check_repetitions(self, schema: dict, where: str) -> None:
        for keyword in _REPETITION_KEYWORDS:
            value = schema.get(keyword)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > self.limits.repetition:
                shown = value if value < 1e15 else "over 10^15"
                raise GrammarLimitError(f"{keyword} {shown} at {where} is over the limit: at most "
                                        f"{self.limits.repetition}")

    def _resolve(self, ref: str) -> Any:
        """A local $ref ("#/$defs/name") as the converter resolves it; None for any other (the
        converter refuses those itself)."""
        if not ref.startswith("#/"):
            return None
        target = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        return target

    def _pattern(self, pattern: str, where: str) -> int:
        if len(pattern) > self.limits.pattern_chars:
            raise GrammarLimitError(f"the pattern at {where} is {len(pattern)} characters long; at most "
                                    f"{self.limits.pattern_chars} are allowed")
        width = pattern_width(pattern, self.limits.repetition, f"the pattern at {where}")
        if width is None:
            return 1  # not a pattern the converter reads: it refuses it itself
        if width > self.limits.alternatives:
            raise GrammarLimitError(f"the pattern at {where} holds at least {width} alternatives open at once "
                                    f"(quantified groups within quantified groups, and | branches, multiply); at "
                                    f"most {self.limits.alternatives} are allowed")
        return width


_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}")


def pattern_width(pattern: str, max_count: int, what: str = "the pattern") -> int | None:
    """The parse paths a regular expression (the subset the converter takes) may hold open at
    once, as ``_Paths`` counts them: ``|`` branches add; a quantified item multiplies what it
    holds by its count (``{m,n}``: n, ``{m,}``: m + 1, ``*``/``+``/``?``: 2), so ``a{0,1000}``
    is 1,000 and ``(a{0,100}){0,100}`` 10,000 (measured: 4 to 8 s per full mask, growing with
    the text). Raises GrammarLimitError for a count over ``max_count``; None where the converter
    would refuse the pattern anyway (an unreadable quantifier)."""
    groups = [[0, 1]]  # per open group: [alternatives closed so far, the widest item of the open one]
    last = 0  # the width of the last item (what a quantifier applies to); 0: none
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "(":
            groups.append([0, 1])
            last, i = 0, i + 1
            continue
        if c == "|":
            groups[-1][0] += groups[-1][1]
            groups[-1][1], last, i = 1, 0, i + 1
            continue
        if c in "*+?{":
            if c == "{":
                m = _QUANTIFIER.match(pattern, i)
                if m is None:
                    return None
                counts = [int(n) for n in (m[1], m[3]) if n]
                if any(n > max_count for n in counts):
                    raise GrammarLimitError(f"{what} repeats {max(counts)} times ({m[0]}); at most {max_count} are "
                                            f"allowed")
                times = int(m[3]) if m[3] else (int(m[1] or 0) + 1 if m[2] else int(m[1] or 0))
                i = m.end()
            else:
                times, i = 2, i + 1
            last *= max(1, times)
            groups[-1][1] = max(groups[-1][1], last)
            continue
        if c == ")":
            if len(groups) > 1:
                closed, widest = groups.pop()
                last = closed + widest
            else:
                last = 1
            i += 1
        elif c == "[":
            j = i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            last, i = 1, j + 1
        elif c == "\\":
            last, i = 1, i + 2
        else:
            last, i = 1, i + 1
        groups[-1][1] = max(groups[-1][1], last)
    while len(groups) > 1:  # unbalanced: the converter refuses it; count it all the same
        closed, widest = groups.pop()
        groups[-1][1] = max(groups[-1][1], closed + widest)
    return groups[0][0] + groups[0][1]
