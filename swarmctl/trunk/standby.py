"""Make-before-break at a trunk: the next plan's stage, loaded beside the one served.

A plan the host *staged* is loaded beside the one in use: its layers fetched and checked and,
where this trunk's memory holds both, its engine built in a ``Standby``, while the engine in use
serves on (swarmctl/trunk/assignment.py takes it over when the host publishes the plan).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kernels.gguf_file import GGUFFile
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec
from plans.plan import Plan, StageAssignment
from plans.planner import Constraints
from swarmctl.trunk.assignment_core import room_for_both
from swarmctl.trunk.checked_open import open_checked


@dataclass
class Standby:
    """The next plan's stage, loaded beside the one served (``engine`` None: no room for both yet)."""

    version: int
    stage: StageAssignment
    model: Path
    gguf: GGUFFile | None = None
    engine: SliceEngine | None = None

    def close(self) -> None:
        """On the compute thread."""
        if self.engine is not None:
            self.engine.close()
        if self.gguf is not None:
            self.gguf.close()
        self.engine = self.gguf = None


def open_standby(staged: Plan, stage: StageAssignment, model: Path, *, held_bytes: int, memory: int,
                 build: Callable[[GGUFFile], SliceEngine]) -> Standby:
    """On the compute thread: the staged stage's file checked and, if ``memory`` holds it beside
    ``held_bytes`` (the engine in use: weights and the KV its requests hold), its engine built."""
    standby = Standby(staged.version, stage, model)
    gguf = open_checked(model, range(stage.start, stage.stop), staged)
    needed = stage.memory_used or sum(ModelSpec.from_gguf(gguf).layer_bytes[stage.start:stage.stop])
    if not room_for_both(held_bytes, needed, Constraints().reserve_bytes, memory):
        gguf.close()
        return standby
    try:
        standby.engine = build(gguf)
    except BaseException:
        gguf.close()
        raise
    standby.gguf = gguf
    return standby
