"""Real swarms for tests: every node a separate `swarmctl` process with its own SWARMCTL_HOME,
set up only through the CLI (init / join / run), talking QUIC with mTLS on loopback. A join's
invite is issued from this process as ``swarmctl invite`` issues it, and waiting for the swarm
(``status``, ``wait_complete``) asks the host from this process too: each spares a Python start."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from net.endpoint import Address, ask_member
from swarmctl.commands.status import as_json, fetch_status
from swarmctl.node.home import SwarmHome
from swarmctl.node.membership import issue_invite
from swarmctl.node.local_swarm import _die_with_parent, free_udp_port


def die_with_this_process():
    """A ``preexec_fn`` for children that must not outlive the test run: when pytest dies
    mid-run (killed, crashed), the kernel sends them SIGTERM instead of leaving them as orphans
    that hold ports and cores. Linux delivers it when the forking *thread* exits, so only a child
    spawned from the main thread (which lives as long as pytest) gets it; one started from a
    worker thread is left to its owner's cleanup rather than killed when that thread ends."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return functools.partial(_die_with_parent, os.getpid())


def swarmctl(home: Path | None, *args: str, timeout: float = 120, check: bool = False,
             env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    if home is not None:
        env["SWARMCTL_HOME"] = str(home)
    # subprocess.run waits for the child, so the calling thread (even a worker) outlives it
    r = subprocess.run([sys.executable, "-m", "swarmctl", *args], capture_output=True, text=True, timeout=timeout,
                       env=env, preexec_fn=functools.partial(_die_with_parent, os.getpid()))
    if check and r.returncode != 0:
        raise AssertionError(f"swarmctl {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def _run(coroutine):
    """``asyncio.run``, also where this thread's own event loop is running (an async test calls a
    helper): then in a thread of its own, this loop waiting meanwhile as for a subprocess."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["result"] = asyncio.run(coroutine)
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


class Node:
    """A running `swarmctl run` process."""

    def __init__(self, home: Path, role: str, *extra: str) -> None:
        self.home = home
        self.log_path = home.parent / f"{home.name}-{role}.log"
        env = {**os.environ, "SWARMCTL_HOME": str(home), "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen([sys.executable, "-m", "swarmctl", "run", "--role", role, *extra], env=env,
                                        stdin=subprocess.DEVNULL, stdout=open(self.log_path, "wb"),
                                        stderr=subprocess.STDOUT, preexec_fn=die_with_this_process())

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Swarm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.host_home = root / "host"
        self.host_port = free_udp_port()
        self.nodes: list[Node] = []
        self.homes: dict[str, Path] = {}
        self.captures: dict[str, Path] = {}

    def init(self, *extra: str) -> None:
        """All nodes share this machine, so by default plan "even" (every trunk serves); tests of
        the latency planner pass --objective themselves."""
        if "--objective" not in extra:
            extra = (*extra, "--objective", "even")
        swarmctl(self.host_home, "init", "--listen", f"127.0.0.1:{self.host_port}", *extra, check=True)

    def invite(self, *args: str) -> str:
        return swarmctl(self.host_home, "invite", *args, check=True).stdout.strip()

    def join(self, name: str, *extra: str, role: str = "trunk") -> Path:
        """``swarmctl join`` with a fresh one-use invite of ``role``. The invite is issued from this
        process, as ``swarmctl invite`` issues it (the same function, on the host's home), which
        spares a Python start per member; ``invite`` runs the command itself."""
        home = self.root / name
        code = issue_invite(SwarmHome(self.host_home), ttl_seconds=3600, uses=1, role=role).encode()
        swarmctl(home, "join", code, "--name", name, "--listen", f"127.0.0.1:{free_udp_port()}", *extra, check=True)
        self.homes[name] = home
        return home

    def start_host(self, *extra: str) -> Node:
        node = Node(self.host_home, "host", *extra)
        self.nodes.append(node)
        return node

    def start_trunk(self, name: str, *extra: str, capture: bool = True) -> Node:
        args = list(extra)
        if capture:
            self.captures[name] = self.root / f"capture-{name}"
            self.captures[name].mkdir(exist_ok=True)
            args += ["--capture", str(self.captures[name])]
        node = Node(self.homes[name], "trunk", *args)
        self.nodes.append(node)
        return node

    def status(self) -> dict:
        """What ``swarmctl status --json`` on the host's home prints, or {} where it would fail.
        Asked from this process over the same mTLS request: the CLI in a subprocess costs 0.45 s
        of CPU a call (Python, aioquic's and numpy's imports), and the waits below poll it every
        0.3 s while the nodes they wait for need that CPU (measured on a 2-core box)."""
        try:
            status = _run(fetch_status(SwarmHome(self.host_home)))
        except Exception:  # (as the subprocess's non-zero exit was: the host not up yet, or refusing)
            return {}
        return json.loads(json.dumps(as_json(status)))  # (tuples as lists, as the command's JSON gives them)

    def stats_of(self, name: str, via: str = "asker") -> dict:
        """A trunk's own figures (its "stats" control reply), asked over mTLS as member ``via``."""
        creds = SwarmHome(self.homes[via]).credentials()
        member = next(m for m in self.status()["members"] if m["name"] == name)

        return asyncio.run(ask_member(Address.parse(member["address"]), creds, name, {"type": "stats"}))

    def plan(self, via: str = "asker") -> dict:
        """The plan in use, as the host gives it to member ``via`` (get_plan over mTLS)."""
        creds = SwarmHome(self.homes[via]).credentials()
        return asyncio.run(ask_member(Address("127.0.0.1", self.host_port), creds, "host", {"type": "get_plan"}))["plan"]

    async def watch_plans(self, plans: list[dict], via: str = "asker") -> None:
        """Append every plan the host publishes to ``plans``, as an asker (member ``via``) sees it,
        until cancelled."""
        from net.endpoint import close, connect_member
        from net.protocol import RequestOnlyHandler
        from net.wire import decode_control, encode_control

        frames: asyncio.Queue = asyncio.Queue()

        class Handler(RequestOnlyHandler):
            def frame_received(self, conn, stream_id, frame) -> None:
                frames.put_nowait(frame)

        conn = await connect_member(Address("127.0.0.1", self.host_port), SwarmHome(self.homes[via]).credentials(),
                                    "host", Handler())
        try:
            plans.append(decode_control((await conn.request(encode_control({"type": "watch_plan"}))).body)["plan"])
            while True:
                plans.append(decode_control((await frames.get()).body)["plan"])
        finally:
            await close(conn)

    def wait_host(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.status():
                return
            time.sleep(0.2)
        raise AssertionError("the host did not come up:\n" + self.nodes[0].log())

    def wait_complete(self, n_stages: int, timeout: float = 60, expert_nodes: tuple[str, ...] = ()) -> dict:
        """Wait for a complete plan with ``n_stages`` stages in which each of ``expert_nodes`` holds
        experts: plans change as trunks register and pass their trials, and a plan made before the
        last one is in may be complete with the experts elsewhere (on a 1G stage trunk, with the
        expert node serving layers: CI saw that)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                if not node.alive:
                    raise AssertionError(f"node {node.home.name} died:\n{node.log()}")
            status = self.status()
            members = {m["name"]: m for m in status.get("members", [])}
            stages = [m for m in members.values() if m["layers"]]
            if status.get("complete") and len(stages) == n_stages \
                    and all(members.get(name, {}).get("experts") for name in expert_nodes):
                return status
            time.sleep(0.3)
        raise AssertionError(f"swarm not complete with {n_stages} stages and experts on {list(expert_nodes)}: "
                             f"{self.status()}")

    def configure_and_wait(self, setting: str, value: str, asker: str, timeout: float = 60) -> None:
        """``swarmctl config SETTING VALUE`` on the host, then wait until a newer plan is complete,
        nothing is staged, and ``asker`` reads the plan with the new value (every stage loaded again)."""
        version = self.status()["plan_version"]
        swarmctl(self.host_home, "config", setting, value, check=True)
        deadline = time.monotonic() + timeout
        while not ((now := self.status()).get("plan_version", version) > version and now.get("complete")
                   and not now.get("staged") and self.plan(via=asker).get(setting) == value):
            assert time.monotonic() < deadline, now
            time.sleep(0.3)

    @classmethod
    @contextlib.contextmanager
    def two_trunks(cls, root: Path, *, askers: tuple[str, ...] = (), init: tuple[str, ...] = ()):
        """The swarm most multi-process tests want: a host, trunk-a and trunk-b serving (plan
        complete), and ``askers`` joined as asker-only members; stopped afterwards."""
        swarm = cls(root)
        try:
            swarm.init(*init)
            swarm.start_host()
            swarm.wait_host()
            for name in ("trunk-a", "trunk-b"):
                swarm.join(name)
            for name in askers:
                swarm.join(name, role="asker")
            swarm.start_trunk("trunk-a", capture=False)
            swarm.start_trunk("trunk-b", capture=False)
            swarm.wait_complete(2)
            yield swarm
        finally:
            swarm.close()

    def close(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
