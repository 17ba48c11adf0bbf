"""Short, fixed-width renderings of figures for table cells."""

from __future__ import annotations

from rich.text import Text

BAR_WIDTH = 6
_EIGHTHS = " ▏▎▍▌▋▊▉"

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


def memory(used: int | None, budget: int | None) -> str:
    return "-" if used is None and budget is None else f"{size(used)}/{size(budget)}"


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


def layers(span: tuple[int, int] | None) -> str:
    return f"[{span[0]}, {span[1]})" if span else "-"


def next_hop(name: str, rtt_ms: float | None) -> str:
    if not name:
        return "-"
    return f"{name} {ms(rtt_ms)}" if rtt_ms is not None else f"{name} ?"


def health(text: str, stats_error: str) -> Text:
    style = HEALTH_STYLES.get(text, "red")
    if stats_error:  # the host's word for it is in its chart lane
        return Text("no stats", style="yellow")
    return Text(text, style=style)
