"""Chat with the model in the terminal: each answer streams as it is generated, and every turn
sees the whole conversation (the model's chat template). One asker session serves the whole chat.

Type a message and press Enter. Commands: /system TEXT sets the system message, /clear forgets
the conversation, /save FILE writes it as JSON, /exit (or Ctrl-D) ends the chat. Ctrl-C stops an
answer; the chat goes on. The swarm options are ask's: with none joined a local swarm starts for
the chat; --transport inproc runs every slice in this process.

examples:
  swarmctl chat
  swarmctl chat --system "You are a terse assistant." --temperature 0
  printf 'Hi!\\n/save chat.json\\n' | swarmctl chat --transport inproc
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from swarmctl.commands.options import add_asker_options, add_sampling_options, sampling_params, session_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_asker_options(parser, model_default="the bundled SmolLM2-135M-Instruct")
    add_sampling_options(parser, max_tokens=None,
                         max_tokens_help="tokens per answer at most (default: until it ends or the context is full)")
    parser.add_argument("--system", metavar="TEXT", help="a system message to start with (/system changes it)")


def run(args: argparse.Namespace) -> int:
    sampling = sampling_params(args)
    return asyncio.run(_chat(args, sampling))


async def _chat(args: argparse.Namespace, sampling) -> int:
    from swarmctl.asker.session import open_session
    from swarmctl.chat.terminal import ChatSettings, LineReader, TerminalChat
    from swarmctl.chat.conversation import Conversation

    settings = ChatSettings(sampling, args.max_tokens, interactive=sys.stdin.isatty())
    async with open_session(session_options(args)) as session:
        chat = TerminalChat(session, settings, Conversation(system=args.system or None))
        return await chat.run(LineReader(sys.stdin))
