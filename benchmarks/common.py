"""Small pieces the benchmark scripts share."""

from __future__ import annotations

import json
import os
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def emit_json(result: dict, out: Path | None) -> None:
    """Print the result as JSON, and also write it to ``out`` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.write_text(text + "\n")
