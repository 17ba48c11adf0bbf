"""The largest datagram a path carries, found by probing as DPLPMTUD does
(RFC 8899): never a fixed guess where the path can say.

Before a member opens a QUIC connection to another member's shared socket, it asks its kernel
what the first hop carries (the outgoing interface's MTU, or a smaller path MTU it learned), then
sends padded probes of that size, with the Don't Fragment bit, that the peer's socket answers with
a few bytes. The largest size answered is the connection's datagram size; a path that drops
large datagrams (a tunnel, a smaller MTU further on) just does not answer, and the next smaller
candidate is tried, down to the Internet-safe default, which needs no probe. Loopback keeps its
fixed large size. A probe costs one round trip when it is answered and ``PROBE_WAIT_S`` per size
when it is not; the answer is smaller than the probe, so it cannot amplify.

Anyone can send a socket a datagram with someone else's source address, so a size probe is
answered only if it is at least ``MIN_PROBE`` bytes (every probe we send is larger: a smaller one is
not ours) and within ``AnswerLimit``'s rates, per source address and for the socket as a whole: the
socket cannot be made to send a stranger more than a trickle of 14-byte answers. A prober whose
probes go unanswered uses the default size, as on a path that drops large datagrams.

What this does not do (yet): probe again during a connection (a route that later drops large
datagrams stalls the connection until it is replaced, and the new one probes again), or size the
datagrams the accepting side sends (aioquic fixes a server's size for all its connections).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass

from .tls import DEFAULT_DATAGRAM_SIZE, LOOPBACK_DATAGRAM_SIZE

SIZE_PROBE = b"\x00swS"  # + nonce (8) + padding to the size probed
SIZE_ANSWER = b"\x00swA"  # + nonce (8) + the size received (u16)
NONCE = 8
PROBE_WAIT_S = 0.25  # per size: two probes, then the next smaller size
PROBE_TRIES = 2
MAX_DATAGRAM = LOOPBACK_DATAGRAM_SIZE  # the largest we use anywhere (aioquic allocates per datagram)
ETHERNET_MTU = 1500
# Probes smaller than this are not answered: candidates() probes only sizes above the default.
MIN_PROBE = DEFAULT_DATAGRAM_SIZE
# Answers a socket sends, per source address and in all (token buckets: a burst, then a rate). A
# member dialing probes a peer at most 2 sizes x PROBE_TRIES times per connection it opens.
ANSWER_BURST_PER_ADDRESS, ANSWERS_PER_S_PER_ADDRESS = 16, 4.0
ANSWER_BURST, ANSWERS_PER_S = 64, 32.0

# Linux's constants (<linux/in.h>, <linux/in6.h>); Python's socket module lacks them.
IP_MTU_DISCOVER, IP_MTU, IPV6_MTU_DISCOVER, IPV6_MTU = 10, 14, 23, 24
PMTUDISC_PROBE = 3  # set Don't Fragment, and do not cap at the kernel's path MTU (we are probing it)
PMTUDISC_WANT = 1  # the default: Don't Fragment where the path MTU allows, fragment locally above it


def headers(v6: bool) -> int:
    return (40 if v6 else 20) + 8  # IP and UDP


def kernel_path_mtu(host: str, port: int) -> int | None:
    """What the kernel knows of the path to ``host`` (the outgoing interface's MTU, or less if an
    ICMP message taught it a smaller one); None where it cannot say (not Linux, no route)."""
    if sys.platform != "linux":
        return None
    v6 = ":" in host
    sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.connect((host, port))
        return sock.getsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP, IPV6_MTU if v6 else IP_MTU)
    except OSError:
        return None
    finally:
        sock.close()


def candidates(host: str, port: int) -> list[int]:
    """Datagram sizes worth probing towards ``host``, largest first; empty where none is needed
    (loopback, or a first hop no larger than the default)."""
    try:
        if ipaddress.ip_address(host).is_loopback or os.environ.get("SWARMCTL_MAX_DATAGRAM", "").isdigit():
            return []  # (loopback's size is fixed; the override is the user's word for every path)
    except ValueError:
        return []
    mtu = kernel_path_mtu(host, port)
    if mtu is None:
        return []
    v6 = ":" in host
    first, ethernet = min(mtu - headers(v6), MAX_DATAGRAM), ETHERNET_MTU - headers(v6)
    # then Ethernet's, where the first hop is larger (a jumbo LAN may reach the Internet behind it)
    sizes = [first, ethernet] if first > ethernet else [first]
    return [s for s in sizes if s > DEFAULT_DATAGRAM_SIZE]


def probe(nonce: bytes, size: int) -> bytes:
    return SIZE_PROBE + nonce + bytes(size - len(SIZE_PROBE) - NONCE)


def answer(data: bytes) -> bytes:
    """What a shared socket sends back for a size probe: its nonce and the size that arrived."""
    return SIZE_ANSWER + data[len(SIZE_PROBE):len(SIZE_PROBE) + NONCE] + struct.pack("!H", min(len(data), 65535))


def worth_answering(data: bytes) -> bool:
    """Whether a size probe is big enough to be one of ours (the answer is then always smaller)."""
    return len(data) >= MIN_PROBE


@dataclass
class _Bucket:
    tokens: float
    at: float  # when ``tokens`` was last brought up to date

    def level(self, now: float, burst: float, rate: float) -> float:
        return min(burst, self.tokens + max(0.0, now - self.at) * rate)


class AnswerLimit:
    """How many size probes a socket answers: token buckets per source address and for all
    addresses together, so spoofed probes cannot turn the socket into a reflector. Pure
    bookkeeping; ``now`` is passed in (monotonic seconds)."""

    MAX_ADDRESSES = 1024  # buckets kept before the full (idle) ones are forgotten

    def __init__(self, *, burst_per_address: float = ANSWER_BURST_PER_ADDRESS,
                 per_address_per_s: float = ANSWERS_PER_S_PER_ADDRESS, burst: float = ANSWER_BURST,
                 per_s: float = ANSWERS_PER_S) -> None:
        self.burst_per_address, self.per_address_per_s = burst_per_address, per_address_per_s
        self.burst, self.per_s = burst, per_s
        self._all = _Bucket(burst, float("-inf"))  # (full whenever the first probe comes)
        self._addresses: dict[str, _Bucket] = {}
        self.refused = 0

    def allow(self, host: str, now: float) -> bool:
        """Take one answer for a probe from ``host``; False (and nothing taken) over either rate."""
        mine = self._addresses.get(host)
        own = mine.level(now, self.burst_per_address, self.per_address_per_s) if mine else self.burst_per_address
        shared = self._all.level(now, self.burst, self.per_s)
        if own < 1 or shared < 1:
            self.refused += 1
            return False
        self._all = _Bucket(shared - 1, now)
        if len(self._addresses) >= self.MAX_ADDRESSES and host not in self._addresses:
            self._forget_idle(now)
        self._addresses[host] = _Bucket(own - 1, now)
        return True

    def _forget_idle(self, now: float) -> None:
        """Drop the buckets that have refilled (a fresh one is the same); the shared rate bounds
        how many others can exist, but keep the table bounded regardless."""
        full = [h for h, b in self._addresses.items()
                if b.level(now, self.burst_per_address, self.per_address_per_s) >= self.burst_per_address]
        for host in full:
            del self._addresses[host]
        while len(self._addresses) >= self.MAX_ADDRESSES:  # (not reached while the shared rate holds)
            del self._addresses[next(iter(self._addresses))]


def read_answer(body: bytes, nonce: bytes) -> int | None:
    """The size an answer (without its tag) confirms, if it answers ``nonce``."""
    if len(body) != NONCE + 2 or body[:NONCE] != nonce:
        return None
    return struct.unpack("!H", body[NONCE:])[0]


def set_probing(sock: socket.socket, on: bool) -> bool:
    """Don't Fragment on every datagram of ``sock`` while probing (and the kernel's default after);
    False where the platform cannot (then probes could arrive fragmented: no probing)."""
    if sys.platform != "linux":
        return False
    v6 = sock.family == socket.AF_INET6
    try:
        sock.setsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP, IPV6_MTU_DISCOVER if v6 else IP_MTU_DISCOVER,
                        PMTUDISC_PROBE if on else PMTUDISC_WANT)
        if v6 and sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0:  # (v4 peers of a dual socket)
            sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, PMTUDISC_PROBE if on else PMTUDISC_WANT)
    except OSError:
        return False
    return True
