"""The protocol's reference page, generated from the code that defines it.

``python -m net.reference > docs/protocol.md`` writes it: the frame and packet format from
net/wire.py's docstring, then every control message of net/messages.py in source order, under the
section comment it stands in (who sends it), with its docstring, the roles that may send it, and
each field's type, default and comment as written in the struct. tests/test_protocol_reference.py
fails when the page and the code differ, so the page cannot drift.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from dataclasses import dataclass

from . import messages, wire

SECTION = re.compile(r"^# --- (.+) ---$")


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    default: str  # "" when the field is required
    comment: str


@dataclass(frozen=True)
class Entry:
    section: str
    cls: type
    fields: list[Field]

    @property
    def tag(self) -> str | None:
        return self.cls.__struct_config__.tag if issubclass(self.cls, messages.Message) else None


def entries() -> list[Entry]:
    """Every Message and Part of net/messages.py, in source order, with its section."""
    source = inspect.getsource(messages)
    lines = source.splitlines()
    tree = ast.parse(source)
    found = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(messages, node.name)
        if not (isinstance(cls, type) and issubclass(cls, (messages.Message, messages.Part))) \
                or cls in (messages.Message, messages.Part):
            continue
        section = next((m.group(1) for line in reversed(lines[:node.lineno - 1]) if (m := SECTION.match(line))), "")
        found.append(Entry(section, cls, _fields(node, lines)))
    return found


def _fields(node: ast.ClassDef, lines: list[str]) -> list[Field]:
    out = []
    for statement in node.body:
        if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
            continue
        annotation = ast.unparse(statement.annotation)
        if annotation.startswith("ClassVar"):
            continue
        line = lines[statement.end_lineno - 1]
        comment = line.split("#", 1)[1].strip() if "#" in line else ""
        default = ast.unparse(statement.value) if statement.value is not None else ""
        out.append(Field(statement.target.id, annotation, default, comment))
    return out


def _frame_format() -> str:
    """net/wire.py's docstring from the frame grammar on, as written (indentation kept)."""
    doc = inspect.getdoc(wire)
    return doc[doc.index("    frame"):].rstrip()


def render() -> str:
    """The whole page, as Markdown."""
    out = ["# Protocol reference", "",
           "Generated from `net/wire.py` and `net/messages.py` by `python -m net.reference > docs/protocol.md`;",
           "`tests/test_protocol_reference.py` fails when this page and the code differ. Every swarm connection",
           "is QUIC with mutual TLS (ALPN `swarmctl/1`); each request is a stream of frames.", "",
           "## Frames and activation packets", "", "```", _frame_format(), "```", "",
           "## Control messages", "",
           inspect.getdoc(messages).strip(), "",
           "Bounds on what a member may claim: " + ", ".join(
               f"`{name}` = {getattr(messages, name)!r}" for name in dir(messages)
               if name.startswith("MAX_") or name == "MS_PER_LAYER") + ".", ""]
    section = None
    for entry in entries():
        if entry.section != section:
            section = entry.section
            out += ["", f"### {section}", ""] if out[-1] else [f"### {section}", ""]
        title = f"`{entry.tag}` ({entry.cls.__name__})" if entry.tag else f"{entry.cls.__name__} (a part of a message)"
        out.append(f"#### {title}")
        doc = entry.cls.__doc__
        if doc and doc not in (messages.Message.__doc__, messages.Part.__doc__):
            out.append(" ".join(inspect.cleandoc(doc).split()))
        senders = getattr(entry.cls, "senders", ())
        if senders:
            out.append(f"Only from a member whose certificate's role is {', '.join(senders)}.")
        out += [f"- `{f.name}: {f.type}" + (f" = {f.default}`" if f.default else "`")
                + (f" — {f.comment}" if f.comment else "") for f in entry.fields] or ["- no fields"]
        # (no blank line before the next heading: a heading ends the list anyway, and the page
        # stays under docs' 400 lines)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
