"""Layers from everyone who holds them, with real processes on loopback: a trunk with no model
file fetches its slice from the host and, at once, from the members the host names as holding
those layers (fetch_chunks over member QUIC connections, swarmctl/trunk/layer_share.py).

One swarm, four trunks that hold the whole model and one that holds nothing:

    trunk-a     serves what it holds, at --upload-mbit 40 (see below)
    bad-trunk   sends chunks with a flipped byte (fault injection: SWARMCTL_TEST_SERVE_WRONG_CHUNKS,
                as a corrupt disk would): dropped for the fetch and reported to the host
    trunk-zero  --upload-mbit 0: the host never lists it, and it refuses a direct request
    trunk-b     no model file: fetches its layers, and the swarm answers as llama-cpp-python

The model is a tiny GGUF wide enough that each trunk's two layers (8 trunk layers, "even") are
about 54 chunks of 1 MiB a layer, several batches of 16: every source gets a batch before the end game.
The host lists holders by how much of the slice they hold, then by name, and the fetcher asks
them in that order before the host: bad-trunk first, so its first batch is out before anyone
could take its chunks from it. The race is set so that every member has time to be reached and
win a share: the host and trunk-a serve at 40 Mbit/s each (``--upload-mbit``; the 51 MB slice
takes them about 5 s together), bad-trunk at 4000. With the members at the default 10 Mbit/s
(0.84 s a 1 MiB chunk), and again with them at 4000 but the host uncapped, the host on loopback
(67 MB/s) sent trunk-b's one-layer slice whole (1 s) before a member's first chunk arrived: a
share of 0 % and no wrong chunk seen, in a CI run and in a full local run. With the host at 80 and
trunk-a at 4000 the two sent it in 1 s, in a run of the suite in two workers beside other load,
before trunk-b had reached bad-trunk at all (its first connection to it came 3 s later).
"""

from __future__ import annotations

import asyncio

import pytest

from harness.swarm import Swarm, swarmctl
from harness.tiny_models import TinyConfig, write_tiny_model
from net.endpoint import Address, connect_member, close
from net import messages as m
from net.protocol import RequestOnlyHandler
from swarmctl.node.home import SwarmHome
from tests.conftest import make_oracle

PROMPT = "The capital of France is"
ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "8")
FAST_UPLOAD = ("--upload-mbit", "4000")  # bad-trunk: its batch goes out at once (module docstring)
SLOW_UPLOAD = ("--upload-mbit", "40")  # the host and trunk-a: 5 MB/s each, the 51 MB slice in ~5 s
WIDE = TinyConfig(n_layer=10, n_embd=256, n_head=4, n_head_kv=2, n_ff=16384, qtype="F32", seed=7)  # 54 chunks a layer


def shares_in(log: str) -> dict[str, int]:
    """Each source's share of the bytes, from the fetch's line that gives them."""
    line = next(ln for ln in log.splitlines() if "fetched layers" in ln and "% from the" in ln)
    return {part.split(" from the ")[1].strip(): int(part.split("%")[0].strip())
            for part in line.split("MB): ", 1)[1].split("; ")}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory, bundled_model):
    return write_tiny_model(tmp_path_factory.mktemp("wide") / "wide.gguf", WIDE, bundled_model)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory, wide_model):
    s = Swarm(tmp_path_factory.mktemp("member-sources"))
    mp = pytest.MonkeyPatch()
    try:
        s.init("--model", str(wide_model), "--head-layers", "1")
        s.start_host(*SLOW_UPLOAD)
        s.wait_host()
        for name in ("trunk-a", "bad-trunk", "trunk-zero"):
            s.join(name, "--model", str(wide_model))
        s.join("trunk-b", "--model", str(s.root / "no-such-model.gguf"))
        s.join("asker", role="asker", *("--model", str(wide_model)))
        s.start_trunk("trunk-a", *SLOW_UPLOAD, capture=False)
        with mp.context() as env:  # (Popen copies the environment as it starts)
            env.setenv("SWARMCTL_TEST_SERVE_WRONG_CHUNKS", "1")
            s.start_trunk("bad-trunk", *FAST_UPLOAD, capture=False)
        s.start_trunk("trunk-zero", "--upload-mbit", "0", capture=False)
        s.wait_complete(3, timeout=120)
        s.trunk_b = s.start_trunk("trunk-b", capture=False)
        s.wait_complete(4, timeout=180)
        yield s
    finally:
        s.close()


def test_a_new_trunk_fetches_from_the_host_and_a_member_at_once_and_answers_as_the_oracle(swarm, wide_model):
    log = swarm.trunk_b.log()
    shares = shares_in(log)
    assert shares.get("member trunk-a", 0) > 0 and shares.get("host", 0) > 0, log
    listed = [line for line in swarm.nodes[0].log().splitlines() if "members holding" in line]
    assert listed and all("trunk-a" in line and "trunk-zero" not in line for line in listed)  # a budget of 0: never
    assert "member trunk-zero" not in log
    assert "expert call" not in log and "unexpected error" not in log  # (what a stopped batch still sent is dropped)
    r = swarmctl(swarm.homes["asker"], *ASK, PROMPT, timeout=300)
    assert r.returncode == 0, r.stderr
    llm = make_oracle(wide_model)
    try:
        want = llm.create_completion(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()
    assert r.stdout == want + "\n"


def test_a_member_sending_wrong_chunks_is_dropped_and_reported_and_the_fetch_completes(swarm):
    log = swarm.trunk_b.log()
    dropped = [line for line in log.splitlines() if "member bad-trunk sent a wrong chunk" in line]
    assert len(dropped) == 1 and "does not match the host's hash" in dropped[0], log
    assert "bad-trunk" not in shares_in(log)
    host_log = swarm.nodes[0].log()
    assert "member bad-trunk sent trunk-b chunks that fail the host's hashes" in host_log, host_log
    assert "no longer listed" not in host_log  # one report evicts nobody (nor stops listing it)
    assert "serving layers" in log  # the fetch completed, checked, and the slice serves


def test_a_member_with_no_upload_budget_serves_nothing(swarm):
    """Asked directly (as a trunk: only trunks fetch layers), it refuses in one line."""
    member = next(x for x in swarm.status()["members"] if x["name"] == "trunk-zero")
    creds = SwarmHome(swarm.homes["trunk-b"]).credentials()
    asker = SwarmHome(swarm.homes["asker"]).credentials()
    request = m.FetchChunks(tensors=["blk.0.ffn_up.weight"], want=["0:0"])

    async def ask(who):
        conn = await connect_member(Address.parse(member["address"]), who, "trunk-zero", RequestOnlyHandler())
        try:
            reply = await conn.request(m.encode(request))
            return m.decode(reply.body, m.Done)
        finally:
            await close(conn)

    with pytest.raises(m.Refused, match="serves no layers"):
        asyncio.run(ask(creds))
    with pytest.raises(m.Refused, match="needs a trunk certificate"):
        asyncio.run(ask(asker))
