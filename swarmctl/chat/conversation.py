"""A terminal chat's conversation and its slash commands (``swarmctl chat``), apart from any I/O
but the file /save writes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

HELP = """commands:
  /system TEXT   set the system message (/system alone removes it)
  /clear         forget the conversation (the system message stays)
  /save FILE     write the conversation to FILE as JSON
  /exit          end the chat (so do /bye and Ctrl-D)
  Ctrl-C stops an answer; the chat goes on"""


@dataclass
class Turn:
    role: str  # "user" or "assistant"
    content: str


@dataclass
class Conversation:
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def messages(self) -> list[dict]:
        """As the chat template takes them (and /save writes them)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": t.role, "content": t.content} for t in self.turns]

    def clear(self) -> None:
        self.turns.clear()

    def save(self, path: Path, model: str) -> None:
        """As JSON, readable only by its owner: a conversation may be private."""
        text = json.dumps({"model": model, "messages": self.messages()}, ensure_ascii=False, indent=2) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)


@dataclass(frozen=True)
class Command:
    name: str  # "system", "clear", "save", "exit", "help"; "" for a message to the model
    argument: str = ""


COMMANDS = {"system": "system", "clear": "clear", "save": "save", "exit": "exit", "bye": "exit", "quit": "exit",
            "help": "help", "?": "help"}


class CommandError(ValueError):
    """A slash command the chat cannot do: one line for the user, and the chat goes on."""


def parse_line(line: str) -> Command:
    """A line typed at the prompt: a slash command, or a message (``//`` starts a message with /)."""
    text = line.strip()
    if text.startswith("//") or not text.startswith("/"):
        return Command("", text[1:] if text.startswith("//") else text)
    word, _, argument = text[1:].partition(" ")
    name = COMMANDS.get(word.lower())
    if name is None:
        raise CommandError(f"unknown command /{word} (/help lists them)")
    if name == "save" and not argument.strip():
        raise CommandError("/save needs a file name: /save FILE")
    return Command(name, argument.strip())
