"""A real swarm on loopback, set up only through init / invite / join / run: answers, rejections,
hostile traffic, and what a trunk gets to see."""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from net.endpoint import Address, close, connect_member
from net.identity import Credentials, fingerprint, make_ca, new_private_key, sign_member
from net.invite import Invite
from net.protocol import RequestOnlyHandler
from net.wire import ActivationPacket, PacketKind, decode_control, decode_packet, encode_control, encode_packet
from swarmctl.node.home import SwarmHome
from harness.swarm import Swarm, swarmctl

PROMPT = "The three primary colours are"
ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "24")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """host + 2 trunks (each capturing what it receives and sends), and an asker, all joined by invite."""
    s = Swarm(tmp_path_factory.mktemp("swarm"))
    try:
        s.init()
        s.start_host()
        s.wait_host()
        for name in ("trunk-a", "trunk-b", "asker"):
            s.join(name)
        s.start_trunk("trunk-a")
        s.start_trunk("trunk-b")
        s.wait_complete(2)
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def inproc_answer():
    r = swarmctl(None, *ASK, "--transport", "inproc", PROMPT, check=True)
    return r.stdout


def test_swarm_answer_equals_inproc_and_oracle(swarm, inproc_answer, oracle):
    r = swarmctl(swarm.homes["asker"], *ASK, PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == inproc_answer  # same engine, same steps, f32 on the wire: identical tokens
    want = oracle.create_completion(PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"]
    assert r.stdout == want + "\n"


def test_status_lists_members_ranges_and_health(swarm):
    r = swarmctl(swarm.homes["asker"], "status")
    assert r.returncode == 0, r.stderr
    assert "complete" in r.stdout.splitlines()[0]
    rows = {line.split()[0]: line for line in itertools.takewhile(str.strip, r.stdout.splitlines()[2:])}
    assert "ready" in rows["trunk-a"] and "ready" in rows["trunk-b"] and "up (host)" in rows["host"]
    status = json.loads(swarmctl(swarm.homes["asker"], "status", "--json", check=True).stdout)
    ranges = sorted(tuple(m["layers"]) for m in status["members"] if m["layers"])
    assert ranges[0][0] == 4 and ranges[-1][1] == 26 and ranges[0][1] == ranges[1][0]


def test_status_shows_every_link_of_the_plan_measured(swarm):
    """Trunks probe the plan's other stages and the host (the asker's side) once they serve, and
    report round trip and throughput; status shows each link the plan uses, in order."""
    deadline, links = time.monotonic() + 30, []
    while time.monotonic() < deadline:
        status = json.loads(swarmctl(swarm.homes["asker"], "status", "--json", check=True).stdout)
        links = status["links"]
        if links and all(link["measured"] and link["bandwidth_measured"] for link in links):
            break
        time.sleep(0.5)
    stages = [m["name"] for m in sorted((m for m in status["members"] if m["layers"]), key=lambda m: m["layers"][0])]
    assert [(link["source"], link["target"]) for link in links] == \
        [("asker", stages[0]), (stages[0], stages[1]), (stages[1], "asker")]
    for link in links:
        assert link["path"] == "direct" and link["basis"] == "measured", link
        assert link["measured"] and link["bandwidth_measured"], link
        assert 0 < link["rtt_ms"] < 1000 and link["bandwidth_mb_s"] > 0, link
    table = swarmctl(swarm.homes["asker"], "status", check=True).stdout
    assert f"{stages[0]} → {stages[1]}" in table and "THROUGHPUT" in table and "estimated" not in table


def test_key_files_are_private(swarm):
    for home in [swarm.host_home, *swarm.homes.values()]:
        assert (home / "node.key").stat().st_mode & 0o777 == 0o600
    assert (swarm.host_home / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (swarm.host_home / "invites.json").stat().st_mode & 0o777 == 0o600
    invites = (swarm.host_home / "invites.json").read_text()
    assert "secret_hash" in invites and '"s"' not in invites  # only hashes of secrets are stored


def test_trunks_never_see_prompt_text_or_token_ids(swarm):
    prompt = "Zanzibar Quokka-7731 reported on Thursday"
    before = {name: set(d.iterdir()) for name, d in swarm.captures.items()}
    r = swarmctl(swarm.homes["asker"], *ASK, prompt)
    assert r.returncode == 0, r.stderr
    from kernels.tokenizer import Tokenizer
    from swarmctl.model_files.models import default_model_path

    ids = Tokenizer(default_model_path()).encode_prompt(prompt)
    needles = [prompt.encode(), "Zanzibar".encode(), "Quokka".encode(), "Zanzibar".encode("utf-16-le")]
    for fmt in ("<i", "<q", "<I", ">i"):  # the ids packed as 32- and 64-bit integers
        needles.append(b"".join(struct.pack(fmt, t) for t in ids[:3]))
    needles.append(json.dumps(ids[:3])[1:-1].encode())  # as a JSON list
    seen = 0
    for name, folder in swarm.captures.items():
        for path in set(folder.iterdir()) - before[name]:
            data = path.read_bytes()
            seen += 1
            for needle in needles:
                assert needle not in data, f"{name} captured {needle!r} in {path.name}"
    assert seen >= 4  # the capture really saw this request's traffic on both trunks


def _member(name: str, ca_key, ca_cert) -> Credentials:
    key = new_private_key()
    return Credentials(key, sign_member(ca_key, ca_cert, key.public_key(), name), ca_cert)


def _trunk_address(swarm: Swarm, name: str) -> str:
    return next(m["address"] for m in swarm.status()["members"] if m["name"] == name)


def _new_requests(swarm: Swarm, before: dict[str, int]) -> list[str]:
    """The control requests each trunk received since `before` (its capture counts), by type. The
    host keeps checking trunks meanwhile (layer proofs arrive whenever its schedule says), so a count
    of frames cannot tell the attacker's from the host's; a request's type can."""
    seen = []
    for name, d in swarm.captures.items():
        for path in sorted(d.iterdir())[before[name]:]:
            if path.name.endswith("-recv-control.bin"):
                seen.append(f"{name}:{json.loads(path.read_bytes()).get('type')}")
    return seen


def test_unauthenticated_peers_get_nothing(swarm):
    asker = SwarmHome(swarm.homes["asker"]).credentials()
    other_key, other_ca = make_ca("another-swarm")
    outsider = _member("asker", other_key, other_ca)  # right name, wrong CA
    outsider = Credentials(outsider.key, outsider.cert, asker.ca_cert)  # trusts our CA, presents its own cert
    targets = [(f"127.0.0.1:{swarm.host_port}", "host"), (_trunk_address(swarm, "trunk-a"), "trunk-a")]
    captured = {name: len(list(d.iterdir())) for name, d in swarm.captures.items()}

    async def attempt(creds: Credentials | None, address: str, peer: str) -> str:
        from aioquic.quic.configuration import QuicConfiguration

        from net.endpoint import _connect
        from net.identity import cert_pem
        from net.tls import ALPN_SWARM

        if creds is None:  # a client that presents no certificate at all
            config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN_SWARM], server_name=peer)
            config.cadata = cert_pem(asker.ca_cert)
            try:
                conn = await _connect(Address.parse(address), config, RequestOnlyHandler(), 1 << 20)
            except ConnectionError as e:
                return str(e)
        else:
            try:
                conn = await connect_member(Address.parse(address), creds, peer, RequestOnlyHandler())
            except ConnectionError as e:
                return str(e)
        try:
            await conn.request(encode_control({"type": "status"}), timeout=3)
            return "ANSWERED"
        except (ConnectionError, asyncio.TimeoutError) as e:
            return f"closed: {e}"
        finally:
            await close(conn)

    for address, peer in targets:
        assert "certificate is required" in asyncio.run(attempt(None, address, peer))
        assert "not issued by this swarm's CA" in asyncio.run(attempt(outsider, address, peer))
    assert not [r for r in _new_requests(swarm, captured) if r.endswith(":status")]  # nothing served
    asyncio.run(attempt(asker, targets[1][0], "trunk-a"))  # a member's request is seen, so the check can fail
    assert "trunk-a:status" in _new_requests(swarm, captured)


def test_one_connection_carries_hundreds_of_requests(swarm):
    """QUIC grants a peer only so many streams (128 in aioquic) until streams finish both ways: a
    long-lived connection (an asker, a monitor polling stats) must not stall at request 129."""
    creds = SwarmHome(swarm.homes["asker"]).credentials()

    async def many() -> int:
        conn = await connect_member(Address("127.0.0.1", swarm.host_port), creds, "host", RequestOnlyHandler())
        try:
            replies = [decode_control((await conn.request(encode_control({"type": "get_plan"}), timeout=5)).body)
                       for _ in range(300)]
            return sum(r["type"] == "plan" for r in replies)
        finally:
            await close(conn)

    assert asyncio.run(many()) == 300


def test_revoked_member_is_cut_off(swarm):
    eve_home = swarm.join("eve")
    assert swarmctl(eve_home, "status").returncode == 0
    creds = SwarmHome(eve_home).credentials()

    async def live_connection_closed_by_revocation() -> bool:
        conn = await connect_member(Address("127.0.0.1", swarm.host_port), creds, "host", RequestOnlyHandler())
        await conn.request(encode_control({"type": "status"}))
        r = await asyncio.to_thread(swarmctl, swarm.host_home, "revoke", "eve")
        assert r.returncode == 0 and "revoked eve" in r.stdout, r.stderr
        try:
            await asyncio.wait_for(conn.wait_closed(), 5)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            await close(conn)

    assert asyncio.run(live_connection_closed_by_revocation())
    r = swarmctl(eve_home, "status")
    assert r.returncode != 0 and "revoked" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = swarmctl(eve_home, *ASK, PROMPT)
    assert r.returncode != 0 and r.stdout == ""


def test_a_revocation_the_running_host_did_not_hear_is_read_from_its_records(swarm):
    """`swarmctl revoke` writes the record, then tells the running host; when that message never
    arrives (the host stopped or too busy to answer the CLI in time), the host still finds the
    revocation in its member records and closes the member's live connection."""
    from swarmctl.host.revocations import RECORDS_POLL_S
    from swarmctl.node.membership import revoke

    grace_home = swarm.join("grace")
    creds = SwarmHome(grace_home).credentials()

    async def close_reason_after_record_written() -> str | None:
        """Why the host closed grace's connection after the record was written; None: it did not."""
        conn = await connect_member(Address("127.0.0.1", swarm.host_port), creds, "host", RequestOnlyHandler())
        try:
            await conn.request(encode_control({"type": "status"}))
            revoke(SwarmHome(swarm.host_home), "grace")  # the record alone: no message to the host
            try:
                await asyncio.wait_for(conn.wait_closed(), RECORDS_POLL_S + 3)
            except asyncio.TimeoutError:
                return None
            return conn.close_reason
        finally:
            await close(conn)

    reason = asyncio.run(close_reason_after_record_written())
    assert reason is not None and "revoked" in reason, reason
    serial = SwarmHome(swarm.host_home).members()["grace"].serial
    assert serial in swarm.plan()["revoked_serials"]  # what tells the stages


def test_bad_invites_are_refused_and_leave_the_swarm_as_it_was(swarm):
    members_before = (swarm.host_home / "members.json").read_text()

    def join(code: str, name: str) -> subprocess.CompletedProcess:
        return swarmctl(swarm.root / f"joiner-{name}", "join", code, "--name", name, "--listen", "127.0.0.1:0")

    # expired: refused on the joiner's side before anything is sent ...
    short = swarm.invite("--ttl", "1s")
    time.sleep(1.2)
    r = join(short, "late")
    assert r.returncode != 0 and "invite has expired" in r.stderr
    # ... and by the host, whose record is what counts
    code = swarm.invite("--ttl", "1h")
    token = Invite.decode(code).token_id
    with SwarmHome(swarm.host_home).locked():
        records = json.loads((swarm.host_home / "invites.json").read_text())
        records[token]["expires_at"] = int(time.time()) - 10
        (swarm.host_home / "invites.json").write_text(json.dumps(records))
    r = join(code, "late2")
    assert r.returncode != 0 and "the host refused: this invite expired at" in r.stderr
    # tampered: one character changed
    good = swarm.invite()
    i = len("swarm1.") + 20
    tampered = good[:i] + ("A" if good[i] != "A" else "B") + good[i + 1:]
    r = join(tampered, "tamper")
    assert r.returncode != 0 and "checksum mismatch" in r.stderr
    # a fingerprint that is not the host's CA (re-encoded, so the checksum is valid)
    invite = Invite.decode(good)
    forged = Invite(invite.addresses, fingerprint(make_ca("evil")[1]), invite.token_id, invite.secret,
                    invite.expires_at).encode()
    r = join(forged, "pinned")
    assert r.returncode != 0 and "fingerprint mismatch" in r.stderr
    # single use, used twice
    assert join(good, "first").returncode == 0
    r = join(good, "second")
    assert r.returncode != 0 and "already been used" in r.stderr
    for r_err in (r.stderr,):
        assert len(r_err.strip().splitlines()) == 1 and "Traceback" not in r_err
    members = json.loads((swarm.host_home / "members.json").read_text())
    assert set(members) == set(json.loads(members_before)) | {"first"}
    assert not (swarm.root / "joiner-second" / "node.key").exists()


def test_hostile_traffic_gets_errors_while_a_real_request_completes(swarm, inproc_answer):
    creds = SwarmHome(swarm.homes["asker"]).credentials()
    plan = asyncio.run(_plan(swarm, creds))
    first = plan["stages"][0]
    legit = subprocess.Popen([sys.executable, "-m", "swarmctl", *ASK, PROMPT], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**__import__("os").environ, "SWARMCTL_HOME": str(swarm.homes["asker"])})
    time.sleep(1.0)
    outcomes = asyncio.run(_hostile(first, plan["version"], creds))
    out, err = legit.communicate(timeout=120)
    assert legit.returncode == 0, err
    assert out == inproc_answer
    assert "wrong shape" in outcomes and "do not fit" in outcomes["wrong shape"]
    assert "unknown request" in outcomes and "unknown request" in outcomes["unknown request"]
    for case in ("truncated", "oversized", "random bytes"):
        assert outcomes[case] == "stream reset", (case, outcomes[case])
    node = next(n for n in swarm.nodes if n.home == swarm.homes[first["member"]])
    assert node.alive
    log = node.log()
    assert log.count("rejected:") >= 3 and log.count("refused:") >= 2


