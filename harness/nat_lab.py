"""Members behind home routers, as network namespaces: a "public" network (harness/netns.py's bridge)
with the host and one router per member on it, and behind each router a private network with the
member alone on it. Routers translate with iptables, as Linux home routers do:

    cone        MASQUERADE: keeps the member's source port when it is free, so every destination
                sees the same public ip:port (hole punching works);
    symmetric   MASQUERADE --random-fully: a new random port for each destination (it does not);
    open-input  as cone, but it drops only what it would forward unasked, not what comes to
                itself (FORWARD DROP, INPUT ACCEPT: common on Linux-based home routers).

Each router drops what comes in from the public side unasked, as home routers do: only answers to
what the member sent get through, and the public side has no route to the private networks, which
all use the same addresses (192.168.1.0/24, like most homes). cone and symmetric routers drop it
in INPUT and FORWARD; open-input ones only in FORWARD.

Dropping in INPUT matters for punching: a router that answers a probe that came before its own
member's first datagram (with an ICMP error) keeps a conntrack entry for it, and that entry takes
the member's port, so the member's own datagrams towards that peer leave from another one
(issue 29 item 4). net/punch.py opens its own mapping first with low-TTL probes; so that those die
before they reach another home, as they would on the internet, every router drops datagrams that
arrive on its public side with a TTL below WAN_HOPS (in the raw table, before conntrack sees them):
the homes are that many routers apart.

``behind={"gwen": "carol"}`` puts gwen on carol's home network, behind carol's router (at
192.168.1.3; the router's LAN is a bridge).

Sockets are made inside a namespace by a thread that enters it (setns), so one asyncio loop in
the test process drives every machine; the sockets stay in their namespace. Needs root,
iproute2 and iptables; conntrack-tools for ``renumber``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import threading
from pathlib import Path

from harness.netns import LabUnavailable, Machine, NetnsLab

PUBLIC = "198.51.100"  # TEST-NET-2: documentation addresses, never routed anywhere
HOST_IP = f"{PUBLIC}.1"
PRIVATE_ROUTER = "192.168.1.1"
PRIVATE_MEMBER = "192.168.1.2"
KINDS = ("cone", "symmetric", "open-input")
WAN_HOPS = 8  # routers between two homes: a datagram that arrives at a router with a lower TTL died on the way
CLONE_NEWNET = 0x40000000


def _run(*argv: str) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {r.stderr.strip()}")
    return r.stdout


class NatLab:
    """``members``: name → "cone", "symmetric" or "open-input" (a router of its own each);
    ``behind``: more members, each on another's home network. ``public``: machines on the public network beside
    the host, with no NAT (their address is ``lab.net[name].ip``). ``lab.public_ip(name)`` is the
    router's public address; ``lab.udp_socket(name, port)`` a UDP socket bound in that machine's
    namespace. ``wan_delay_ms``: each crossing of the public network takes that much longer (a
    userspace hub in place of the bridge, harness/wan_delay.py); 0, the default, keeps the bridge;
    ``uplink_mbit``: with a delay, each machine's (each home router's) uplink capped at that rate."""

    def __init__(self, members: dict[str, str], root: Path, public: tuple[str, ...] = (),
                 wan_delay_ms: float = 0, behind: dict[str, str] | None = None, uplink_mbit: float = 0) -> None:
        if os.geteuid() == 0 and shutil.which("iptables") is None:
            raise LabUnavailable("needs iptables (apt-get install -y iptables)")
        behind = dict(behind or {})
        for name, kind in members.items():
            if kind not in KINDS:
                raise ValueError(f"NAT kind {kind!r}: expected one of {', '.join(KINDS)}")
        for name, home in behind.items():
            if home not in members or name in members:
                raise ValueError(f"{name} behind {home}: {home} must be a member with a router of its own, {name} not")
        routers = {f"nat-{name}": f"{PUBLIC}.{10 + i}" for i, name in enumerate(members)}
        reachable = {name: f"{PUBLIC}.{2 + i}" for i, name in enumerate(public)}
        self.net = NetnsLab({"host": HOST_IP, **reachable, **routers}, root)
        self.kinds = dict(members)
        self.routers = {**{name: name for name in members}, **behind}  # member → whose router it is behind
        self.members: dict[str, Machine] = {}
        self.wan_delay = None
        try:
            if wan_delay_ms > 0:
                self._delay_public_network(wan_delay_ms, uplink_mbit)
            for name, kind in members.items():
                self._add_router(name, kind)
                self._add_member(name, name, PRIVATE_MEMBER, 0)
            lan_hosts: dict[str, int] = {}
            for name, home in behind.items():
                lan_hosts[home] = lan_hosts.get(home, 0) + 1
                self._add_member(name, home, f"192.168.1.{2 + lan_hosts[home]}", lan_hosts[home])
        except BaseException:
            self.close()
            raise

    def _add_router(self, name: str, kind: str) -> None:
        router = self.net[f"nat-{name}"].netns
        _run("ip", "-n", router, "link", "add", "lan", "type", "bridge")
        _run("ip", "-n", router, "addr", "add", f"{PRIVATE_ROUTER}/24", "dev", "lan")
        _run("ip", "-n", router, "link", "set", "lan", "up")
        _run("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        self._iptables(name, "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE",
                       *(["--random-fully"] if kind == "symmetric" else []))
        self._iptables(name, "-t", "raw", "-A", "PREROUTING", "-i", "eth0", "-m", "ttl", "--ttl-lt", str(WAN_HOPS),
                       "-j", "DROP")
        for chain in ("FORWARD",) if kind == "open-input" else ("INPUT", "FORWARD"):
            self._iptables(name, "-A", chain, "-i", "eth0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                           "-j", "ACCEPT")
            self._iptables(name, "-A", chain, "-i", "eth0", "-j", "DROP")

    def _add_member(self, name: str, home: str, ip: str, index: int) -> None:
        """``name`` at ``ip`` on ``home``'s network, cabled to its router's LAN bridge."""
        router = self.net[f"nat-{home}"].netns
        member = Machine(self.net, name, ip)
        _run("ip", "netns", "add", member.netns)
        self.net.created.append(member.netns)
        port = f"lan{index}"
        _run("ip", "-n", router, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", member.netns)
        _run("ip", "-n", router, "link", "set", port, "master", "lan", "up")
        for dev in ("eth0", "lo"):
            _run("ip", "-n", member.netns, "link", "set", dev, "up")
        _run("ip", "-n", member.netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", member.netns, "route", "add", "default", "via", PRIVATE_ROUTER)
        self.members[name] = member
        self.net.machines[name] = member  # so lab.net.swarmctl / lab.net.start run commands there

    def _delay_public_network(self, delay_ms: float, uplink_mbit: float = 0) -> None:
        """Every crossing of the public network takes ``delay_ms`` more (harness/wan_delay.py): the
        bridge lets go of its ports and a userspace hub forwards between them instead, each port's
        uplink capped at ``uplink_mbit`` (0: not capped)."""
        from harness.wan_delay import WanDelay, tx_checksum_off

        ports = [f"port{i}" for i in range(len(self.net.machines))]  # harness/netns.py's names, in order
        for machine in self.net.machines.values():
            in_netns(machine.netns, lambda: tx_checksum_off("eth0"))
        for port in ports:
            _run("ip", "-n", self.net.bridge_ns, "link", "set", port, "nomaster")
            _run("ip", "-n", self.net.bridge_ns, "link", "set", port, "promisc", "on", "up")
        self.wan_delay = WanDelay(self.net.bridge_ns, ports, delay_ms, self.net.root / "wan_delay.log",
                                  uplink_mbit=uplink_mbit)

    def _iptables(self, member: str, *args: str) -> None:
        _run("ip", "netns", "exec", self.net[f"nat-{self.routers[member]}"].netns, "iptables", *args)

    def public_ip(self, member: str) -> str:
        return self.net[f"nat-{self.routers[member]}"].ip

    def netns(self, machine: str) -> str:
        return self.members[machine].netns if machine in self.members else self.net[machine].netns

    def udp_socket(self, machine: str, port: int = 0, host: str = "0.0.0.0") -> socket.socket:
        """A UDP socket bound to host:port inside ``machine``'s namespace."""
        return in_netns(self.netns(machine), lambda: _bound_udp(host, port))

    def renumber(self, member: str, low: int = 40000, high: int = 40999) -> None:
        """The router "reboots": its mappings are forgotten and new ones take ports in low-high,
        so the member's public port changes."""
        kind = ["--random-fully"] if self.kinds[self.routers[member]] == "symmetric" else []
        self._iptables(member, "-t", "nat", "-R", "POSTROUTING", "1", "-o", "eth0", "-p", "udp", "-j", "MASQUERADE",
                       "--to-ports", f"{low}-{high}", *kind)  # a port range needs a protocol
        _run("ip", "netns", "exec", self.net[f"nat-{self.routers[member]}"].netns, "conntrack", "-F")

    def mapped_port(self, member: str, port: int, to_host: str, to_port: int) -> int | None:
        """The public port that ``member``'s router maps its ``port`` to towards to_host:to_port
        (the router's conntrack entry), or None if there is no such flow."""
        out = _run("ip", "netns", "exec", self.net[f"nat-{self.routers[member]}"].netns, "conntrack", "-L", "-p", "udp",
                   "--orig-src", self.members[member].ip, "--sport", str(port), "--orig-dst", to_host,
                   "--dport", str(to_port))
        for line in out.splitlines():
            if "dport=" in line:
                return int(line.rsplit("dport=", 1)[1].split()[0])
        return None

    def close(self) -> None:
        if self.wan_delay is not None:
            self.wan_delay.stop()
            self.wan_delay = None
        self.net.close()


def _bound_udp(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, port))
    return sock


def in_netns(netns: str, make):
    """Call ``make()`` in a thread that has entered the named network namespace: sockets it
    creates belong to that namespace for good. The thread ends after, so nothing else moves."""
    result: dict = {}

    def enter() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {netns}")
            finally:
                os.close(fd)
            result["value"] = make()
        except BaseException as e:  # handed to the caller
            result["error"] = e

    thread = threading.Thread(target=enter, name=f"netns {netns}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
