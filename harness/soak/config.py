"""The soak's settings: its configuration, its prompts and the thresholds of its verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

GRACE_S = 5.0  # an outage window lasts until the swarm is whole again, plus this
RSS_TOLERANCE = 0.10  # last third's median RSS at most 10 % above the middle third's
STREAMS_SLACK = 4  # last third's median open streams at most this many above the middle third's
IDLE_STREAMS = 3  # idle trunk: the host's plan stream, the stats query, serve's results subscription
IDLE_WAIT_S = 20.0
PROCESS_WARMUP_S = 60.0  # a (re)started process's first minute is its own warm-up (its allocations grow as it
#                          meets new batch sizes and prompt lengths); its samples then are not judged
STATS_WAIT_S = 4.0  # a sample waits this long for a trunk's stats
QUIET_S = 5.0  # at least this long between one fault's recovery and the next fault
RECOVERY_TIMEOUT_S = 90.0  # a fault's wait for the swarm to be whole again


class Prompt(NamedTuple):
    """A prompt of the soak; a plain ``(mode, text, max_tokens)`` tuple works as well."""

    mode: str  # "chat" goes through the model's chat template, "raw" does not
    text: str
    max_tokens: int


_SHELVES = "\n".join(f"Shelf {i}: {3 + (i * 7) % 40} {c} {thing}, counted on day {1 + (i * 5) % 28}."
                     for i, (c, thing) in enumerate(zip(
                         ["red", "blue", "green", "yellow", "black", "white", "grey", "orange"] * 3,
                         ["cups", "plates", "bowls", "forks", "spoons", "knives", "jars", "pans"] * 3), start=1))
_STORY = ("The lighthouse keeper had lived alone on the island for eleven years. Every evening he climbed the "
          "one hundred and twelve steps of the tower, cleaned the great lens with a soft cloth, trimmed the "
          "wick and lit the lamp. Ships passed far out at sea, and he wrote their names in a leather book: "
          "the Margaret, the Northern Star, the Halcyon. In winter the storms came from the west and the "
          "waves broke over the rocks so high that salt crusted the windows of the lamp room. One night, "
          "during the worst storm anyone could remember, the lamp went out.")
PROMPTS: list[Prompt] = [
    Prompt("chat", "Hi!", 12),
    Prompt("raw", "The capital of France is", 8),
    Prompt("chat", "Give me three tips for staying healthy.", 32),
    Prompt("raw", "Once upon a time, in a lighthouse by a cold grey sea,", 24),
    Prompt("raw", "def fibonacci(n):\n", 24),
    Prompt("chat", _STORY + "\n\nWhat do you think happened next? Answer in two sentences.", 16),
    Prompt("raw", "Inventory of the kitchen store room.\n" + _SHELVES + "\nThe shelf with the most items is Shelf", 8),
    Prompt("chat", "Here is a list:\n" + _SHELVES + "\n\nWhich colours appear in the list?", 16),
]


@dataclass
class Config:
    minutes: float = 10.0
    seed: int = 1
    deadline_s: float = 120.0
    askers: int = 3  # concurrent `ask` processes from the asker's home
    friend_askers: int = 1  # ... and from another member's home
    api_clients: int = 2
    max_requests: int = 0  # 0: 150 per minute
    poll_s: float = 3.0
    restart_after_s: float = 5.0
    freeze_s: float = 6.0
    join: bool = True
    kill_at: float = 0.20  # fractions of the load's length; a fault also waits until the swarm has
    freeze_at: float = 0.45  # recovered from the one before and QUIET_S more have passed
    join_at: float = 0.65
    threads: int = 1
    pause_s: float = 1.5  # a client waits up to this long (uniformly) between two requests

    @property
    def load_s(self) -> float:
        """The length of the load in seconds."""
        return self.minutes * 60

    @property
    def request_limit(self) -> int:
        """--max-requests, or 150 a minute (and 20) when it is 0."""
        return self.max_requests or int(150 * self.minutes) + 20
