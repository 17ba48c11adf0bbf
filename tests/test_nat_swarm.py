"""The swarm across home routers, as a user runs it (issue 17): only the host is reachable, every
other member sits behind a NAT of its own with nothing forwarded, and `swarmctl` does the rest.

harness/nat_lab.py builds the machines: the host and erin on the "public" network (erin is a
trunk that also relays: `run --relay`), alice and bob behind port-preserving NATs (MASQUERADE),
carol behind a symmetric one (--random-fully) with gwen, a second trunk, on her home network
behind the same router; dave (who only asks) behind a fourth, port-preserving, and frank (who
only asks) behind a fifth, symmetric. Real processes, real iptables NAT, the real swarm.

Checked: the swarm forms with no port forwarding and answers exactly as one process does; links
between cone NATs are punched, links that punching cannot open (carol's and gwen's, from behind
another NAT) go through erin's relay, carol and gwen reach each other on their LAN; `status` says
so per link, and shows each trunk at its own public mapping; an asker remembers where punching
failed and its next ask goes straight to the relay; a trunk whose router forgets its mappings and
renumbers its ports comes back without a restart; killing the relay moves its links to the
host's relay.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
import sys
import time

import pytest

from harness.nat_lab import HOST_IP, NatLab
from harness.netns import LabUnavailable

pytestmark = pytest.mark.netns

PROMPT = "Give me three tips for staying healthy."
GREEDY = ("--max-tokens", "8", "--temperature", "0")
TRUNKS = ("alice", "bob", "carol", "gwen", "erin")
NATS = {"alice": "cone", "bob": "cone", "carol": "symmetric", "dave": "cone", "frank": "symmetric"}
BEHIND = {"gwen": "carol"}  # on carol's home network, behind her router
PUBLIC = ("erin",)  # reachable with no NAT; relays
ROUTER = {**{name: name for name in NATS}, **BEHIND}  # member → whose router it is behind
SWARM_PORT, HOST_PORT = 7471, 7470  # every trunk's (the default), the host's


class NatSwarm:
    def __init__(self, lab: NatLab, root) -> None:
        self.lab, self.root = lab, root
        self.homes = {name: root / name for name in ("host", *NATS, *BEHIND, *PUBLIC)}
        self.trunks = set(TRUNKS)  # the trunks expected to serve
        self.nodes = {}

    def swarmctl(self, machine: str, *args: str, check: bool = True, timeout: float = 180):
        r = self.lab.net.swarmctl(machine, self.homes[machine], *args, timeout=timeout)
        if check:
            assert r.returncode == 0, f"{machine}: swarmctl {' '.join(args)} failed ({r.returncode}):\n{r.stderr}\n{self.logs()}"
        return r

    def status(self) -> dict | None:
        r = self.swarmctl("host", "status", "--json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(f"--- {name}:\n{p.log()[-tail:]}" for name, p in self.nodes.items())

    def wait(self, what: str, check, timeout: float = 150):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for name, process in self.nodes.items():
                assert process.alive, f"{name} exited while waiting for {what}:\n{process.log()}"
            last = check()
            if last:
                return last
            time.sleep(0.5)
        raise AssertionError(f"gave up waiting for {what}; last: {last}\n{self.logs()}")

    def complete(self) -> dict | None:
        """The status once every trunk serves a stage of a complete plan and all are ready."""
        status = self.status()
        if status is None or not status["complete"]:
            return None
        staged = [m for m in status["members"] if m["layers"]]
        if {m["name"] for m in staged} != self.trunks or any(m["health"] != "ready" for m in staged):
            return None
        return status


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    if shutil.which("iptables") is None:
        pytest.skip("the NAT lab needs iptables (apt-get install -y iptables conntrack)")
    root = tmp_path_factory.mktemp("nat-swarm")
    try:
        lab = NatLab(NATS, root, public=PUBLIC, behind=BEHIND)
    except LabUnavailable as e:
        pytest.skip(f"the NAT lab needs network namespaces: {e}")
    s = NatSwarm(lab, root)
    try:
        # The answer to compare with: every slice in one process, nothing joined.
        inproc = lab.net.swarmctl("dave", root / "nobody", "ask", "--transport", "inproc", *GREEDY, PROMPT)
        assert inproc.returncode == 0 and inproc.stdout.strip(), inproc.stderr
        s.inproc = inproc.stdout
        # "even" puts a stage on every trunk, so every kind of link is in the plan.
        s.swarmctl("host", "init", "--advertise", f"{HOST_IP}:{HOST_PORT}", "--objective", "even")
        s.nodes["host"] = lab.net.start("host", s.homes["host"], "run", "--role", "host")
        s.wait("the host", s.status)
        for name in (*NATS, *BEHIND, *PUBLIC):
            code = s.swarmctl("host", "invite", "--role", "trunk" if name in TRUNKS else "asker").stdout.strip()
            s.swarmctl(name, "join", code, "--name", name)
        for name in TRUNKS:
            s.nodes[name] = lab.net.start(name, s.homes[name], "run", "--role", "trunk", "--memory", "12G",
                                          *(["--relay"] if name in PUBLIC else []))
        s.wait("every trunk serving, behind its NAT", s.complete)
        yield s
    finally:
        lab.close()


def _members_table(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in itertools.takewhile(str.strip, out.splitlines()[2:])}


def _links_table(out: str) -> list[str]:
    """`swarmctl status`'s link rows ("1  asker → alice  punched (dave)  …")."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "→" in line)
    return [line for line in lines[start:] if "→" in line]


