"""Fault tolerance with real processes: kill -9 of a trunk mid-generation (one request, then eight),
rejoin, a host restart, a swarm left without capacity, and a lossy, jittery link cut for 3 s.

The module's tests share one swarm and run in order: each leaves it whole again for the next.
Trunks offer little memory (--memory 340M, KV for 512 tokens × 2 requests), so the model needs two
of the three: two serve, one stands by (--max-stages 2).
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kernels.sampling import SamplingParams
from net.endpoint import Address
from net.relay import ImpairedLink
from swarmctl.asker.head_tail import Asker, InprocTrunk, generate_all, u_split
from swarmctl.node.local_swarm import Fronts, LocalSwarm, free_udp_port
from plans.options import PlannerSettings
from swarmctl.asker.link import SwarmError, SwarmLink
from swarmctl.node.home import SwarmHome
from tests.conftest import N_THREADS
from harness.swarm import Node, Swarm, swarmctl

GREEDY = SamplingParams(temperature=0)
PROMPT = "Once upon a time, in a lighthouse by a cold grey sea,"
TRUNKS = ("trunk-a", "trunk-b", "trunk-c")
MEMORY = ("--memory", "340M")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = Swarm(tmp_path_factory.mktemp("faults"))
    try:
        s.init("--objective", "even", "--max-stages", "2", "--context", "512", "--concurrent", "2")
        s.start_host()
        s.wait_host()
        for name in (*TRUNKS, "asker"):
            s.join(name)
        for name in TRUNKS:
            s.start_trunk(name, *MEMORY, capture=False)
        s.wait_complete(2)
        yield s
    finally:
        s.close()


def solo(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from swarmctl.model_files.models import default_model_path

    asker = Asker(default_model_path(), 4, n_threads=N_THREADS)
    trunk = InprocTrunk(asker.gguf, u_split(30, 4, 2).trunk, n_threads=N_THREADS, max_context=asker.max_context)

    async def run():
        return [(await generate_all(asker, p, trunk, max_tokens=max_tokens, sampling=GREEDY, ignore_eos=True)).tokens
                for p in prompts]

    try:
        return asyncio.run(run())
    finally:
        trunk.close()
        asker.close()


def node_of(swarm: Swarm, name: str) -> Node:
    return next(n for n in reversed(swarm.nodes) if n.home == swarm.homes.get(name, swarm.host_home) and n.alive)


def kill_9(swarm: Swarm, name: str) -> None:
    """SIGKILL: no goodbye, no cleanup. The harness stops watching the node (it died on purpose)."""
    node = node_of(swarm, name)
    node.process.kill()
    node.process.wait()
    swarm.nodes.remove(node)


def is_running(swarm: Swarm, name: str) -> bool:
    return any(n.alive for n in swarm.nodes if n.home == swarm.homes.get(name, swarm.host_home))


def active_stages(swarm: Swarm) -> list[str]:
    members = sorted((m for m in swarm.status()["members"] if m["layers"]), key=lambda m: m["layers"][0])
    return [m["name"] for m in members]


def restart(swarm: Swarm, name: str) -> None:
    swarm.start_trunk(name, *MEMORY, capture=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(m["name"] == name and m["role"] == "trunk" for m in swarm.status().get("members", [])):
            return
        time.sleep(0.3)
    raise AssertionError(f"{name} did not rejoin")


def test_kill_9_mid_generation_with_a_standby_gives_the_same_tokens(swarm):
    want = swarmctl(None, "ask", "--transport", "inproc", "--raw", "--temperature", "0", "--max-tokens", "64",
                    PROMPT, check=True).stdout
    victim = active_stages(swarm)[0]
    ask = subprocess.Popen([sys.executable, "-m", "swarmctl", "ask", "--raw", "--temperature", "0", "--max-tokens",
                            "64", PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**os.environ, "SWARMCTL_HOME": str(swarm.homes["asker"])})
    got = ask.stdout.read(40)  # some of the answer has streamed: the generation is under way
    kill_9(swarm, victim)
    rest, err = ask.communicate(timeout=120)
    assert ask.returncode == 0, err.decode()
    assert (got + rest).decode() == want
    status = swarm.wait_complete(2)
    assert victim not in active_stages(swarm)
    assert status["recovery"]["recoveries"] >= 1 and status["recovery"]["replayed_bytes"] > 0
    assert status["recovery"]["last_recovery_s"] < 30


def test_a_killed_trunk_rejoins_with_its_identity(swarm):
    dead = next((name for name in TRUNKS if not is_running(swarm, name)), None)
    if dead is None:  # run without the kill above (alone, or its module split across test workers)
        dead = active_stages(swarm)[0]
        kill_9(swarm, dead)
        deadline = time.monotonic() + 60
        while dead in active_stages(swarm):
            assert time.monotonic() < deadline, f"the host kept {dead} in its plan 60 s after its kill"
            time.sleep(0.3)
    restart(swarm, dead)  # no new invite: same home, same certificate
    status = swarm.wait_complete(2)
    assert dead in {m["name"] for m in status["members"] if m["role"] == "trunk"}


def random_prompts(seed: int, n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(100, 40000, int(rng.integers(5, 30)))] for _ in range(n)]


def generate_through(swarm: Swarm, prompts: list[list[int]], max_tokens: int, disturb):
    """All prompts at once through the swarm; once 16 tokens are out, ``await disturb()``.
    Returns the tokens of each, what ``disturb`` returned, and the link's recoveries."""
    async def run():
        from swarmctl.model_files.models import default_model_path

        link = await SwarmLink.open(SwarmHome(swarm.homes["asker"]), min_stages=2)
        asker = Asker(default_model_path(), 4, n_threads=N_THREADS, max_in_flight=len(prompts))
        try:
            jobs = [asyncio.ensure_future(generate_all(asker, p, link, max_tokens=max_tokens, sampling=GREEDY,
                                                       ignore_eos=True)) for p in prompts]
            while sum(len(g.tokens) for g in asker.in_flight.values()) < 16:
                await asyncio.sleep(0.05)
            outcome = await disturb()
            gens = await asyncio.wait_for(asyncio.gather(*jobs), 150)
            return [g.tokens for g in gens], outcome, link.stats.recoveries
        finally:
            await link.close()
            asker.close()

    return asyncio.run(run())


