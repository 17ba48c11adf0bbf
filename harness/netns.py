"""Separate machines for tests, as Linux network namespaces: one namespace per machine, each
with its own interface, IP address, loopback and port space, cabled by veth pairs to a bridge
that lives in a namespace of its own. Needs root and iproute2's `ip netns`.

Every name carries a prefix unique to this run, so a lab left over by a killed run cannot clash
with a new one (and `ip netns list | grep swlab` finds leftovers). Nothing touches the root
namespace's interfaces: each veth is created inside the bridge's namespace with its peer placed
straight into the machine's namespace.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from swarmctl.node.local_swarm import _die_with_parent


class LabUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no iproute2, no netns support)."""


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")


class Machine:
    def __init__(self, lab: "NetnsLab", name: str, ip: str) -> None:
        self.lab, self.name, self.ip = lab, name, ip
        self.netns = f"{lab.prefix}-{name}"

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]


class Process:
    """A long-running `swarmctl` in a namespace, its output in a log file."""

    def __init__(self, argv: list[str], env: dict, log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:  # the child keeps its own descriptor
            self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.alive:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass


class NetnsLab:
    """``machines``: name → IPv4 address on one /24, e.g. {"host": "10.77.0.1", ...}."""

    def __init__(self, machines: dict[str, str], root: Path, prefix_len: int = 24) -> None:
        if os.geteuid() != 0:
            raise LabUnavailable("needs root to create network namespaces")
        if shutil.which("ip") is None:
            raise LabUnavailable("needs iproute2's `ip` command")
        self.prefix = f"swlab{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.root = root
        self.created: list[str] = []
        self.processes: list[Process] = []
        self.bridge_ns = f"{self.prefix}-br"
        try:
            _ip("netns", "add", self.bridge_ns)
        except RuntimeError as e:
            raise LabUnavailable(f"`ip netns add` does not work here: {e}") from None
        self.created.append(self.bridge_ns)
        self.machines: dict[str, Machine] = {}
        try:
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, (name, ip) in enumerate(machines.items()):
                machine = Machine(self, name, ip)
                _ip("netns", "add", machine.netns)
                self.created.append(machine.netns)
                port = f"port{i}"
                _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                    "netns", machine.netns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0", "up")
                _ip("-n", machine.netns, "addr", "add", f"{ip}/{prefix_len}", "dev", "eth0")
                _ip("-n", machine.netns, "link", "set", "eth0", "up")
                _ip("-n", machine.netns, "link", "set", "lo", "up")
                self.machines[name] = machine
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> Machine:
        return self.machines[name]

    @staticmethod
    def _env(home: Path | None) -> dict:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        if home is not None:
            env["SWARMCTL_HOME"] = str(home)
        else:
            env.pop("SWARMCTL_HOME", None)
        return env

    def swarmctl(self, machine: str, home: Path | None, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """`swarmctl ARGS` on that machine, with SWARMCTL_HOME=home; waits for it to finish."""
        argv = self[machine].command(sys.executable, "-m", "swarmctl", *args)
        return subprocess.run(argv, env=self._env(home), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def start(self, machine: str, home: Path, *args: str, log_name: str | None = None) -> Process:
        """`swarmctl ARGS` on that machine in the background; stopped by close()."""
        argv = self[machine].command(sys.executable, "-m", "swarmctl", *args)
        log_path = self.root / f"{log_name or machine}.log"
        process = Process(argv, self._env(home), log_path)
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        for netns in reversed(self.created):
            try:
                _ip("netns", "del", netns)
            except RuntimeError:
                pass
        self.created.clear()