def _expected_path(a: str, b: str, relay: str = "erin") -> str:
    """How ``a`` reaches ``b`` in this lab."""
    nat_a, nat_b = NATS.get(ROUTER.get(a, "")), NATS.get(ROUTER.get(b, ""))
    if nat_b is None or a == b or ROUTER.get(a) == ROUTER[b]:
        return "direct"  # b can be reached unasked, or on a's own home network
    if nat_a is not None and "symmetric" in (nat_a, nat_b):
        # each end's probes aim at a port the other's NAT did not open for them: a relay, never one of the ends
        return f"relayed via {relay if relay not in (a, b) else 'host'}"
    return "punched"  # (from a public machine, towards any NAT: its probes answer the ones that arrive)


def _asker_row(asker: str, trunk: str, relay: str = "erin") -> str:
    """The path `status` shows for the asker's side (the newest ask's)."""
    path = _expected_path(asker, trunk, relay)
    return path if path == "direct" else f"{path} ({asker})"


def _order(status: dict) -> list[str]:
    return [m["name"] for m in sorted((m for m in status["members"] if m["layers"]), key=lambda m: m["layers"][0])]


def test_the_swarm_forms_behind_nats_and_answers_as_one_process_does(swarm):
    # alice (a trunk that also asks) and dave (behind a NAT, asks only) get the one-process answer.
    # (status shows the asker's side of the plan as the newest ask went: dave's)
    for machine in ("alice", "dave"):
        assert swarm.swarmctl(machine, "ask", *GREEDY, PROMPT).stdout == swarm.inproc, machine
    status = swarm.wait("a complete plan", swarm.complete)
    members = {m["name"]: m for m in status["members"]}
    for name in TRUNKS:  # where the host sees each trunk: its router's public address, not 192.168.1.2
        assert members[name]["address"].startswith("198.51.100."), members[name]
    order = _order(status)
    links = {(row["source"], row["target"]): row for row in status["links"]}
    for a, b in zip(order, order[1:]):
        assert links[(a, b)]["path"] == _expected_path(a, b), (a, b, status["links"])
        assert links[(a, b)]["measured"], links[(a, b)]  # measured over that very path
    first, last = order[0], order[-1]
    assert links[("asker", first)]["path"] == _asker_row("dave", first), status["links"]
    assert links[(last, "asker")]["path"] == _asker_row("dave", last), status["links"]
    # The same, as a user reads it: every kind of path the plan's links take shows.
    out = swarm.swarmctl("host", "status").stdout
    rows = _links_table(out)
    for path in {row["path"].split(" (")[0] for row in status["links"]}:
        assert any(path in row for row in rows), (path, out)
    assert any("relayed via erin" in row for row in rows), out  # (carol and gwen, at least)


