"""The test harness's nodes do not outlive the test run: when the process that started them is
killed (pytest killed mid-run), they end instead of staying behind as orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from swarmctl.node.local_swarm import free_udp_port
from harness.swarm import swarmctl

REPO = Path(__file__).resolve().parents[1]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan that exited waits for its new parent to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def test_harness_nodes_die_with_the_process_that_started_them(tmp_path):
    home = tmp_path / "host"
    swarmctl(home, "init", "--listen", f"127.0.0.1:{free_udp_port()}", check=True)
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from harness.swarm import Node

        node = Node(Path({str(home)!r}), "host")
        print(node.process.pid, flush=True)
        time.sleep(600)
    """)
    runner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    pid = None
    try:
        pid = int(runner.stdout.readline())
        log = tmp_path / "host-host.log"
        deadline = time.monotonic() + 60
        while "listening" not in (log.read_text(errors="replace") if log.exists() else ""):
            assert _running(pid), "the host node ended by itself:\n" + log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the host node did not come up"
            time.sleep(0.1)

        runner.send_signal(signal.SIGKILL)  # as when pytest itself is killed: no cleanup runs
        runner.wait(10)
        deadline = time.monotonic() + 15
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(pid), "the host node outlived the process that started it"
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)
