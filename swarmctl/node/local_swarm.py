"""A throwaway swarm on this machine, so ``swarmctl ask`` works before any friend has joined.

One host process and N trunk processes on loopback, each with its own home in a temporary
folder, talking real QUIC with mutual TLS, and an identity for the asker. Everything is removed
on exit. Certificates are issued directly by the local CA (the same records an invite and join
would produce, without the round trip).

Sizing (``size_local_swarm``): the processes share this machine's cores, so how many trunks and
how many compute threads each follows from the cores there are. Readiness (``wait_host``, then
swarmctl/asker/local_link.py): the swarm was started here, so the asker waits for it to say it is
ready (the host's ready file, then a complete plan over every trunk), however long a loaded
machine takes, and gives up only when a node died or after ``READY_BOUND_S``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kernels.errors import EngineError
from plans.options import PlannerSettings
from swarmctl.node.home import NodeConfig, SwarmHome
from swarmctl.node.membership import create_swarm, issue_direct

log = logging.getLogger("swarmctl.local")

# How long a swarm started here may take to be ready (the host listening, every trunk holding its
# layers) before the asker gives up. Generous: a node that dies is noticed at once anyway, and a
# loaded 2-core machine took minutes to start Python processes and load slices.
READY_BOUND_S = 600.0
PROGRESS_EVERY_S = 5.0  # how often, while waiting, a progress line is logged (shown with -v)
PIPELINE_CPUS = 8  # from this many cores on, a second trunk process pays for its hop (see size_local_swarm)
WIDE_MODEL = 2048  # n_embd from which one stream's processes each take every core (see size_local_swarm)


@dataclass(frozen=True)
class LocalLayout:
    """How a local swarm shares this machine: its trunk processes and each process's threads."""
    trunks: int
    trunk_threads: int  # compute threads of each trunk process
    asker_threads: int  # compute threads of the asker (this process)

    def describe(self) -> str:
        return (f"host + {self.trunks} trunk{'s' if self.trunks != 1 else ''} of {self.trunk_threads} "
                f"thread{'s' if self.trunk_threads != 1 else ''}, asker {self.asker_threads}")


