"""The ``swarmctl`` command line: a table of commands, loaded lazily, and one place that turns
errors into a one-line message and an exit code."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import sys
from dataclasses import dataclass
from typing import Sequence

from kernels.threads import default_threads
from swarmctl import __version__
from swarmctl.errors import UsageError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class CommandInfo:
    module: str
    summary: str


COMMANDS: dict[str, CommandInfo] = {
    "ask": CommandInfo("swarmctl.commands.ask", "ask the model and stream its answer"),
    "chat": CommandInfo("swarmctl.commands.chat", "chat with the model in the terminal (/help inside)"),
    "serve": CommandInfo("swarmctl.commands.serve", "serve the model over an OpenAI-compatible HTTP API"),
    "init": CommandInfo("swarmctl.commands.init", "create a swarm here (this machine becomes the host)"),
    "invite": CommandInfo("swarmctl.commands.invite", "print a one-line invite code for a friend"),
    "join": CommandInfo("swarmctl.commands.join", "join a swarm with an invite code"),
    "run": CommandInfo("swarmctl.commands.run", "run this node: --role host or --role trunk"),
    "status": CommandInfo("swarmctl.commands.status", "show members, layer ranges and health"),
    "top": CommandInfo("swarmctl.commands.top", "watch the swarm live: load per node, pipeline occupancy"),
    "revoke": CommandInfo("swarmctl.commands.revoke", "end a member's access"),
    "config": CommandInfo("swarmctl.commands.config", "show or change the planner's settings (host only)"),
    "audit": CommandInfo("swarmctl.commands.audit", "measure what swarm members can read from your traffic"),
    "plan": CommandInfo("swarmctl.commands.plan", "plan which members serve which layers (runs nothing)"),
    "devices": CommandInfo("swarmctl.commands.devices", "list the devices (CPU, GPUs) slices can compute on here"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        raise UsageError(f"{self.prog}: {message}")


def _top_level_help() -> str:
    lines = [f"swarmctl {__version__}: pool friends' machines to run one large language model", "",
             "usage: swarmctl COMMAND [options]   (swarmctl COMMAND --help for details)", "", "commands:"]
    lines += [f"  {name:<10} {info.summary}" for name, info in COMMANDS.items()]
    return "\n".join(lines)


def _parser_for(name: str) -> tuple[argparse.ArgumentParser, object]:
    module = importlib.import_module(COMMANDS[name].module)
    parser = _Parser(prog=f"swarmctl {name}", description=module.__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. A reader that stops reading early (``swarmctl status |
    head -1``, a closed terminal) ends the command quietly, as a CLI tool should: no traceback, and
    status 0, because what it printed went where it was asked until nobody wanted more."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at interpreter exit, where a closed pipe cannot be caught
    except BrokenPipeError as error:
        if not _reader_gone():  # a socket of the command's own broke, not its output: an error
            return _report(error)
        _discard_stdout()
        return EXIT_OK


def _reader_gone() -> bool:
    """Whether nobody reads our stdout or stderr any more: poll reports an error or hang-up on
    the writing end of a pipe (or socket, or terminal) whose reader is gone."""
    if not hasattr(select, "poll"):
        return True  # no way to ask: a broken pipe here is most likely our output
    poll = select.poll()
    for stream in (sys.stdout, sys.stderr):
        try:
            poll.register(stream.fileno(), select.POLLOUT)
        except (OSError, ValueError, AttributeError):  # closed, or not a file (a test's StringIO)
            continue
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is still buffered has
    somewhere to go (Python's documented recipe for SIGPIPE; Python ignores the signal itself, and
    restoring its default would let a peer's closed TCP or UDP socket kill `serve` or a node)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no stdout to speak of: nothing will be flushed either
        pass


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] in ("-h", "--help", "help"):
        print(_top_level_help())
        return EXIT_OK if args_list else EXIT_USAGE
    if args_list[0] == "--version":
        print(f"swarmctl {__version__}")
        return EXIT_OK
    name = args_list[0]
    if name not in COMMANDS:
        print(f"swarmctl: unknown command '{name}' (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return EXIT_USAGE
    try:
        parser, module = _parser_for(name)
        args = parser.parse_args(args_list[1:])
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                            format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        logging.getLogger("quic").setLevel(logging.WARNING if args.verbose else logging.ERROR)
        # A bad $SWARMCTL_THREADS is one line here, before a command starts nodes that would each
        # fail on it (a local swarm's `ask` waited on them instead).
        default_threads()
        return int(module.run(args) or EXIT_OK)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("swarmctl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        raise  # the reader went away (main handles it); not an error of the command's
    except Exception as e:  # noqa: BLE001 - the single place errors become exit codes
        return _report(e)


def _report(error: Exception) -> int:
    from kernels.errors import EngineError

    from net.endpoint import AddressError
    from net.identity import IdentityError
    from net.invite import InviteError

    if isinstance(error, (EngineError, OSError, InviteError, IdentityError, AddressError)):
        print(f"swarmctl: error: {_one_line(error)}", file=sys.stderr)
    else:
        print(f"swarmctl: internal error: {type(error).__name__}: {_one_line(error)}"
              " (set SWARMCTL_DEBUG=1 for the traceback)", file=sys.stderr)
    if os.environ.get("SWARMCTL_DEBUG"):
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    return EXIT_ERROR


def _one_line(error: Exception) -> str:
    text = str(error) or type(error).__name__
    return " ".join(text.split())
