"""A WAN delay for the namespace labs, in userspace (this kernel has no ``tc netem``).

The lab's "public" network is a bridge namespace with one veth port per machine (harness/netns.py).
With a delay, the kernel bridge lets go of the ports and this program, run inside the bridge
namespace, takes its place: it reads every Ethernet frame that arrives on a port with an
AF_PACKET raw socket, holds it for the one-way delay and then sends it out of the port that
leads to its destination MAC (learnt from the source MACs seen so far), or out of every other
port for broadcasts (ARP) and destinations not learnt yet. One crossing of the public network =
one delay, so a round trip between two machines on it takes twice the delay.

Bounded: at most ``--queue`` frames wait; a frame that arrives to a full queue is dropped, as a
router's full buffer drops it. The delay is the same for every frame, so frames leave in the
order they came (a FIFO, no reordering). With ``--uplink-mbit`` each port is also an uplink of
that rate: a frame that arrives from it starts its delay once the frames before it from the same
port have gone out at that rate (a deep modem buffer: paced, not dropped).

Frames are copied as bytes, so their checksums must be complete: a veth normally leaves TCP/UDP
checksums to "hardware" (CHECKSUM_PARTIAL), which a raw socket would read half done. The lab
turns transmit checksumming off on each machine's side of the veth (``tx_checksum_off``), so the
sender's kernel fills them in.

    ip netns exec BRIDGE_NS python harness/wan_delay.py --delay-ms 20 port0 port1 ...

prints ``ready`` once every port is open, forwards until SIGTERM/SIGINT, then prints its counters
to stderr. ``WanDelay`` starts and stops it from a lab.
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import heapq
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23  # Linux 4.20+
PACKET_OUTGOING = 4
SIOCETHTOOL = 0x8946
ETHTOOL_STXCSUM = 0x17
MAX_FRAME = 65536


def tx_checksum_off(ifname: str) -> None:
    """``ethtool -K IFNAME tx off`` without ethtool, for the calling thread's namespace."""
    import ctypes

    value = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_STXCSUM, 0))
    ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(value)).ljust(40, b"\0")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifreq)


class Hub:
    def __init__(self, ports: list[str], delay_s: float, queue_limit: int, uplink_bps: float = 0.0) -> None:
        self.ports, self.delay_s, self.queue_limit, self.uplink_bps = ports, delay_s, queue_limit, uplink_bps
        self.uplink_free = [0.0] * len(ports)  # when each port's uplink has sent what it took so far
        self.socks: list[socket.socket] = []
        for name in ports:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            try:
                s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
            except OSError:
                pass  # older kernels: outgoing frames are filtered by their packet type below
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)
            s.bind((name, 0))
            s.setblocking(False)
            self.socks.append(s)
        self.by_fd = {s.fileno(): i for i, s in enumerate(self.socks)}
        self.where: dict[bytes, int] = {}  # MAC → port it was last seen on
        self.queue: list[tuple[float, int, int, bytes]] = []  # a heap: (due, arrival number, port, frame)
        self.arrivals = 0
        self.counts = collections.Counter()
        self.stop_r, self.stop_w = os.pipe()
        os.set_blocking(self.stop_w, False)

    def stop(self, *_) -> None:
        try:
            os.write(self.stop_w, b"x")
        except OSError:
            pass

    def _receive(self, i: int) -> None:
        sock = self.socks[i]
        while True:
            try:
                frame, addr = sock.recvfrom(MAX_FRAME)
            except (BlockingIOError, InterruptedError):
                return
            if addr[2] == PACKET_OUTGOING or len(frame) < 14:
                continue
            self.where[frame[6:12]] = i
            if len(self.queue) >= self.queue_limit:
                self.counts["dropped_queue_full"] += 1
                continue
            sent = time.monotonic()
            if self.uplink_bps:  # it leaves the uplink after the frames ahead of it, at its rate
                sent = self.uplink_free[i] = max(sent, self.uplink_free[i]) + len(frame) * 8 / self.uplink_bps
            self.arrivals += 1
            heapq.heappush(self.queue, (sent + self.delay_s, self.arrivals, i, frame))
            self.counts["received"] += 1

    def _send_due(self) -> None:
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            _, _, came_in, frame = heapq.heappop(self.queue)
            dst = frame[0:6]
            out = self.where.get(dst) if not dst[0] & 1 else None
            targets = [out] if out is not None else [j for j in range(len(self.socks)) if j != came_in]
            for j in targets:
                if j == came_in:
                    continue
                try:
                    self.socks[j].send(frame)
                    self.counts["sent"] += 1
                except OSError:  # full send buffer, or the port went down with the lab
                    self.counts["dropped_send"] += 1

    def run(self) -> None:
        poller = select.epoll()
        for s in self.socks:
            poller.register(s.fileno(), select.EPOLLIN)
        poller.register(self.stop_r, select.EPOLLIN)
        while True:
            timeout = max(0.0, self.queue[0][0] - time.monotonic()) if self.queue else -1
            for fd, _ in poller.poll(timeout):
                if fd == self.stop_r:
                    return
                self._receive(self.by_fd[fd])
            self._send_due()

    def close(self) -> None:
        for s in self.socks:
            s.close()


class WanDelay:
    """The hub as a child process entered into ``netns`` (via ``ip netns exec``); ``stop()`` ends it."""

    def __init__(self, netns: str, ports: list[str], delay_ms: float, log_path: Path,
                 queue_limit: int = 4096, uplink_mbit: float = 0.0) -> None:
        from swarmctl.node.local_swarm import _die_with_parent

        argv = ["ip", "netns", "exec", netns, sys.executable, str(Path(__file__).resolve()),
                "--delay-ms", str(delay_ms), "--queue", str(queue_limit), "--uplink-mbit", str(uplink_mbit), *ports]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                          preexec_fn=_die_with_parent)
        ready, _, _ = select.select([self.popen.stdout], [], [], 15)
        line = self.popen.stdout.readline().strip() if ready else b""
        if line != b"ready":
            self.stop()
            raise RuntimeError(f"the WAN delay did not start: {log_path.read_text(errors='replace').strip()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        if self.popen.stdout:
            self.popen.stdout.close()


def main() -> int:
    p = argparse.ArgumentParser(description="forward Ethernet frames between ports, each held for a delay")
    p.add_argument("--delay-ms", type=float, required=True, help="one-way delay per crossing")
    p.add_argument("--queue", type=int, default=4096, help="frames that may wait at once; more are dropped")
    p.add_argument("--uplink-mbit", type=float, default=0.0, help="each port's uplink rate (0: no cap)")
    p.add_argument("ports", nargs="+")
    args = p.parse_args()
    if args.delay_ms < 0 or args.queue < 1 or args.uplink_mbit < 0:
        print("wan_delay: --delay-ms and --uplink-mbit must be 0 or more and --queue at least 1", file=sys.stderr)
        return 2
    try:
        hub = Hub(args.ports, args.delay_ms / 1e3, args.queue, args.uplink_mbit * 1e6)
    except OSError as e:
        print(f"wan_delay: cannot open the ports: {e}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, hub.stop)
    signal.signal(signal.SIGINT, hub.stop)
    print("ready", flush=True)
    try:
        hub.run()
    finally:
        hub.close()
        print(f"wan_delay: {dict(hub.counts)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