@pytest.mark.heavy  # the simulator's 'kill' seeds (tests/test_sim.py)
def test_eight_concurrent_requests_survive_a_kill(swarm):
    prompts = random_prompts(3)
    want = solo(prompts, 24)
    victim = active_stages(swarm)[-1]

    async def kill() -> None:
        kill_9(swarm, victim)

    got, _, recoveries = generate_through(swarm, prompts, 24, kill)
    assert got == want
    assert recoveries >= 1
    restart(swarm, victim)
    swarm.wait_complete(2)


def test_a_kept_prefix_on_a_killed_stage_costs_a_recompute_not_an_error(swarm):
    """A conversation's prefix kept at the stages (swarmctl/asker/prefixes.py); a stage is killed
    and its standby takes its layers: the next turn computes the prefix again there and answers
    as a request without reuse; the turn after reuses the prefix on the new route."""
    from swarmctl.asker.head_tail import Generation
    from swarmctl.asker.prefixes import PrefixCache
    from swarmctl.model_files.models import default_model_path

    async def run():
        link = await SwarmLink.open(SwarmHome(swarm.homes["asker"]), min_stages=2)
        asker = Asker(default_model_path(), 4, n_threads=N_THREADS)
        cache, rng, history, out = PrefixCache(), np.random.default_rng(8), [], []
        victim = ""
        try:
            for turn in range(3):
                history += [int(t) for t in rng.integers(100, 40000, 60)]
                if turn == 1:
                    victim = (await asyncio.to_thread(active_stages, swarm))[0]
                    kill_9(swarm, victim)
                    await asyncio.to_thread(swarm.wait_complete, 2)
                runs = []
                for prefixes in (cache, None):
                    gen = Generation(secrets.token_bytes(16), len(history))
                    async for _ in asker.generate(history, link, max_tokens=8, sampling=GREEDY, generation=gen,
                                                  ignore_eos=True, prefixes=prefixes, timeout=120):
                        pass
                    runs.append(gen)
                out.append((runs[0].tokens, runs[1].tokens, runs[0].cached_tokens, runs[0].prefix_recomputed))
                history += runs[0].tokens
            return out, victim
        finally:
            await link.close()
            asker.close()

    out, victim = asyncio.run(run())
    assert all(reused == plain for reused, plain, _, _ in out)
    assert [(cached, recomputed) for _, _, cached, recomputed in out] == [(0, False), (60, True), (128, False)]
    restart(swarm, victim)
    swarm.wait_complete(2)


