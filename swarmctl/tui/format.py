"""Short, fixed-width renderings of figures for table cells."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text

BAR_WIDTH = 6
_EIGHTHS = " ▏▎▍▌▋▊▉"  # left parts of a cell, for bars that grow rightwards
_LOWER = " ▁▂▃▄▅▆▇"  # lower parts, for bars that grow upwards

HEALTH_STYLES = {"ready": "green", "up": "green", "up (host)": "green", "loading": "yellow"}


def size(n: int | None) -> str:
    """Bytes in at most 5 characters: 512K, 97M, 3.1G, 12G."""
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{n}B"


def count(n: int, noun: str) -> str:
    """'1 stage', '2 stages', '0 stages'."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def memory(used: int | None, budget: int | None, cached_tokens: int = 0) -> str:
    """Used/offered, and the prompt tokens kept for askers' next requests, if any."""
    text = "-" if used is None and budget is None else f"{size(used)}/{size(budget)}"
    return text + (f", {cached_tokens} tok cached" if cached_tokens else "")


def busy_bar(fraction: float | None) -> Text:
    """A bar of eighths and a percentage: '███▌   58%'."""
    if fraction is None:
        return Text("-")
    eighths = round(max(0.0, min(1.0, fraction)) * BAR_WIDTH * 8)
    bar = "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")
    style = "red" if fraction >= 0.9 else "yellow" if fraction >= 0.6 else "green"
    return Text.assemble((bar.ljust(BAR_WIDTH), style), f" {fraction * 100:3.0f}%")


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def ping(rtt_ms: float | None, path: str = "") -> str:
    """This screen's round trip to a node, and the kind of path where it is not plain direct:
    "41 punched", "45 relayed" (a member behind a NAT; through whom, `status` says)."""
    kind = path.split()[0] if path else ""
    if rtt_ms is None or kind in ("", "direct"):
        return ms(rtt_ms)
    return f"{ms(rtt_ms)} {kind}"


def acceptance(drafted: int, accepted: int) -> str:
    """Speculative drafts kept of drafted, and the share: '12/15 80%'; '-' for a request with no
    drafts (not speculating, or a trunk too old to count them)."""
    if drafted <= 0:
        return "-"
    return f"{accepted}/{drafted} {accepted / drafted * 100:.0f}%"


def layers(span: tuple[int, int] | None) -> str:
    return f"[{span[0]}, {span[1]})" if span else "-"


def next_hop(name: str, rtt_ms: float | None, path: str = "") -> str:
    if not name:
        return "-"
    if path and path != "direct":  # a relayed hop says through whom
        name = f"{name} ({path})"
    return f"{name} {ms(rtt_ms)}" if rtt_ms is not None else f"{name} ?"


def health(text: str, stats_error: str, ping_ms: float | None = None) -> Text:
    """The host's word for a node, qualified by what this screen sees of it: a node the host
    counts down while it answers our ping is not simply down (the host's view can lag, or be
    about another connection of the same member)."""
    style = HEALTH_STYLES.get(text, "red")
    if stats_error:  # the host's word for it is in its chart lane
        return Text("no stats", style="yellow")
    if text == "down" and ping_ms is not None:
        return Text("host: down", style="yellow")  # fits the column; PING beside it is live
    return Text(text, style=style)


Cell = str | Text


def text_table(columns: tuple[str, ...], rows: list[tuple[Cell, ...]], *, max_rows: int | None = None) -> Text:
    """A header and rows in aligned columns, two spaces apart, as one ``Text``: a tenth of what a
    DataTable costs to draw, which matters for a view redrawn twice a second beside a swarm.
    Beyond ``max_rows`` rows, a last line says how many more there are."""
    if max_rows is not None and len(rows) > max_rows:
        hidden = len(rows) - max(0, max_rows - 1)
        rows = rows[:max(0, max_rows - 1)]
    else:
        hidden = 0
    cells = [[c if isinstance(c, Text) else Text(c) for c in row] for row in rows]
    widths = [max([cell_len(h)] + [row[i].cell_len for row in cells]) for i, h in enumerate(columns)]
    out = Text("  ".join(h.ljust(w) for h, w in zip(columns, widths)).rstrip(), style="bold")
    for row in cells:
        out.append("\n")
        for i, (cell, width) in enumerate(zip(row, widths)):
            out.append_text(cell)
            if i + 1 < len(row):
                out.append(" " * (width - cell.cell_len + 2))
    if hidden:
        out.append(f"\n… {hidden} more", style="italic")
    return out


def spark(values: list[float], width: int, height: int, style: str = "cyan") -> Text:
    """The last ``width`` values as bars ``height`` lines tall (eighths of a line), scaled to
    their peak: one column per value, newest on the right."""
    values = values[-width:] if width > 0 else []
    peak = max(values, default=0.0) or 1.0
    levels = [0] * (max(0, width) - len(values)) + [round(v / peak * height * 8) for v in values]
    lines = []
    for row in range(height - 1, -1, -1):  # top line first
        floor = row * 8
        lines.append("".join("█" if lv >= floor + 8 else _LOWER[max(0, lv - floor)] for lv in levels))
    return Text("\n".join(lines), style=style)
