"""The panels of ``swarmctl top``. Each holds the reactive values it draws (bound to the app's
with ``data_bind``) and redraws itself when they change; none of them fetches anything."""

from __future__ import annotations

from rich.text import Text
from textual.containers import Vertical
from textual.geometry import Size
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Static

from swarmctl.monitor.snapshot import NodeView, SwarmSnapshot, waiting_snapshot
from swarmctl.tui import format as fmt
from swarmctl.tui.chart import geometry, letter_style, render_chart

SORTS = ("pipeline", "name", "busy", "queue", "tok/s")
SPANS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)  # chart zoom levels, seconds; trunks keep 10 s of batches

_NOTHING = waiting_snapshot("")


def sort_nodes(nodes: tuple[NodeView, ...], key: str) -> list[NodeView]:
    """``pipeline`` keeps the snapshot's order (stages by layer, then the others)."""
    if key == "name":
        return sorted(nodes, key=lambda n: n.name)
    figure = {"busy": lambda n: n.occupancy, "queue": lambda n: n.queue_depth, "tok/s": lambda n: n.tok_s}.get(key)
    if figure is None:
        return list(nodes)
    return sorted(nodes, key=lambda n: (figure(n) is None, -(figure(n) or 0), n.name))


class Summary(Static):
    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING)
    paused: reactive[bool] = reactive(False)

    def render(self) -> Text:
        s = self.snapshot
        text = Text()
        if s.swarm:
            text.append(f"swarm {s.swarm}", style="bold")
            text.append(f" · {s.model} · plan v{s.plan_version} · ")
            if s.complete:
                text.append("complete", style="green")
            else:
                missing = ", ".join(f"[{a}, {b})" for a, b in s.missing_layers)
                text.append(f"INCOMPLETE: no trunk for {missing}", style="bold red")
            text.append(f" · {fmt.count(len(s.lanes), 'stage')} · poll {s.poll_ms:.0f} ms")
        else:
            text.append("swarmctl top", style="bold")
        if self.paused:
            text.append("  ‖ PAUSED (p resumes)", style="bold reverse yellow")
        return text


class Banner(Static):
    """One line over everything when the host cannot be reached (or before it first answers)."""

    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING, repaint=False)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._shown: str | None = None  # updating a Static lays out the screen again: only on a change

    def watch_snapshot(self, snapshot: SwarmSnapshot) -> None:
        if snapshot.banner != self._shown:
            self._shown = snapshot.banner
            self.set_class(bool(snapshot.banner), "-visible")
            self.set_class(snapshot.banner.startswith("swarm unreachable"), "-error")
            self.update(snapshot.banner)


class Panels(Vertical):
    """Everything below the banner; dimmed while it shows the last good poll, not a current one."""

    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING, repaint=False)

    def watch_snapshot(self, snapshot: SwarmSnapshot) -> None:
        self.set_class(snapshot.stale and bool(snapshot.nodes), "-stale")


class NodeTable(Static):
    """One row per member: where it is, what it serves, how loaded it is."""

    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING)
    sort_key: reactive[str] = reactive(SORTS[0])

    COLUMNS = ("NAME", "ADDRESS", "LAYERS", "DEVICE", "MEMORY", "QUEUE", "BUSY", "TOK/S", "NEXT HOP ms",
               "PING ms", "HEALTH")

    def watch_snapshot(self, old: SwarmSnapshot, new: SwarmSnapshot) -> None:
        if len(old.nodes) != len(new.nodes):
            self.refresh(layout=True)  # a row per node: the height follows the membership

    def watch_sort_key(self, key: str) -> None:
        self.border_title = f"nodes · sorted by {key} (s)"

    def render(self) -> Text:
        return fmt.text_table(self.COLUMNS, [
            (Text(n.name, style="bold"), n.address or "-", fmt.layers(n.layers), n.device or "-",
             fmt.memory(n.memory_used, n.memory_budget, n.cached_tokens),
             "-" if n.queue_depth is None else str(n.queue_depth),
             fmt.busy_bar(n.occupancy), fmt.rate(n.tok_s), fmt.next_hop(n.next_hop, n.next_hop_ms, n.next_hop_path),
             fmt.ping(n.ping_ms, n.path),
             Text(n.fetch, style="yellow") if n.fetch else fmt.health(n.health, n.stats_error, n.ping_ms))
            for n in sort_nodes(self.snapshot.nodes, self.sort_key)])


