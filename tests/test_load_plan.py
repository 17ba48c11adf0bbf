"""Issue 29, item 5, through a real swarm: eight concurrent requests on a two-trunk swarm planned
for latency (every trunk layer on one trunk, the other standing by), host and trunks as separate
processes on loopback, QUIC + mTLS. The swarm used to re-plan under its own load (a stage's figure
taken beside its own work read 10x slower than the idle trunk's) and reroute every request; now
the plan must not change at all while the load is steady and nobody joins or leaves. Asserted on
plan versions and reroutes, never on speed (benchmarks/bench_load_plan.py measures throughput)."""

from __future__ import annotations

import asyncio
import re
import time

from kernels.sampling import SamplingParams
from swarmctl.asker.head_tail import Asker, generate_all
from swarmctl.node.home import SwarmHome
from swarmctl.asker.link import SwarmLink
from harness.swarm import Swarm

STREAMS = 8
MAX_TOKENS = 160  # about a minute of steady load here: the old host re-planned 6 times in it


SETTLE_S = 3.0  # the plan unchanged this long with both trunks checked: the swarm has settled


def wait_checked(swarm: Swarm, timeout: float = 120) -> dict:
    """The status once both trunks' claims were checked, the plan is complete and it has stayed
    the same plan for SETTLE_S: what joining changes, it has changed by then. (Without the settling,
    a run beside other load took plan v1, on trunk-a, as its "before", and one second later v2 put
    the layers on trunk-b, saying trunk-a alone would make each token 2.3 ms slower. Read from the
    code, not traced in that run: a trunk is planned in once its proof passes, and that re-plan
    starts from scratch, so the second trunk proven takes the layers when its figure reads faster.)"""
    deadline = time.monotonic() + timeout
    settled: tuple[int, float] | None = None  # (plan version, since when it held with both checked)
    while time.monotonic() < deadline:
        status = swarm.status()
        trunks = [m for m in status.get("members", []) if m["name"].startswith("trunk-")]
        if status.get("complete") and len(trunks) == 2 and all(m["health"] in ("ready", "up") for m in trunks):
            if settled is None or settled[0] != status["plan_version"]:
                settled = (status["plan_version"], time.monotonic())
            elif time.monotonic() - settled[1] >= SETTLE_S:
                return status
        else:
            settled = None
        time.sleep(0.5)
    raise AssertionError(f"the trunks were not checked, or the plan did not settle: {swarm.status()}")


def test_eight_streams_on_a_latency_swarm_reroute_nothing(tmp_path, bundled_model):
    swarm = Swarm(tmp_path)
    try:
        swarm.init("--objective", "latency")
        swarm.start_host()
        swarm.wait_host()
        for name in ("trunk-a", "trunk-b", "asker"):
            swarm.join(name)
        swarm.start_trunk("trunk-a", "--threads", "1", capture=False)
        swarm.start_trunk("trunk-b", "--threads", "1", capture=False)
        swarm.wait_complete(1, timeout=120)
        before = wait_checked(swarm)
        stage = next(m["name"] for m in before["members"] if m["layers"])

        async def load():
            link = await SwarmLink.open(SwarmHome(swarm.homes["asker"]), min_stages=1)
            asker = Asker(bundled_model, link.head_layers, n_threads=1)
            try:
                seen = {link.plan.version}
                prompt = asker.tokenizer.encode_prompt("Write a long story about a lighthouse keeper.")
                gens = await asyncio.gather(*(
                    generate_all(asker, prompt, link, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 sampling=SamplingParams(temperature=0.0)) for _ in range(STREAMS)))
                seen |= {link.plan.version, link.host.latest.version}
                return gens, seen, link.stats.recoveries
            finally:
                await link.close()
                asker.close()

        gens, versions_seen, reroutes = asyncio.run(load())
        after = swarm.status()
        host_log = swarm.nodes[0].log()
    finally:
        swarm.close()
    assert [len(g.tokens) for g in gens] == [MAX_TOKENS] * STREAMS
    plans_logged = [line for line in host_log.splitlines() if re.search(r"plan v\d+:|re-?plan|measured|speed", line)]
    assert after["plan_version"] == before["plan_version"], "\n".join(plans_logged)
    assert versions_seen == {before["plan_version"]} and reroutes == 0, (versions_seen, reroutes)
    assert [m["name"] for m in after["members"] if m["layers"]] == [stage]
