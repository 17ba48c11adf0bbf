"""``--capture DIR``: every frame a trunk receives and sends, kept exactly as bytes: what a curious
member running this stage could see (the security tests read them)."""

from __future__ import annotations

from pathlib import Path

from net.wire import Frame


class FrameCapture:
    def __init__(self, directory: Path | None) -> None:
        self.directory = directory  # None: nothing is kept
        self._seq = 0

    def __call__(self, direction: str, frame: Frame) -> None:
        """``direction``: "recv" or "send"; files are numbered in the order frames pass."""
        if self.directory is None:
            return
        self._seq += 1
        kind = frame.type.name.lower()
        (self.directory / f"{self._seq:06d}-{direction}-{kind}.bin").write_bytes(frame.body)