class OccupancyChart(Widget):
    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING)
    span_s: reactive[float] = reactive(1.0)

    def watch_span_s(self, span: float) -> None:
        self.border_title = f"pipeline occupancy · last {span:g} s (+/- zoom)"
        self._describe_cells()

    def watch_snapshot(self, old: SwarmSnapshot, new: SwarmSnapshot) -> None:
        if len(old.lanes) != len(new.lanes):
            self.refresh(layout=True)  # one line per lane: the height follows the plan
        self._describe_cells()

    def on_resize(self) -> None:
        self._describe_cells()

    def _describe_cells(self) -> None:
        _, n_cells = geometry(self.snapshot.lanes, self.content_size.width)
        self.border_subtitle = (f"a-z: the request a stage ran · 2-9: that many requests in one cell · "
                                f"· idle · cell = {self.span_s / n_cells * 1e3:.1f} ms")

    def render(self) -> Text:
        errors = {n.name: f"(host says {n.health}) {n.stats_error}" for n in self.snapshot.nodes if n.stats_error}
        return render_chart(self.snapshot.lanes, self.span_s, self.content_size.width, errors)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self.snapshot.lanes)) + 1


class RequestTable(Static):
    """Requests the trunks hold, with the letter that marks each in the chart."""

    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING)

    COLUMNS = (" ", "REQUEST", "TOKENS", "TOK/S", "DRAFT", "LAST AT", "IDLE s")

    def watch_snapshot(self, snapshot: SwarmSnapshot) -> None:
        self.border_title = f"requests in flight · {len(snapshot.requests)}"

    def render(self) -> Text:
        return fmt.text_table(self.COLUMNS, [
            (Text(r.letter, style=f"bold {letter_style(r.letter)}"), r.request_id, str(r.tokens), fmt.rate(r.tok_s),
             fmt.acceptance(r.drafted, r.accepted), r.stage, f"{r.idle_s:.1f}") for r in self.snapshot.requests],
            max_rows=max(1, self.content_size.height - 1))


class RatePanel(Static):
    """Swarm-wide tokens per second: the figure now in the title, one bar per poll below."""

    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING)

    def watch_snapshot(self, snapshot: SwarmSnapshot) -> None:
        history = snapshot.tok_s_history
        shown = min(len(history), max(1, self.content_size.width))
        covered = snapshot.history_s * (shown - 1) / (len(history) - 1) if len(history) > 1 else 0.0
        self.border_title = (f"swarm tok/s: {snapshot.tok_s:.1f} now · peak {max(history[-shown:], default=0.0):.1f}"
                             f" · last {covered:.0f} s")

    def on_resize(self) -> None:
        self.watch_snapshot(self.snapshot)  # the title says how much history fits

    def render(self) -> Text:
        return fmt.spark(list(self.snapshot.tok_s_history), self.content_size.width, self.content_size.height)


class PlanPanel(Static):
    """The planner's expectations beside what is measured, and the recovery counters."""

    snapshot: reactive[SwarmSnapshot] = reactive(_NOTHING)

    def on_mount(self) -> None:
        self.border_title = "plan"

    def render(self) -> Text:
        s, p = self.snapshot, self.snapshot.plan
        rows = [
            ("objective", p.objective or "-"),
            ("expected", f"{p.expected_ms_per_token:.1f} ms/token alone · {p.expected_tok_s:.0f} tok/s pipelined"
             if p.expected_tok_s else "-"),
            ("measured", f"{s.tok_s:.1f} tok/s at the first stage"),
            ("bottleneck", p.bottleneck or "-"),
            ("recoveries", f"{p.recoveries}" + (f", last took {p.last_recovery_s:.1f} s" if p.last_recovery_s else "")
             + (f", last marked down: {p.last_marked_down}" if p.last_marked_down else "")),
            ("warnings", "; ".join(p.warnings) or "-"),
        ]
        text = Text()
        for i, (name, value) in enumerate(rows):
            text.append(f"{name:<11}", style="bold")
            text.append(value + ("\n" if i + 1 < len(rows) else ""),
                        style="yellow" if name == "warnings" and p.warnings else "")
        return text