def test_status_shows_each_trunk_at_its_own_public_mapping(swarm):
    """carol and gwen sit behind one symmetric router, both on port 7471: the host sees each at
    its own mapping (the router's conntrack says which), marked as one of many once a punch with
    it failed; alice and bob, whose routers keep the port, show it unmarked (issue 29 item 11:
    status used to show both of carol's household at the router's 198.51.100.12:7471)."""

    def marked():
        status = swarm.status()
        addresses = {m["name"]: m["address"] for m in status["members"]} if status else {}
        return addresses if all(addresses.get(n, "").endswith(" (symmetric)") for n in ("carol", "gwen")) else None

    addresses = swarm.wait("carol's and gwen's addresses marked symmetric", marked)
    for name in ("alice", "bob", "carol", "gwen"):
        mapped = swarm.lab.mapped_port(name, SWARM_PORT, HOST_IP, HOST_PORT)
        mark = " (symmetric)" if NATS[ROUTER[name]] == "symmetric" else ""
        assert addresses[name] == f"{swarm.lab.public_ip(name)}:{mapped}{mark}", (name, addresses)
    assert addresses["carol"] != addresses["gwen"]
    assert addresses["erin"] == f"{swarm.lab.net['erin'].ip}:{SWARM_PORT}"


# `swarmctl top`'s poller on a member's machine: every trunk's stats, and the path to each.
TOP_POLLER = """
import asyncio, json
from swarmctl.node.home import SwarmHome
from swarmctl.monitor.poller import Monitor, MonitorConfig

async def main():
    monitor = Monitor(SwarmHome(), MonitorConfig(timeout_s=5))
    try:
        for _ in range(120):  # the trunk connections open in the background, a punch or a relay each
            poll = await monitor.poll_once()
            if poll.status is not None and len(poll.stats) == TRUNK_COUNT:
                break
            await asyncio.sleep(0.5)
        print(json.dumps({"stats": sorted(poll.stats), "paths": poll.paths, "errors": poll.stats_errors}))
    finally:
        monitor.close()

asyncio.run(main())
"""