def size_local_swarm(cpus: int, *, trunks: int | None = None, threads: int | None = None, streams: int = 1,
                     width: int = 0) -> LocalLayout:
    """How many trunk processes a local swarm on ``cpus`` cores starts, and their threads, for
    ``streams`` requests at once on a model ``width`` wide (n_embd). ``trunks`` (--trunk-nodes)
    and ``threads`` (--threads) given explicitly win.

    Trunks: every trunk process on one machine adds a hop and no memory, so a small machine gets
    one; from ``PIPELINE_CPUS`` cores on, two, so that requests in flight compute in different
    processes at once.

    Threads: the cores are split so that the processes together do not oversubscribe them (the
    asker takes what is left over). With several streams they compute at once; with one they take
    turns (asker head, each trunk, asker tail), but a narrow model's steps are so short that an
    OpenMP team's barrier waits, on a busy machine, for a partner thread the kernel descheduled:
    on 2 busy cores the bundled model (576 wide) decoded at 12.7 tok/s with 2 threads per process
    and 44.9 with 1 (benchmarks/bench_local_swarm.py). A wide model's steps are long enough for
    a team to pay: with one stream each process then takes every core (at 2048 wide, 6.1 against
    4.8 tok/s; the issue's Kimi-width figures, 174 against 306 ms per token)."""
    n = trunks if trunks is not None else (1 if cpus < PIPELINE_CPUS else 2)
    if n < 1:
        raise EngineError("--trunk-nodes must be at least 1")
    if threads is not None:
        return LocalLayout(n, threads, threads)
    if streams <= 1 and width >= WIDE_MODEL:
        return LocalLayout(n, cpus, cpus)
    share = max(1, cpus // (n + 1))
    return LocalLayout(n, share, max(1, cpus - n * share))


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


@dataclass(frozen=True)
class Fronts:
    """Where a local swarm's nodes listen, and the address others reach each at instead: an
    impairing relay in front of it (WAN emulation: net/relay.py, harness/wan_delay.py)."""

    host_port: int
    host_address: str  # what the host advertises (its relay)
    trunk_ports: list[int]
    trunk_addresses: list[str]  # what each trunk advertises

    @classmethod
    def behind(cls, ports: list[int], relays: list[str]) -> "Fronts":
        """The host at ports[0] behind relays[0], trunk i at ports[i + 1] behind relays[i + 1]."""
        return cls(ports[0], relays[0], list(ports[1:]), list(relays[1:]))


class LocalSwarm:
    def __init__(self, *, model: str | None, n_trunks: int, planner: PlannerSettings = PlannerSettings(),
                 threads: int | None = None, capture: bool = False, fronts: Fronts | None = None) -> None:
        """``planner``: the swarm's planner settings (head layers, expert nodes, wire dtype; its
        objective is always "even", below); ``fronts``: chosen ports, and other addresses to reach
        the nodes at (an impairing relay in front of each); ``capture``: the trunks keep every frame
        (the audit)."""
        if n_trunks < 1:
            raise EngineError("--trunk-nodes must be at least 1")
        self.n_trunks = n_trunks
        self.root = Path(tempfile.mkdtemp(prefix="swarmctl-local-"))
        self.processes: list[subprocess.Popen] = []
        self.capture_dirs: list[Path] = []
        self.started = time.monotonic()
        self.host_ready_file = self.root / "host.ready"  # the host writes its address there once it listens
        try:
            self.host_home = SwarmHome(self.root / "host")
            address = f"127.0.0.1:{fronts.host_port if fronts else free_udp_port()}"
            create_swarm(self.host_home, swarm_name="local", host_name="host", listen=address,
                         advertise=[fronts.host_address if fronts else address], model=model,
                         # Every trunk here shares one machine: plan "even", so each of the N trunks
                         # asked for serves layers (the latency planner would rightly put them all on
                         # one, as an extra hop buys nothing).
                         planner=replace(planner, objective="even"))
            ports = fronts.trunk_ports if fronts else [0] * n_trunks
            self.trunk_homes = [self._member_home(f"trunk-{i + 1}", model, f"127.0.0.1:{ports[i]}")
                                for i in range(n_trunks)]
            self.asker_home = self._member_home("asker", model, "127.0.0.1:0")
            self._spawn(self.host_home, ["run", "--role", "host", "--ready-file", str(self.host_ready_file)])
            for i, home in enumerate(self.trunk_homes):
                extra = ["--threads", str(threads)] if threads else []
                if fronts:
                    extra += ["--advertise", fronts.trunk_addresses[i]]
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
        # Its own process group: a Ctrl-C typed at the terminal reaches the asker alone, which decides
        # (`chat` stops one answer and needs its swarm after; `ask` closes the swarm as it exits).
        with open(home.path / "node.log", "wb") as out:
            self.processes.append(subprocess.Popen(self.command(args), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                   stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                                   process_group=0))

    @staticmethod
    def command(args: list[str]) -> list[str]:
        """The command line of a node (``args``: ``run --role ...``); tests wrap it to start a node late."""
        return [sys.executable, "-m", "swarmctl", *args]

    async def wait_host(self, bound: float = READY_BOUND_S) -> float:
        """Wait for the host to listen (its ready file); returns the deadline, ``bound`` seconds from
        the start, that the rest of the wait (the asker's link seeing every trunk ready) keeps.
        EngineError at once when a node exited, or after the deadline."""
        deadline = self.started + bound
        report = self.progress("the host to start")
        while not (self.host_ready_file.exists() and self.host_ready_file.read_text().strip()):
            report()  # a host that exited fails here at once
            if time.monotonic() > deadline:
                raise EngineError(f"the local swarm's host did not start within {bound:g} s: "
                                  f"{self._last_log_line(self.processes[0])}")
            await asyncio.sleep(0.1)
        log.info("local swarm: host listening after %.1f s", time.monotonic() - self.started)
        return deadline

    def progress(self, what: str) -> "Progress":
        """A check to call while waiting for ``what``: raises if a node exited, logs every few seconds."""
        return Progress(self, what)

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


class Progress:
    """Called while waiting for a local swarm: raises if a node exited, and logs what is awaited
    every ``PROGRESS_EVERY_S`` (shown with -v)."""

    def __init__(self, swarm: LocalSwarm, what: str) -> None:
        self.swarm = swarm
        self.what = what
        self.last = time.monotonic()

    def __call__(self) -> None:
        self.swarm.check_alive()
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            log.info("local swarm: waiting for %s (%.0f s so far)", self.what, now - self.swarm.started)
