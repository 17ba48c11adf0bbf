"""Watch the swarm work, live: every node's load, the pipeline's occupancy, requests in flight.

Connects to the swarm as this member (mutual TLS, like any member) and polls the host and every
trunk twice a second; the screen redraws at most four times a second. Keys: p pause, s sort,
+/- zoom the occupancy chart, ? help, q quit. When the swarm cannot be reached, the screen says
so and keeps retrying.

examples:
  swarmctl top
  swarmctl top --interval 1 --window 10
  swarmctl top --record swarm.jsonl        # also keep every poll, to replay later
  swarmctl top --replay swarm.jsonl        # show a recording instead of the live swarm
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator

from swarmctl.errors import UsageError

MAX_WINDOW_S = 10.0  # trunks report the last 10 s of batches
DEFAULT_NICE = 10  # drawing a full screen twice a second costs ~10 % of a core; the swarm comes first


def _seconds(low: float, high: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low:g} and {high:g} seconds, got {value:g}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=_seconds(0.1, 60), default=0.5, metavar="S",
                        help="seconds between polls of the swarm (default 0.5)")
    parser.add_argument("--window", type=_seconds(0.5, MAX_WINDOW_S), default=5.0, metavar="S",
                        help="busy %% and tok/s are over the last S seconds (default 5, at most 10)")
    parser.add_argument("--span", type=_seconds(0.25, MAX_WINDOW_S), default=1.0, metavar="S",
                        help="seconds the occupancy chart shows at first (default 1; +/- zoom)")
    parser.add_argument("--refresh", type=_seconds(0.25, 10), default=0.25, metavar="S",
                        help="seconds between redraws (default and minimum 0.25)")
    parser.add_argument("--nice", type=int, choices=range(0, 20), default=DEFAULT_NICE, metavar="N",
                        help=f"lower this process's CPU priority by N (default {DEFAULT_NICE}: on a machine that "
                             "also runs a node, the node gets the CPU first; 0 keeps it)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--record", type=Path, metavar="FILE", help="also write every poll to FILE (JSON lines)")
    source.add_argument("--replay", type=Path, metavar="FILE", help="show a recording made with --record")


def run(args: argparse.Namespace) -> int:
    from swarmctl.node.home import SwarmHome
    from swarmctl.monitor.poller import Monitor, MonitorConfig
    from swarmctl.monitor.recording import Recorder, ReplayFeed, read_recording
    from swarmctl.tui.app import TopApp

    recorder = None
    if args.replay is not None:
        if not args.replay.is_file():
            raise UsageError(f"swarmctl top: no recording at {args.replay}")
        feed = ReplayFeed(read_recording(args.replay), window_s=args.window)
    else:
        feed = Monitor(SwarmHome(), MonitorConfig(interval_s=args.interval, window_s=args.window))
        if args.record is not None:
            recorder = Recorder(args.record)
            feed.on_poll = recorder.write
    lower_priority(args.nice)
    try:
        with _logs_off_the_screen():
            TopApp(feed, refresh_s=args.refresh, span_s=args.span).run()
    finally:
        if recorder is not None:
            recorder.close()
    return 0


def lower_priority(nice: int) -> None:
    """Let a swarm node on this machine have the CPU before the view does."""
    if nice > 0 and hasattr(os, "nice"):
        try:
            os.nice(nice)
        except OSError:
            pass  # not allowed here: the view runs at normal priority


@contextlib.contextmanager
def _logs_off_the_screen() -> Iterator[None]:
    """Log lines written to the terminal would tear through the picture; hold them back."""
    root = logging.getLogger()
    handlers = root.handlers[:]
    for handler in handlers:
        root.removeHandler(handler)
    root.addHandler(logging.NullHandler())
    try:
        yield
    finally:
        root.handlers[:] = handlers
