"""The pipeline occupancy chart: the design's cycle table, drawn from what the stages ran.

Time runs left to right over the last ``span_s`` seconds, one lane per stage, one character per
time cell. A cell shows which request the stage worked on in that cell: its letter when one
request, the number of requests when several (batched together, or one after another within
the cell), ``·`` when the stage was idle for the whole cell. Bubbles and stalls are runs of ``·``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text

from swarmctl.monitor.build import LETTERS
from swarmctl.monitor.snapshot import Lane

IDLE = "·"
PALETTE = ("cyan", "magenta", "green", "yellow", "bright_blue", "bright_red", "bright_green", "dark_orange")
MIN_CELLS = 10


@dataclass(frozen=True)
class Cell:
    letters: frozenset[str]
    busy_s: float


def lane_cells(lane: Lane, span_s: float, n_cells: int) -> list[Cell]:
    """The lane's batches cut into ``n_cells`` equal cells, oldest on the left, ending at the
    stage's clock when it was polled."""
    width = span_s / n_cells
    letters: list[set[str]] = [set() for _ in range(n_cells)]
    busy = [0.0] * n_cells
    for batch in lane.batches:
        start = span_s - batch.ago_s  # seconds from the left edge
        end = start + batch.seconds
        if end <= 0 or start >= span_s:
            continue
        first, last = max(0, int(start / width)), min(n_cells - 1, int(min(end, span_s - 1e-9) / width))
        for i in range(first, last + 1):
            overlap = min(end, (i + 1) * width) - max(start, i * width)
            if overlap > 0:
                busy[i] += overlap
                letters[i].update(batch.letters)
    return [Cell(frozenset(ls), b) for ls, b in zip(letters, busy)]


def letter_style(letter: str) -> str:
    index = LETTERS.find(letter)
    return PALETTE[index % len(PALETTE)] if index >= 0 else "white"


def cell_text(cell: Cell) -> tuple[str, str]:
    if not cell.letters:
        return IDLE, "bright_black"
    if len(cell.letters) == 1:
        (letter,) = cell.letters
        return letter, f"bold {letter_style(letter)}"
    n = len(cell.letters)
    return (str(n) if n < 10 else "+"), "bold reverse"


def lane_label(lane: Lane) -> str:
    return f"{lane.name} [{lane.layers[0]},{lane.layers[1]})"


def geometry(lanes: tuple[Lane, ...], width: int) -> tuple[int, int]:
    """(label width, number of time cells) for a chart ``width`` characters wide."""
    label_width = max((len(lane_label(lane)) for lane in lanes), default=0) + 1
    return label_width, max(MIN_CELLS, width - label_width)


def render_chart(lanes: tuple[Lane, ...], span_s: float, width: int, errors: dict[str, str] | None = None) -> Text:
    """Every lane as one line ``label cells``, then a time axis under the cells."""
    errors = errors or {}
    if not lanes:
        return Text("no stages in the plan yet", style="italic")
    labels = [lane_label(lane) for lane in lanes]
    label_width, n_cells = geometry(lanes, width)
    out = Text()
    for lane, label in zip(lanes, labels):
        out.append(label.ljust(label_width), style="bold")
        if not lane.reachable:
            reason = errors.get(lane.name) or "no answer"
            out.append(f"no stats from {lane.name} {reason}"[:n_cells], style="yellow")
        else:
            _append_runs(out, [cell_text(cell) for cell in lane_cells(lane, span_s, n_cells)])
        out.append("\n")
    out.append(" " * label_width + axis(span_s, n_cells), style="bright_black")
    return out


def _append_runs(out: Text, marks: list[tuple[str, str]]) -> None:
    """Append marks, one span per run of the same style: drawing cost grows with spans, not cells."""
    run, style = "", None
    for mark, mark_style in marks:
        if mark_style != style and run:
            out.append(run, style=style)
            run = ""
        run, style = run + mark, mark_style
    if run:
        out.append(run, style=style)


def axis(span_s: float, n_cells: int) -> str:
    """'-1.0s ..... -0.5s ..... now' across ``n_cells`` characters."""
    left, middle, right = f"-{span_s:g}s", f"-{span_s / 2:g}s", "now"
    line = [" "] * n_cells
    line[:len(left)] = left
    mid = n_cells // 2 - len(middle) // 2
    line[mid:mid + len(middle)] = middle
    line[n_cells - len(right):] = right
    return "".join(line)[:n_cells]
