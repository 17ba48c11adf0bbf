"""One request's windows in flight, with no I/O: which step goes out next, what a window in
flight is guessed from, and what a verdict cancels and rewinds.

A window is a step out: its lead (the last chosen token, a prompt's last chunk, or, for a window
in flight, the guess of what follows the window before it) and its drafts. While the windows
out keep all their drafts, the next one's step stands; when one does not, every later window
falls (its task is cancelled) and the next step starts after the last kept draft, rewinding the
cells the fallen windows wrote. The cap on windows out is one field of the speculation policy
(``DraftLength.max_windows``, ``plans/whatif.MAX_WINDOWS``: the planner's what-if uses the same).

The asker (``Asker._steps``, ``swarmctl/asker/head_tail.py``) drafts and runs the steps:

    nothing out             ``room(left)``, ``rewinds``   then ``add(Window(start, lead, draft, task))``
    another window to send  ``guess(left, cap, k)``       a Guess to draft from, or None: enough out
    the oldest's turn       ``take()``                    the window whose result to wait for
    its tokens chosen       ``context.append(token)``
    its verdict             ``verdict(window, kept, chain_holds, last)``  the windows to cancel
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernels.sampling import Candidates
from swarmctl.asker.speculate import Draft


@dataclass
class Window:
    """A step out, and the task running it through head, trunk and tail: (logits, TokenTiming)."""

    start: int
    lead: list[int]
    draft: Draft
    task: Any  # an asyncio future; only stored here
    guess_q: Candidates | None = None  # a guessed lead: the distribution it was drafted from (None: a point mass)

    @property
    def end(self) -> int:
        return self.start + len(self.lead) + len(self.draft.tokens)


@dataclass(frozen=True)
class Guess:
    """Draft ``k`` + 1 tokens after ``context`` (every window out kept whole): the first is the next
    window's lead, the rest its drafts; it starts at ``start``."""

    start: int
    k: int
    context: list[int]


@dataclass
class Windows:
    start: int  # where the next step starts when no window is out
    lead: list[int]  # ... and its tokens before any drafts
    context: list[int]  # the prompt and every token chosen so far
    max_context: int
    filled: int = -1  # positions the stages hold, or will once the windows out reach them
    out: list[Window] = field(default_factory=list)  # oldest first

    def __post_init__(self) -> None:
        self.filled = self.start if self.filled < 0 else self.filled

    def room(self, left: int) -> int:
        """Drafts the next step may carry: no room past the context or max_tokens (``left``: tokens
        still to generate, the step's own choice included)."""
        return min(left - 1, self.max_context - self.start - len(self.lead) - 1)

    @property
    def rewinds(self) -> bool:
        """The next step starts before positions already sent (fallen windows' cells are dropped)."""
        return self.start < self.filled

    def add(self, window: Window) -> None:
        self.out.append(window)

    def guess(self, left: int, cap: int, k: int) -> Guess | None:
        """Another window in flight, while fewer than ``cap`` are out and the last one's lead is one
        token (never after a prompt chunk); None when none goes, or the last window's own choice
        reaches max_tokens (``left``) or the context: nothing to guess."""
        if len(self.out) >= cap or len(self.out[-1].lead) != 1:
            return None
        last = self.out[-1]
        ahead = sum(len(w.draft.tokens) for w in self.out) + len(self.out) - 1  # before the last one's own choice
        k = min(k, left - ahead - 2, self.max_context - last.end - 2)
        if k < 0:
            return None
        assumed = self.context + self.out[0].draft.tokens + [t for w in self.out[1:] for t in w.lead + w.draft.tokens]
        return Guess(last.end, k, assumed)

    def take(self) -> Window:
        """The oldest window, whose result comes first."""
        self.filled = max(self.filled, self.out[-1].end)
        return self.out.pop(0)

    @property
    def following(self) -> Window | None:
        """The window after the one taken: its lead is the guess the taken one's last row checks."""
        return self.out[0] if self.out else None

    def verdict(self, window: Window, kept: int, chain_holds: bool, last: int) -> list[Window]:
        """``window`` kept ``kept`` drafts and ``last`` is the last token chosen. If the chain holds
        (every draft kept and the guess after them), the following window's step stands; else the
        later windows fall (returned, to cancel) and the next step starts after the last kept draft."""
        if chain_holds:
            following = self.out[0]
            self.start, self.lead = following.start, list(following.lead)
            return []
        fallen, self.out = self.out, []
        self.start, self.lead = window.start + len(window.lead) + kept, [last]
        return fallen

    @property
    def context_full(self) -> bool:
        return self.start + 1 > self.max_context
