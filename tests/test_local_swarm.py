"""The local swarm `ask` and `serve` start when no swarm is joined (swarmctl/node/local_swarm.py): sized
to the machine's cores, and waited for until it is ready rather than raced (issue 29, items 6, 10).

A host that is slow to come up is made deterministic by starting it late: the node's command line
is wrapped (``LocalSwarm.command``) so that its Python sleeps before running swarmctl. Before the
fix, the asker gave up after the 10 s connect timeout with "cannot reach the swarm host".
"""

from __future__ import annotations

import asyncio

import pytest

from kernels.errors import EngineError
from kernels.sampling import SamplingParams
from kernels.threads import THREADS_ENV, default_threads, usable_cores
from swarmctl.node.local_swarm import LocalLayout, LocalSwarm, size_local_swarm
from swarmctl.asker.session import SessionOptions, open_session
from harness.oracle import oracle_greedy

PROMPT = "The three primary colours are"
# The connect timeout the old code raced (net.endpoint.CONNECT_TIMEOUT, 10 s), made 2 s in this process
# for the late-host test, and a host later than that: 15 s and 10 s took the test 18.5 s.
SHORT_CONNECT_TIMEOUT_S = 2.0
HOST_DELAY_S = 5.0


# --- sizing: pure, no process ---

@pytest.mark.parametrize("cpus, streams, width, want", [
    (1, 1, 576, LocalLayout(1, 1, 1)),
    (2, 1, 576, LocalLayout(1, 1, 1)),  # a narrow model: the cores split, as measured on a busy 2-core box
    (2, 1, 7168, LocalLayout(1, 2, 2)),  # a wide one, one stream: the processes take turns, each on every core
    (2, 16, 7168, LocalLayout(1, 1, 1)),  # serve: they compute at once, so 2 cores are split, not oversubscribed
    (4, 16, 576, LocalLayout(1, 2, 2)),
    (8, 1, 576, LocalLayout(2, 2, 4)),  # enough cores for a pipeline of two trunks; the asker takes the rest
    (8, 1, 2048, LocalLayout(2, 8, 8)),
    (16, 16, 4096, LocalLayout(2, 5, 6)),
    (3, 16, 576, LocalLayout(1, 1, 2)),
])
def test_a_local_swarm_is_sized_to_the_cores(cpus, streams, width, want):
    layout = size_local_swarm(cpus, streams=streams, width=width)
    assert layout == want
    if layout.trunk_threads < cpus:  # split: together they do not oversubscribe the cores
        assert layout.trunks * layout.trunk_threads + layout.asker_threads <= max(cpus, layout.trunks + 1)


def test_explicit_trunk_nodes_and_threads_win():
    assert size_local_swarm(2, trunks=3, width=4096) == LocalLayout(3, 2, 2)
    assert size_local_swarm(2, trunks=3, width=576) == LocalLayout(3, 1, 1)  # more processes than cores: 1 each
    assert size_local_swarm(16, trunks=1, streams=16) == LocalLayout(1, 8, 8)
    assert size_local_swarm(2, trunks=2, threads=1, streams=16) == LocalLayout(2, 1, 1)
    assert size_local_swarm(64, threads=3) == LocalLayout(2, 3, 3)
    with pytest.raises(EngineError, match="at least 1"):
        size_local_swarm(4, trunks=0)


def test_usable_cores_are_the_affinity_not_the_machine():
    """Under taskset (or a container's cpuset) the local swarm sizes itself to the cores it may use."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", "from kernels.threads import usable_cores; print(usable_cores())"],
                       capture_output=True, text=True, timeout=60, preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 1
    assert usable_cores() == len(os.sched_getaffinity(0))


def test_threads_default_to_the_environment_else_the_usable_cores(monkeypatch):
    """$SWARMCTL_THREADS caps every process's compute threads where --threads is not given; a bad
    value is a one-line error, not a thread count."""
    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert default_threads() == usable_cores()
    monkeypatch.setenv(THREADS_ENV, "3")
    assert default_threads() == 3
    monkeypatch.setenv(THREADS_ENV, "")  # set but empty: unset
    assert default_threads() == usable_cores()
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(EngineError, match=THREADS_ENV):
            default_threads()


# --- readiness: real processes ---

def _start_host_late(monkeypatch, delay_s: float) -> None:
    """The host's Python sleeps ``delay_s`` before it runs swarmctl (a loaded machine, on cue)."""
    real = LocalSwarm.command

    def command(args: list[str]) -> list[str]:
        line = real(args)
        if args[:3] != ["run", "--role", "host"]:
            return line
        late = (f"import runpy, sys, time; time.sleep({delay_s}); sys.argv[0] = 'swarmctl'; "
                f"runpy.run_module('swarmctl', run_name='__main__', alter_sys=True)")
        return [line[0], "-c", late, *args]

    monkeypatch.setattr(LocalSwarm, "command", staticmethod(command))


async def _ask_local(text: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """What `swarmctl ask --raw --temperature 0` does with no swarm joined: (prompt, answer) tokens."""
    from swarmctl.asker.head_tail import generate_all

    async with open_session(SessionOptions(trunk_nodes=1, threads=1)) as session:
        prompt = session.asker.tokenizer.encode_prompt(text)
        gen = await generate_all(session.asker, prompt, session.trunk, max_tokens=max_tokens,
                                 sampling=SamplingParams(temperature=0))
        return prompt, gen.tokens


def test_a_local_swarm_whose_host_starts_late_is_waited_for(monkeypatch, oracle, caplog):
    """The first ask on a loaded machine: the host listens only after the connect timeout has
    passed. The asker waits for its ready file (logging progress), then answers as llama-cpp-python."""
    monkeypatch.setattr("net.endpoint.CONNECT_TIMEOUT", SHORT_CONNECT_TIMEOUT_S)
    monkeypatch.setattr("swarmctl.node.local_swarm.PROGRESS_EVERY_S", 1.0)
    _start_host_late(monkeypatch, HOST_DELAY_S)
    caplog.set_level("INFO", logger="swarmctl.local")
    prompt, tokens = asyncio.run(_ask_local(PROMPT, 6))
    assert tokens == oracle_greedy(oracle, prompt, 6)
    messages = [r.getMessage() for r in caplog.records]
    assert any("waiting for the host to start" in m for m in messages), messages
    assert any(m.startswith("local swarm ready after") for m in messages), messages


def test_a_local_node_that_dies_while_starting_fails_at_once(monkeypatch):
    """Waiting for readiness is not waiting for ever: a host that exits is one clear error, now."""
    real = LocalSwarm.command

    def command(args: list[str]) -> list[str]:
        line = real(args)
        if args[:3] == ["run", "--role", "host"]:
            return [line[0], "-c", "import sys; print('host: cannot bind'); sys.exit(3)"]
        return line

    monkeypatch.setattr(LocalSwarm, "command", staticmethod(command))
    with pytest.raises(EngineError, match=r"exited early \(code 3\): host: cannot bind"):
        asyncio.run(_ask_local(PROMPT, 1))