@pytest.mark.heavy  # the simulator's 'stop' (tests/test_sim.py: the host stopped 6 s, a trunk 20 s)
def test_frozen_nodes_under_load_lose_nothing(swarm):
    """SIGSTOP, as a laptop lid or a starved machine does: first the host for 6 s (longer than its
    silence limit: on waking it must not blame the trunks for its own absence), then a serving
    trunk for 6 s (marked down; its requests move to the standby, and it rejoins on waking)."""
    prompts = random_prompts(11)
    want = solo(prompts, 32)

    async def freeze(name: str, seconds: float) -> None:
        process = node_of(swarm, name).process
        process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            process.send_signal(signal.SIGCONT)

    async def freeze_host_then_a_trunk() -> bool:
        version = (await asyncio.to_thread(swarm.status))["plan_version"]
        await freeze("host", 6.0)
        await asyncio.sleep(2.0)  # a round of the host's liveness checks after waking
        host_kept_plan = (await asyncio.to_thread(swarm.status))["plan_version"] == version
        await freeze((await asyncio.to_thread(active_stages, swarm))[0], 6.0)
        return host_kept_plan

    got, host_kept_plan, _ = generate_through(swarm, prompts, 32, freeze_host_then_a_trunk)
    assert host_kept_plan, "the host marked members down for its own stall"
    assert got == want
    swarm.wait_complete(2)
    # Rerouted requests abandoned streams on every hop; each must still have ended on both sides,
    # or the links between trunks would run out of QUIC streams (the plan stream and this query stay).
    deadline = time.monotonic() + 10
    while (streams := {n: swarm.stats_of(n)["open_streams"] for n in active_stages(swarm)}) and \
            any(v > 3 for v in streams.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(v <= 3 for v in streams.values()), streams


@pytest.mark.heavy  # the simulator's 'host_restart' seeds (tests/test_sim.py)
def test_a_host_restart_leaves_members_able_to_reconnect(swarm):
    kill_9(swarm, "host")
    swarm.start_host()
    status = swarm.wait_complete(2, timeout=60)  # trunks reconnect and re-register, no new invites
    assert status["plan_version"] > 1  # the numbering continues: no old packet matches a new plan
    r = swarmctl(swarm.homes["asker"], "ask", "--raw", "--temperature", "0", "--max-tokens", "16", PROMPT)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


@pytest.mark.heavy  # the simulator's 'kill' seeds (tests/test_sim.py)
def test_without_spare_capacity_a_request_fails_clearly_within_its_deadline(swarm):
    async def run():
        from swarmctl.model_files.models import default_model_path

        link = await SwarmLink.open(SwarmHome(swarm.homes["asker"]), min_stages=2)
        asker = Asker(default_model_path(), 4, n_threads=N_THREADS)
        prompt = asker.tokenizer.encode_prompt(PROMPT)
        try:
            job = asyncio.ensure_future(generate_all(asker, prompt, link, max_tokens=200, sampling=GREEDY,
                                                     ignore_eos=True, timeout=90))
            await asyncio.sleep(1.0)
            survivor = active_stages(swarm)[0]
            for name in TRUNKS:  # all but one: the survivor cannot hold the model alone
                if name != survivor and is_running(swarm, name):
                    kill_9(swarm, name)
            t0 = time.monotonic()
            with pytest.raises(SwarmError) as err:
                await job
            return str(err.value), time.monotonic() - t0
        finally:
            await link.close()
            asker.close()

    message, waited = asyncio.run(run())
    assert "cannot serve the model" in message and "layers [" in message and re.search(r"\d (GB|MB) missing", message)
    assert waited < 60
    for name in TRUNKS:
        if not is_running(swarm, name):
            restart(swarm, name)
    swarm.wait_complete(2)


@pytest.mark.heavy  # the simulator's 'partition' seeds (tests/test_sim.py)
def test_lossy_jittery_links_and_a_3s_cut_change_nothing(bundled_model):
    prompt_text = PROMPT

    async def run():
        relays = []
        host_port, trunk_ports = free_udp_port(), [free_udp_port(), free_udp_port()]
        for port in (host_port, *trunk_ports):
            relay = ImpairedLink(Address("127.0.0.1", port), delay_s=0.005, jitter_s=0.015, loss=0.02,
                                 seed=len(relays))
            await relay.start()
            relays.append(relay)
        fronts = Fronts.behind([host_port, *trunk_ports], [str(r.address) for r in relays])
        with LocalSwarm(model=str(bundled_model), n_trunks=2, planner=PlannerSettings(head_layers=4),
                        threads=1, fronts=fronts) as local:
            link = await SwarmLink.open(local.asker_home, alive_check=local.check_alive, min_stages=2,
                                        ready_timeout=120)
            asker = Asker(bundled_model, 4, n_threads=1)
            prompt = asker.tokenizer.encode_prompt(prompt_text)
            try:
                job = asyncio.ensure_future(generate_all(asker, prompt, link, max_tokens=48, sampling=GREEDY,
                                                         ignore_eos=True, timeout=150))
                while not asker.in_flight or len(next(iter(asker.in_flight.values())).tokens) < 8:
                    await asyncio.sleep(0.05)
                relays[2].cut = True  # the link to the second stage goes dark ...
                await asyncio.sleep(3.0)
                relays[2].cut = False  # ... and comes back
                gen = await job
                return prompt, gen.tokens, sum(r.stats.dropped_loss for r in relays)
            finally:
                await link.close()
                asker.close()
                for relay in relays:
                    relay.close()

    prompt, tokens, dropped = asyncio.run(run())
    assert dropped > 0  # the loss was real
    assert tokens == solo([prompt], 48)[0]
