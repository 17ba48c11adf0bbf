"""Slice distribution and re-planning with real processes: a trunk without the model fetches just
its layers (and resumes after a crash mid-transfer), the swarm answers exactly as in-process, and a
third trunk joining re-plans without leaving any request hanging."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from plans.layout import ModelLayout
from kernels.gguf_file import GGUFFile
from swarmctl.model_files.distribution import CHUNK
from swarmctl.node.local_swarm import free_udp_port
from swarmctl.model_files.models import default_model_path
from harness.swarm import Swarm, swarmctl

PROMPT = "The three primary colours are"
ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "24")
CRASH_AFTER = 6 * 1024 * 1024


def stats_of(swarm: Swarm, name: str) -> dict:
    return swarm.stats_of(name)


def join_without_model(swarm: Swarm, name: str):
    home = swarm.root / name
    swarmctl(home, "join", swarm.invite(), "--name", name, "--listen", f"127.0.0.1:{free_udp_port()}",
             "--model", str(swarm.root / "no-such-model.gguf"), check=True)
    swarm.homes[name] = home
    return home


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = Swarm(tmp_path_factory.mktemp("distribution"))
    try:
        s.init()
        s.start_host()
        s.wait_host()
        s.join("trunk-a")
        s.join("asker")
        join_without_model(s, "trunk-b")
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def inproc_answer():
    return swarmctl(None, *ASK, "--transport", "inproc", PROMPT, check=True).stdout


def test_a_trunk_without_the_model_fetches_its_slice_and_resumes_after_a_crash(swarm, inproc_answer):
    swarm.start_trunk("trunk-a", "--memory", "4G", capture=False)
    swarm.wait_complete(1)  # trunk-a registered first, so the order (and b's range) is the same twice
    env_node = subprocess.Popen(  # first life: dies mid-transfer
        [sys.executable, "-m", "swarmctl", "run", "--role", "trunk", "--memory", "4G"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, env={**__import__("os").environ, "SWARMCTL_HOME": str(swarm.homes["trunk-b"]),
                                        "SWARMCTL_TEST_FETCH_CRASH_AFTER": str(CRASH_AFTER)})
    assert env_node.wait(120) == 3  # the simulated crash
    slices = swarm.homes["trunk-b"] / "slices"
    progress = next(slices.glob("*.progress"))
    with GGUFFile(next(slices.glob("*.gguf.part"))) as part:  # the header is written first, whole
        sizes = [t.n_bytes for t in part.tensors.values()]
    had = 0
    for chunk in progress.read_text().split():
        i, j = (int(x) for x in chunk.split(":"))
        had += min(CHUNK, sizes[i] - j * CHUNK)
    assert had >= CRASH_AFTER
    assert not list(slices.glob("*.gguf"))  # no unverified file took the final name

    swarm.start_trunk("trunk-b", "--memory", "4G", capture=False)  # second life: resumes
    status = swarm.wait_complete(2)
    b = next(m for m in status["members"] if m["name"] == "trunk-b")
    start, stop = b["layers"]
    layout = ModelLayout.from_gguf(default_model_path())
    stats = stats_of(swarm, "trunk-b")
    assert sum(sizes) == layout.range_bytes(start, stop)  # the same range both lives
    assert stats["fetched_bytes"] == layout.range_bytes(start, stop) - had  # only what was missing
    assert stats["tensor_bytes"] == layout.range_bytes(start, stop)  # exactly its layers, nothing else
    assert list(slices.glob("*.gguf")) and not list(slices.glob("*.progress"))
    r = swarmctl(swarm.homes["asker"], *ASK, PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == inproc_answer


def test_status_and_plan_show_the_planners_figures(swarm):
    status = json.loads(swarmctl(swarm.homes["asker"], "status", "--json", check=True).stdout)
    assert status["objective"] == "even" and status["expected_ms_per_token"] > 0
    assert all(m["ms_per_layer_token"] for m in status["members"] if m["layers"])  # measured at join
    r = swarmctl(swarm.homes["asker"], "plan", "--objective", "latency")
    assert r.returncode == 0, r.stderr
    assert "bottleneck:" in r.stdout and "ms per token" in r.stdout


def _two_trunks_serving(swarm: Swarm) -> None:
    """What the module's first test leaves running (trunk-a, and trunk-b on its fetched slice), for a
    test run without it (``-m heavy``)."""
    running = {node.home.name for node in swarm.nodes if node.alive}
    for name in ("trunk-a", "trunk-b"):
        if name not in running:
            swarm.start_trunk(name, "--memory", "4G", capture=False)
    swarm.wait_complete(2, timeout=120)


@pytest.mark.heavy  # the simulator's 'join' seeds (tests/test_sim.py, the late world)
def test_a_third_trunk_replans_and_no_request_hangs(swarm, inproc_answer):
    _two_trunks_serving(swarm)
    long_ask = subprocess.Popen([sys.executable, "-m", "swarmctl", "ask", "--raw", "--temperature", "0",
                                 "--max-tokens", "400", "Once upon a time"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True,
                                env={**__import__("os").environ, "SWARMCTL_HOME": str(swarm.homes["asker"])})
    time.sleep(1.5)
    swarm.join("trunk-c")
    swarm.start_trunk("trunk-c", capture=False)
    out, err = long_ask.communicate(timeout=180)  # never hangs: finishes, or fails with a clear error
    if long_ask.returncode != 0:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "plan" in lines[0], err
    status = swarm.wait_complete(3)
    assert len([m for m in status["members"] if m["layers"]]) == 3
    r = swarmctl(swarm.homes["asker"], *ASK, PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == inproc_answer
