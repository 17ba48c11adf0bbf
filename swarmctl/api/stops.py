"""Stop strings in streamed text: cut the text where one first appears.

Text is released as it comes, except a tail that could still turn into a stop string once the
next piece arrives; so nothing already sent ever has to be taken back.
"""

from __future__ import annotations

from typing import Sequence


class StopScanner:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""  # text not yet released: the start of a possible stop string
        self.found: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to release, whether a stop string was found). After a
        stop, the released text ends just before it and the rest is dropped."""
        held = self._held + text
        cut, found = min(((i, s) for s, i in ((s, held.find(s)) for s in self.stops) if i >= 0), default=(-1, None))
        if cut >= 0:
            self._held, self.found = "", found
            return held[:cut], True
        keep = self._partial_stop_length(held)
        self._held = held[len(held) - keep:] if keep else ""
        return held[:len(held) - keep], False

    def flush(self) -> str:
        """At the end of generation: whatever was held back is plain text after all."""
        held, self._held = self._held, ""
        return held

    def _partial_stop_length(self, text: str) -> int:
        """The length of the longest end of ``text`` that is the beginning of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