def test_floods_of_fresh_request_ids_leave_nothing_behind(swarm):
    """END and refused packets with fresh request ids, thousands of them: the stage keeps no lock
    per id it ever saw (it kept one: +27 MB per 100k), and logs a bounded number of lines."""
    creds = SwarmHome(swarm.homes["asker"]).credentials()
    plan = asyncio.run(_plan(swarm, creds))
    first = plan["stages"][0]
    node = next(n for n in swarm.nodes if n.home == swarm.homes[first["member"]])
    lines_before = node.log().count("refused")

    async def flood() -> None:
        conn = await connect_member(Address.parse(first["address"]), creds, first["member"], RequestOnlyHandler())
        try:
            x = np.zeros((1, 576), dtype=np.float32)
            for kind in (PacketKind.DECODE, PacketKind.END):
                stream = conn.open_stream()
                for i in range(2000):
                    data = x if kind == PacketKind.DECODE else np.empty((0, 0), np.float32)
                    conn.send(stream, encode_packet(ActivationPacket(kind, secrets.token_bytes(16), plan["version"],
                                                                     first["start"], 7, data)))
                    if i % 200 == 0:
                        await conn.drain(stream, 1 << 20)
                await conn.drain(stream, 0)
                await asyncio.sleep(1.0)
        finally:
            await close(conn)

    asyncio.run(flood())
    deadline = time.monotonic() + 10
    while (stats := swarm.stats_of(first["member"]))["request_locks"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats["request_locks"] == 0
    assert node.alive
    refused_lines = node.log().count("refused") - lines_before
    assert 1 <= refused_lines <= 60, refused_lines  # 2000 refusals, a few dozen lines at most


async def _plan(swarm: Swarm, creds: Credentials) -> dict:
    conn = await connect_member(Address("127.0.0.1", swarm.host_port), creds, "host", RequestOnlyHandler())
    try:
        return decode_control((await conn.request(encode_control({"type": "get_plan"}))).body)["plan"]
    finally:
        await close(conn)


async def _hostile(first: dict, version: int, creds: Credentials) -> dict[str, str]:
    conn = await connect_member(Address.parse(first["address"]), creds, first["member"], RequestOnlyHandler())
    outcomes = {}

    async def answer(data: bytes, end: bool = False) -> str:
        stream = conn.open_stream()
        waiter = asyncio.get_running_loop().create_future()
        conn._waiters[stream] = waiter
        conn.send(stream, data, end=end)
        try:
            frame = await asyncio.wait_for(waiter, 5)
            packet = decode_packet(frame.body)
            return packet.message if packet.kind == PacketKind.ERROR else f"unexpected {packet.kind.name}"
        except ConnectionResetError:
            return "stream reset"
        except asyncio.TimeoutError:
            return "no answer"

    def packet(kind: PacketKind, n_embd: int, start: int = 0, layer: int = first["start"]) -> bytes:
        data = np.zeros((2 if kind == PacketKind.PREFILL else 1, n_embd), dtype=np.float32)
        return encode_packet(ActivationPacket(kind, secrets.token_bytes(16), version, layer, start, data))

    try:
        outcomes["wrong shape"] = await answer(packet(PacketKind.PREFILL, 100))
        outcomes["unknown request"] = await answer(packet(PacketKind.DECODE, 576, start=7))
        good = packet(PacketKind.PREFILL, 576)
        outcomes["truncated"] = await answer(good[: len(good) // 2], end=True)
        outcomes["oversized"] = await answer(struct.pack(">IB", 2**31, 2) + b"\0" * 64)
        outcomes["random bytes"] = await answer(secrets.token_bytes(200))
    finally:
        await close(conn)
    return outcomes


def test_three_trunks_give_the_same_answer(swarm, inproc_answer):
    """Last, because it grows the module's swarm: a third trunk joins while asks run, and the host
    re-plans make-before-break (issue 30 item 2b): the new plan is staged, the trunks load it beside
    the plan in use, and askers switch only once every stage of it is ready. Before, the host
    published the new plan at once, with stages not ready, and asks waited or failed meanwhile."""
    swarm.join("trunk-c")

    async def scenario():
        plans: list[dict] = []
        watcher = asyncio.ensure_future(swarm.watch_plans(plans))
        try:
            while not plans:
                await asyncio.sleep(0.1)
            swarm.start_trunk("trunk-c")
            answers, deadline = [], time.monotonic() + 120
            while not any(len(p["stages"]) == 3 for p in plans):
                assert time.monotonic() < deadline, plans[-1]
                answers.append(await asyncio.to_thread(swarmctl, swarm.homes["asker"], *ASK, PROMPT))
            answers.append(await asyncio.to_thread(swarmctl, swarm.homes["asker"], *ASK, PROMPT))
        finally:
            watcher.cancel()
        return plans, answers

    plans, answers = asyncio.run(scenario())
    assert [len(p["stages"]) for p in plans][-1] == 3
    for p in plans:  # an asker never got a plan it could not ask on
        assert p["stages"] and all(s["ready"] for s in p["stages"]) and not p.get("staged"), p
    for r in answers:
        assert r.returncode == 0, r.stderr
        assert r.stdout == inproc_answer
    log = swarm.nodes[0].log()
    assert "staged:" in log and "is ready: switching from" in log, log[-3000:]
    status = swarm.wait_complete(3)
    assert len([m for m in status["members"] if m["layers"]]) == 3


def test_ask_with_no_swarm_starts_a_local_one(tmp_path):
    """README's first command: no swarm joined, so `ask` starts host + 2 trunks on loopback."""
    home = tmp_path / "fresh-home"
    r = swarmctl(home, "ask", "--seed", "1", "Give me three tips for staying healthy.")
    assert r.returncode == 0, r.stderr
    text = r.stdout.lower()
    assert len(text) > 80 and any(w in text for w in ("water", "sleep", "exercise", "diet", "healthy"))
    assert not home.exists()  # the local swarm's state lived in a temporary folder