def test_top_behind_a_nat_shows_every_trunk_with_its_path(swarm):
    """`swarmctl top` on dave's machine, behind a NAT: every trunk's stats, each reached as an ask
    reaches it (punched to the cone NATs, relayed to the symmetric one's household, direct to
    erin), mutual TLS end to end. Polling each trunk at the address it registered, as top did,
    reached none behind a NAT (issue 29 item 12)."""
    swarm.wait("a complete plan", swarm.complete)
    code = TOP_POLLER.replace("TRUNK_COUNT", str(len(TRUNKS)))
    r = subprocess.run(swarm.lab.net["dave"].command(sys.executable, "-c", code),
                       env=swarm.lab.net._env(swarm.homes["dave"]), capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen["stats"] == sorted(TRUNKS), seen
    assert seen["paths"] == {name: _expected_path("dave", name) for name in TRUNKS}, seen


def test_a_second_ask_goes_straight_to_the_relay_where_punching_failed(swarm):
    """frank asks from behind a symmetric NAT: punching to any trunk behind a NAT fails, and one
    of his first and last stage is behind one. His first ask punches on its clock (3 s) and is
    then relayed; his home remembers it, so the second asks for the relay at once and punches
    again only in the background (issue 29 item 3). Both answer as one process does."""
    swarm.wait("a complete plan", swarm.complete)

    def on_the_clock(stderr: str) -> list[str]:
        return [line for line in stderr.splitlines() if "hole punching with" in line and "background" not in line]

    first = swarm.swarmctl("frank", "ask", "-v", *GREEDY, PROMPT)
    assert first.stdout == swarm.inproc
    assert on_the_clock(first.stderr), first.stderr
    assert "(relayed via erin)" in first.stderr, first.stderr
    second = swarm.swarmctl("frank", "ask", "-v", *GREEDY, PROMPT)
    assert second.stdout == swarm.inproc
    assert on_the_clock(second.stderr) == [], second.stderr
    assert "relayed at once" in second.stderr and "(relayed via erin)" in second.stderr, second.stderr


def test_a_trunk_whose_router_renumbers_its_ports_comes_back(swarm):
    """A trunk's router "reboots": it forgets every mapping and gives new ones other ports. The
    punched link from the stage before it dies; that stage reaches it again (the host sees its new
    public port on its own connection, and the new punch gets through), and the asker's next
    request is answered as before. No process restarts."""
    order = _order(swarm.wait("a complete plan", swarm.complete))
    # The stage before a cone-NAT trunk punches to it; where the plan's order puts no trunk there
    # (the planner orders by measured speed), the trunk renumbered is behind a cone NAT: the first
    # or last stage where one is (the asker, dave, punches to it on every ask), else any (its
    # relayed links follow it).
    cone = [name for name in (order[0], order[-1], *order) if NATS.get(ROUTER.get(name, "")) == "cone"]
    sender, renumbered = next(((a, b) for a, b in zip(order, order[1:]) if _expected_path(a, b) == "punched"),
                              (None, cone[0]))
    reached = swarm.nodes[sender].log().count(f"reached {renumbered} (punched)") if sender else 0
    swarm.lab.renumber(renumbered)
    answer = swarm.swarmctl("dave", "ask", *GREEDY, PROMPT, timeout=240).stdout
    assert answer == swarm.inproc
    swarm.wait("a complete plan", swarm.complete)
    assert all(p.alive for p in swarm.nodes.values())
    if sender:
        assert swarm.nodes[sender].log().count(f"reached {renumbered} (punched)") > reached, swarm.logs()


# A member asking the host for relayed links as fast as it can, and a relay asked by a member.
GREEDY_MEMBER = """
import asyncio, json
from net import messages as m
from net.endpoint import Address, close, connect_member
from net.protocol import RequestOnlyHandler
from net.wire import decode_control
from swarmctl.node.home import SwarmHome
from swarmctl.reaching.host_addresses import connect_host

async def main():
    home = SwarmHome()
    config, creds = home.load_config(), home.credentials()
    conn = await connect_host(config, creds, RequestOnlyHandler(), addresses=config.host_addresses)
    replies = [decode_control((await conn.request(m.encode(m.Reach(member="carol", relay=True)))).body)
               for _ in range(12)]
    replies.append(decode_control((await conn.request(m.encode(m.Reach(member="nobody")))).body))
    await close(conn)
    relay = await connect_member(Address.parse("ERIN"), creds, "erin", RequestOnlyHandler())
    replies.append(decode_control((await relay.request(m.encode(m.AllocateRelay()))).body))
    await close(relay)
    print(json.dumps(replies))

asyncio.run(main())
"""


def test_a_member_gets_only_its_share_of_relays_and_cannot_drive_one_itself(swarm):
    status = swarm.wait("a complete plan", swarm.complete)
    erin = next(m["address"] for m in status["members"] if m["name"] == "erin")
    r = subprocess.run(swarm.lab.net["dave"].command(sys.executable, "-c", GREEDY_MEMBER.replace("ERIN", erin)),
                       env=swarm.lab.net._env(swarm.homes["dave"]), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    replies = json.loads(r.stdout)
    # (dave's own asks before may have used some of his share already)
    given = [x for x in replies[:12] if x["type"] == "route"]
    assert 1 <= len(given) <= 8 and replies[:len(given)] == given, replies
    assert all(x["kind"] == "relay" and x["via"] == "erin" for x in given), given
    refused = replies[len(given):12]
    assert all(x["type"] == "error" and "the most a member may" in x["message"] for x in refused), refused
    assert replies[12] == {"type": "error", "message": "'nobody' is not a trunk of this swarm now"}
    assert replies[13] == {"type": "error", "message": "only the host allocates relayed links"}
    # The others are not disturbed: alice (a trunk that also asks) gets her answer.
    assert swarm.swarmctl("alice", "ask", *GREEDY, PROMPT).stdout == swarm.inproc
    assert all(p.alive for p in swarm.nodes.values())


def test_killing_the_relay_moves_its_links_to_the_hosts_relay(swarm):
    """(alice asks here: dave used up his relayed links in the test before)"""
    swarm.wait("a complete plan", swarm.complete)
    swarm.nodes.pop("erin").popen.kill()  # SIGKILL: no goodbye
    swarm.trunks.discard("erin")
    status = swarm.wait("a complete plan without erin", swarm.complete)
    assert swarm.swarmctl("alice", "ask", *GREEDY, PROMPT, timeout=240).stdout == swarm.inproc
    status = swarm.wait("a complete plan without erin", swarm.complete)
    order = _order(status)
    links = {(row["source"], row["target"]): row["path"] for row in status["links"]}
    for a, b in zip(order, order[1:]):
        assert links[(a, b)] == _expected_path(a, b, relay="host"), (a, b, status["links"])
    assert links[("asker", order[0])] == _asker_row("alice", order[0], relay="host"), status["links"]
