"""A throwaway swarm on this machine, so ``swarmctl ask`` works before any friend has joined.

One host process and N trunk processes on loopback, each with its own home in a temporary
folder, talking real QUIC with mutual TLS, and an identity for the asker. Everything is removed
on exit. Certificates are issued directly by the local CA (the same records an invite and join
would produce, without the round trip).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernels.errors import EngineError
from swarmctl.home import NodeConfig, SwarmHome
from swarmctl.membership import create_swarm, issue_direct

STARTUP_TIMEOUT = 60.0


def _die_with_parent(parent_pid: int | None = None) -> None:
    """In the child (a ``preexec_fn``): if the asker dies without cleaning up (killed, crashed),
    its local nodes get SIGTERM from the kernel instead of lingering (Linux; elsewhere close() is
    the only cleanup). The kernel sends it when the *thread* that forked the child exits, so spawn
    long-lived children from a thread that lives as long as they should (the main thread).
    ``parent_pid`` (``os.getpid()`` in the parent, through ``functools.partial``) closes the race
    of a parent that died before the request was made: the child then ends at once."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSwarm:
    def __init__(self, *, model: str | None, n_trunks: int, head_layers: int, threads: int | None = None,
                 capture: bool = False, host_port: int | None = None, host_advertise: str | None = None,
                 trunk_ports: list[int] | None = None, trunk_advertise: list[str] | None = None,
                 expert_nodes: int = 0) -> None:
        """``*_port``/``*_advertise`` place nodes at chosen ports and make others reach them at
        another address (an impairing relay in front of them, for WAN emulation). ``expert_nodes``:
        for a mixture-of-experts model, that many of the trunks hold experts (expert parallelism)."""
        if n_trunks < 1:
            raise EngineError("--trunk-nodes must be at least 1")
        self.n_trunks = n_trunks
        self.root = Path(tempfile.mkdtemp(prefix="swarmctl-local-"))
        self.processes: list[subprocess.Popen] = []
        self.capture_dirs: list[Path] = []
        try:
            self.host_home = SwarmHome(self.root / "host")
            address = f"127.0.0.1:{host_port or free_udp_port()}"
            create_swarm(self.host_home, swarm_name="local", host_name="host", listen=address,
                         advertise=[host_advertise or address], model=model, head_layers=head_layers)
            # Every trunk here shares one machine: plan "even", so each of the N trunks asked for serves
            # layers (the latency planner would rightly put them all on one, as an extra hop buys nothing).
            config = self.host_home.load_config()
            config.objective = "even"
            config.expert_nodes = expert_nodes
            self.host_home.save_config(config)
            ports = trunk_ports or [0] * n_trunks
            self.trunk_homes = [self._member_home(f"trunk-{i + 1}", model, f"127.0.0.1:{ports[i]}")
                                for i in range(n_trunks)]
            self.asker_home = self._member_home("asker", model, "127.0.0.1:0")
            self._spawn(self.host_home, ["run", "--role", "host"])
            for i, home in enumerate(self.trunk_homes):
                extra = ["--threads", str(threads)] if threads else []
                if trunk_advertise:
                    extra += ["--advertise", trunk_advertise[i]]
                if capture:
                    self.capture_dirs.append(self.root / f"capture-{i + 1}")
                    self.capture_dirs[-1].mkdir()
                    extra += ["--capture", str(self.capture_dirs[-1])]
                self._spawn(home, ["run", "--role", "trunk", *extra])
        except BaseException:
            self.close()
            raise

    def _member_home(self, name: str, model: str | None, listen: str) -> SwarmHome:
        host = self.host_home.load_config()
        key, cert, ca_cert = issue_direct(self.host_home, name, role="asker" if name == "asker" else "trunk")
        home = SwarmHome(self.root / name)
        home.path.mkdir(mode=0o700)
        home.save_identity(key, cert, ca_cert)
        home.save_config(NodeConfig(name=name, role="member", swarm_name=host.swarm_name,
                                    ca_fingerprint=host.ca_fingerprint, host_name=host.host_name,
                                    host_addresses=host.host_addresses, listen=listen, model=model))
        return home

    def _spawn(self, home: SwarmHome, args: list[str]) -> None:
        env = {**os.environ, "SWARMCTL_HOME": str(home.path)}
        log = open(home.path / "node.log", "wb")
        self.processes.append(subprocess.Popen([sys.executable, "-m", "swarmctl", *args], env=env,
                                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                               preexec_fn=_die_with_parent))

    def check_alive(self) -> None:
        for process in self.processes:
            if process.poll() is not None:
                raise EngineError(f"a local swarm node exited early (code {process.returncode}): "
                                  f"{self._last_log_line(process)}")

    def _last_log_line(self, process: subprocess.Popen) -> str:
        index = self.processes.index(process)
        home = [self.host_home, *self.trunk_homes][index]
        lines = (home.path / "node.log").read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no output"

    def log_tails(self, n: int = 30) -> str:
        """The last lines each node logged, for a test that failed to say what the swarm was doing."""
        out = []
        for home in [self.host_home, *self.trunk_homes]:
            lines = (home.path / "node.log").read_text(errors="replace").splitlines() \
                if (home.path / "node.log").exists() else []
            out.append(f"--- {home.path.name}\n" + "\n".join(lines[-n:]))
        return "\n".join(out)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
