"""The ``swarmctl top`` application: a feed of snapshots in, a live picture of the swarm out.

The feed (a ``Monitor`` polling the swarm, or a replayed recording) runs as a worker; the app
only reads ``feed.latest()`` on a timer, at most four times a second, and assigns it to
``snapshot``, which the panels are bound to. Pausing stops that assignment, not the feed.
"""

from __future__ import annotations

from typing import Protocol

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Footer
from textual.worker import Worker, WorkerState

from swarmctl.monitor.snapshot import SwarmSnapshot, waiting_snapshot
from swarmctl.tui.help import HelpScreen
from swarmctl.tui import styles
from swarmctl.tui.widgets import (SORTS, SPANS, Banner, NodeTable, OccupancyChart, Panels, PlanPanel, RatePanel,
                                  RequestTable, Summary)

MIN_REFRESH_S = 0.25  # at most 4 redraws a second: the view never competes with the swarm for the CPU


class Feed(Protocol):
    def latest(self) -> SwarmSnapshot: ...

    async def run(self) -> None: ...


class TopApp(App[None]):
    CSS = styles.CSS
    TITLE = "swarmctl top"
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("p", "toggle_pause", "pause"),
        Binding("s", "cycle_sort", "sort"),
        Binding("plus,equals_sign", "zoom(-1)", "zoom in", key_display="+"),
        Binding("minus", "zoom(1)", "zoom out", key_display="-"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("q", "quit", "quit"),
    ]

    snapshot: reactive[SwarmSnapshot] = reactive(waiting_snapshot(""))
    paused: reactive[bool] = reactive(False)
    sort_key: reactive[str] = reactive(SORTS[0])
    span_s: reactive[float] = reactive(1.0)

    def __init__(self, feed: Feed, *, refresh_s: float = MIN_REFRESH_S, span_s: float = 1.0) -> None:
        super().__init__()
        self.feed = feed
        self.refresh_s = max(MIN_REFRESH_S, refresh_s)
        self.set_reactive(TopApp.span_s, min(SPANS, key=lambda s: abs(s - span_s)))
        self.set_reactive(TopApp.snapshot, feed.latest())

    def compose(self) -> ComposeResult:
        yield Summary(id="summary").data_bind(TopApp.snapshot, TopApp.paused)
        yield Banner(id="banner").data_bind(TopApp.snapshot)
        with Panels(id="panels").data_bind(TopApp.snapshot):
            yield NodeTable(id="nodes").data_bind(TopApp.snapshot, TopApp.sort_key)
            yield OccupancyChart(id="chart").data_bind(TopApp.snapshot, TopApp.span_s)
            with Horizontal(id="bottom"):
                yield RequestTable(id="requests").data_bind(TopApp.snapshot)
                with Vertical(id="side"):
                    yield RatePanel(id="rate").data_bind(TopApp.snapshot)
                    yield PlanPanel(id="plan").data_bind(TopApp.snapshot)
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(self.feed.run(), name="feed", exit_on_error=False)
        self.set_interval(self.refresh_s, self.take_snapshot)

    def take_snapshot(self) -> None:
        if self.paused:
            return
        latest = self.feed.latest()
        if latest is not self.snapshot:
            self.snapshot = latest

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR:  # a bug in the feed: say so, keep the last picture
            self.notify(f"the feed stopped: {event.worker.error!r}", severity="error", timeout=30)

    # --- actions ---

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.take_snapshot()

    def action_cycle_sort(self) -> None:
        self.sort_key = SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)]

    def action_zoom(self, step: int) -> None:
        index = SPANS.index(self.span_s) + step
        self.span_s = SPANS[max(0, min(len(SPANS) - 1, index))]

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        else:
            self.push_screen(HelpScreen())
