"""`swarmctl chat`'s loop: read a line, answer it streamed through the asker, keep the turns.

One asker session serves the whole chat, with one cache of kept prefixes: each turn starts where
the previous turn's prompt ended, at this asker and at every stage, instead of prefilling the
whole history again (swarmctl/asker/prefixes.py). Each turn renders the whole
conversation with the model's chat template. Ctrl-C cancels the answer in progress (the asker
frees its request) and the chat goes on; the part already shown stays in the conversation, as
the user saw it. Answers go to stdout, one line break after each; everything else to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import sys
import threading
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from jinja2 import TemplateError

from kernels.errors import EngineError, ModelFileError
from kernels.sampling import SamplingParams
from swarmctl.asker.prefixes import PrefixCache
from swarmctl.chat.conversation import HELP, CommandError, Conversation, Turn, parse_line

log = logging.getLogger("swarmctl.chat")

PROMPT = ">>> "


class LineReader:
    """Lines of stdin, one per ``read``, from a daemon thread: a read still blocked when the
    chat ends (Ctrl-D never typed) does not hold the process up."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._wanted = threading.Semaphore(0)
        self._future: asyncio.Future[str | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="chat-stdin", daemon=True)

    async def read(self) -> str | None:
        """The next line, or None at end of input."""
        self._loop = asyncio.get_running_loop()
        self._future = self._loop.create_future()
        if not self._thread.is_alive():
            self._thread.start()
        self._wanted.release()
        return await self._future

    def _run(self) -> None:
        while True:
            self._wanted.acquire()
            try:
                line = self._stream.readline() or None
            except (OSError, ValueError):
                line = None
            try:
                self._loop.call_soon_threadsafe(_settle, self._future, line)
            except RuntimeError:  # the loop has closed: the chat is over
                return
            if line is None:
                return


def _settle(future: asyncio.Future, line: str | None) -> None:
    if not future.done():
        future.set_result(line)


@dataclass(frozen=True)
class ChatSettings:
    sampling: SamplingParams
    max_tokens: int | None  # None: until the answer ends or the context is full
    interactive: bool  # stdin is a terminal: show a prompt and hints


class TerminalChat:
    def __init__(self, session, settings: ChatSettings, conversation: Conversation,
                 out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.session = session
        self.settings = settings
        self.conversation = conversation
        self.out, self.err = out, err
        self.answering: asyncio.Task | None = None
        # The conversation's kept prefix: each turn starts where the last turn's prompt ended, at
        # this asker and every stage (swarmctl/asker/prefixes.py; the answer is the same bits).
        self.prefixes = PrefixCache()

    async def run(self, reader: LineReader) -> int:
        tokenizer = self.session.asker.tokenizer
        if not tokenizer.chat_template:
            raise ModelFileError("the model has no chat template, which swarmctl chat needs "
                                 "(swarmctl ask --raw continues plain text)")
        if self.settings.interactive:
            self._note(f"chatting with {self.session.model.stem}; /help for commands, /exit or Ctrl-D to end")
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self._interrupt)
        try:
            while True:
                self._prompt()
                line = await reader.read()
                if line is None:
                    break
                try:
                    command = parse_line(line)
                    if command.name == "exit":
                        break
                    await self._do(command.name, command.argument)
                except CommandError as e:
                    self._note(f"swarmctl chat: {e}")
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        if self.settings.interactive:
            self.out.write("\n")
        return 0

    async def _do(self, name: str, argument: str) -> None:
        if name == "help":
            self._note(HELP)
        elif name == "system":
            self.conversation.system = argument or None
            self._note("system message set" if argument else "system message removed")
        elif name == "clear":
            self.conversation.clear()
            self._note("conversation cleared")
        elif name == "save":
            try:
                self.conversation.save(Path(argument).expanduser(), self.session.model.stem)
            except OSError as e:
                raise CommandError(f"cannot save to {argument}: {e.strerror or e}") from None
            self._note(f"conversation saved to {argument}")
        elif argument:
            await self._turn(argument)

    async def _turn(self, text: str) -> None:
        asker = self.session.asker
        self.conversation.turns.append(Turn("user", text))
        try:
            prompt = asker.tokenizer.encode_chat(self.conversation.messages())
        except TemplateError as e:  # a template that insists on an order of roles, say
            self.conversation.turns.pop()
            raise CommandError(f"the model's chat template refused the conversation: {e}") from None
        if len(prompt) >= asker.max_context:
            self.conversation.turns.pop()
            raise CommandError(f"the conversation has {len(prompt)} tokens, more than the context length "
                               f"({asker.max_context}): /clear to start over (or --ctx)")
        shown: list[str] = []
        self.answering = asyncio.create_task(self._answer(prompt, shown))
        try:
            finish = await self.answering
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the chat itself is ending
            finish = "interrupted"
        except (EngineError, OSError) as e:  # the swarm failed this answer; the next may work
            self.conversation.turns.pop()
            raise CommandError(f"error: {' '.join(str(e).split())}") from None
        finally:
            self.answering = None
        self.conversation.turns.append(Turn("assistant", "".join(shown)))
        if finish == "interrupted":
            self._note("(answer stopped)")
        elif finish == "context":
            self._note(f"(the context is full: {asker.max_context} tokens; /clear to start over)")

    async def _answer(self, prompt: list[int], shown: list[str]) -> str | None:
        """Stream the answer to stdout; its finish reason."""
        from swarmctl.asker.head_tail import Generation

        asker, session = self.session.asker, self.session
        decoder = asker.tokenizer.stream_decoder()
        generation = Generation(secrets.token_bytes(16), len(prompt))
        tokens = asker.generate(prompt, session.trunk, max_tokens=self.settings.max_tokens or asker.max_context,
                                sampling=self.settings.sampling, generation=generation,
                                speculation=session.drafting.for_request(), prefixes=self.prefixes)
        try:
            async with aclosing(tokens):  # on Ctrl-C too: the asker frees the request
                async for token in tokens:
                    self._show(decoder.push(token), shown)
        finally:
            self._show(decoder.flush(), shown)
            self.out.write("\n")  # (not part of the answer)
            self.out.flush()
            log.info("%d prompt tokens (%d from the kept prefix), %d generated, finish: %s", len(prompt),
                     generation.cached_tokens, len(generation.tokens), generation.finish_reason)
        return generation.finish_reason

    def _show(self, text: str, shown: list[str]) -> None:
        if text:
            shown.append(text)
            self.out.write(text)
            self.out.flush()

    def _interrupt(self) -> None:
        if self.answering is not None and not self.answering.done():
            self.answering.cancel()
        else:
            if self.settings.interactive:
                self.out.write("\n")
            self._note("(Ctrl-D or /exit ends the chat)")
            self._prompt()

    def _prompt(self) -> None:
        if self.settings.interactive:
            self.out.write(PROMPT)
            self.out.flush()

    def _note(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()
