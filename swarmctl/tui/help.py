"""The ``?`` screen: the keys, and what each figure is (and is not)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]keys[/b]
  p        pause the view (polling goes on; p again shows the latest)
  s        sort nodes: pipeline order, name, busy, queue, tok/s
  + / -    zoom the occupancy chart: 0.25 s to 10 s
  ?        this help (esc or ? closes it)
  q        quit

[b]nodes[/b] (one row per member the host knows)
  MEMORY      resident memory of the trunk process / the memory it offered
  QUEUE       steps waiting for the stage's engine right now
  BUSY        share of the last few seconds (the window) its engine was computing
  TOK/S       request steps per second over the window: one per generated token
  NEXT HOP    the stage it sends to, and that link's round trip in ms as the node
              measured it for the planner; for the last stage, "asker": its round
              trip to the host, which stands in for askers (not a live figure)
  PING        round trip from this screen to the node now (a QUIC PING; it includes
              the node's event-loop delay, so a busy node answers later); "punched"
              or "relayed": how this screen reaches a node behind a NAT
  HEALTH      the host's view, or "no stats" when this screen cannot reach the node
              (its chart lane says why); "host: down" (not plain "down") when the
              host counts down a node that answers this screen's ping

[b]pipeline occupancy[/b]
  One lane per trunk stage, time left to right. A letter is the request a stage
  ran in that cell (see the requests panel), a digit how many requests shared the
  cell, · idle. The asker's own head and tail layers are not drawn: the asker is
  not a server, nothing here can ask it.

[b]requests in flight[/b] (as the trunks hold them)
  TOKENS      tokens in the request's cache at the stage furthest along (prompt too)
  TOK/S       its steps per second at the first stage
  DRAFT       speculative decoding: drafts the asker kept / drafted, "-" for none
  LAST AT     the stage that last worked on it; IDLE s since then (a long idle:
              waiting at the asker, or stalled)

[b]swarm tok/s[/b]: the first stage's steps per second, one point per poll.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark", "dismiss", "close"), Binding("q", "app.quit", "quit")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP, markup=True)
