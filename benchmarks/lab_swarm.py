"""Driving a swarm of real `swarmctl` processes on the NAT lab's machines (harness/nat_lab.py), for
the benchmarks that measure one across home routers (bench_nat.py, bench_expert_kill.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Iterable

from harness.nat_lab import NatLab


class BenchError(RuntimeError):
    pass


class LabSwarm:
    """A host and the named members, each with its home under ``root`` on its lab machine."""

    def __init__(self, lab: NatLab, root: Path, members: Iterable[str]) -> None:
        self.lab, self.root = lab, root
        self.homes = {name: root / name for name in ("host", *members)}
        self.nodes = {}  # name → the running node's process (harness/netns.py)

    def swarmctl(self, machine: str, *args: str, timeout: float = 180):
        r = self.lab.net.swarmctl(machine, self.homes[machine], *args, timeout=timeout)
        if r.returncode != 0:
            raise BenchError(f"{machine}: swarmctl {' '.join(args)} failed ({r.returncode}): "
                             f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return r

    def status(self) -> dict | None:
        r = self.lab.net.swarmctl("host", self.homes["host"], "status", "--json", timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def wait_for(self, what: str, check: Callable[[dict], bool], timeout: float = 180) -> dict:
        """The host's status once ``check`` holds; a node that exits meanwhile ends the wait."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.nodes.items():
                if not process.alive:
                    raise BenchError(f"{name} exited: {process.log()[-500:]}")
            status = self.status()
            if status is not None and check(status):
                return status
            time.sleep(0.5)
        raise BenchError(f"gave up waiting for {what}")
