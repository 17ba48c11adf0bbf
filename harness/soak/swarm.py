"""The swarm under soak, built the way a user builds one, through the CLI (harness/swarm.py):
a host, two trunks that `join` with invites, an asker member, a second member ("friend"), a member
that only polls ("monitor"), and `swarmctl serve` on the asker's home. Also the trunks started
later (a restart after a kill, a member that joins mid-run), each incarnation known by its pid."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from swarmctl.node.local_swarm import free_udp_port
from harness.swarm import Node, Swarm, die_with_this_process, swarmctl

FIRST_TRUNKS = ("trunk-a", "trunk-b")
MEMBERS = (*FIRST_TRUNKS, "asker", "friend", "monitor")
START_TIMEOUT_S = 120.0  # for the first two trunks to serve, and for `serve` to listen


def last_line(text: str) -> str:
    """The error line of a CLI's stderr (``swarmctl: error: ...``), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("swarmctl:")]
    return (errors or lines or [""])[-1]


class SoakSwarm:
    def __init__(self, root: Path, threads: int) -> None:
        self.root = root
        self.threads = threads
        self.harness = Swarm(root)
        self.serve: subprocess.Popen | None = None
        self.serve_port: int | None = None
        self.serve_log = root / "serve.log"
        self.incarnation: dict[str, int] = {}  # trunk name -> pid of its current process

    @property
    def homes(self) -> dict[str, Path]:
        return self.harness.homes

    @property
    def nodes(self) -> list[Node]:
        """Every `swarmctl run` process started and not removed, the host first."""
        return self.harness.nodes

    @property
    def host(self) -> Node:
        return self.harness.nodes[0]

    def start(self, phase: Callable[[str], None]) -> None:
        """Bring the swarm and `serve` up; ``phase(name)`` is called as each part is done."""
        s = self.harness
        s.init()
        s.start_host()
        s.wait_host()
        phase("host")
        codes = [s.invite() for _ in MEMBERS]  # one at a time: each writes the host's invite records

        def join(name: str, code: str) -> None:
            home = self.root / name
            swarmctl(home, "join", code, "--name", name, "--listen", f"127.0.0.1:{free_udp_port()}", check=True)
            s.homes[name] = home

        with ThreadPoolExecutor(len(MEMBERS)) as pool:
            list(pool.map(join, MEMBERS, codes))
        phase("joins")
        for name in FIRST_TRUNKS:
            self.start_trunk(name)
        s.wait_complete(len(FIRST_TRUNKS), timeout=START_TIMEOUT_S)
        phase("trunks")
        self._start_serve()
        phase("serve")

    def _start_serve(self) -> None:
        env = {**os.environ, "SWARMCTL_HOME": str(self.homes["asker"]), "OMP_WAIT_POLICY": "PASSIVE"}
        with open(self.serve_log, "wb") as log:
            self.serve = subprocess.Popen([sys.executable, "-m", "swarmctl", "serve", "--port", "0", "--threads",
                                           str(self.threads)], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, preexec_fn=die_with_this_process())
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.serve_port is None:
            text = self.serve_log.read_text(errors="replace")
            for line in text.splitlines():
                if line.startswith("serving ") and "http://" in line:
                    self.serve_port = int(line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
            if self.serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"swarmctl serve did not start:\n{text[-2000:]}")
            time.sleep(0.2)

    def start_trunk(self, name: str) -> Node:
        """`run --role trunk` from the member's home (for a restart: same home, no new invite)."""
        node = self.harness.start_trunk(name, "--threads", str(self.threads), capture=False)
        self.incarnation[name] = node.process.pid
        return node

    def join(self, name: str) -> None:
        """A new member joins with an invite (blocking: run it in a thread)."""
        self.harness.join(name)

    def node(self, name: str) -> Node | None:
        """The member's running process, if any."""
        home = self.harness.homes[name]
        return next((n for n in reversed(self.harness.nodes) if n.home == home and n.alive), None)

    def forget(self, node: Node) -> None:
        """A node killed on purpose: no longer stopped at the end, nor reported as exited."""
        self.harness.nodes.remove(node)

    def is_running(self, name: str) -> bool:
        home = self.harness.homes.get(name)
        return any(n.alive for n in self.harness.nodes if n.home == home)


    def close(self) -> None:
        """Stop `serve` (it answers its clients first), then every node, the host last."""
        if self.serve is not None and self.serve.poll() is None:
            self.serve.send_signal(signal.SIGTERM)
            try:
                self.serve.wait(10)
            except subprocess.TimeoutExpired:
                self.serve.kill()
                self.serve.wait()
        self.harness.close()

    def log_tails(self, n: int = 16) -> dict[str, list[str]]:
        tails = {}
        for path in sorted(self.root.glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()
            tails[path.stem] = lines[-n:]
        return tails
