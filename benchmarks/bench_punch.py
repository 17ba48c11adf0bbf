"""Hole punching success and time, for every pair of NAT kinds in the lab (issue 17).

    sudo .venv/bin/python -m benchmarks.bench_punch [--trials 10] [--skew 0.1] [--no-opening]

Machines as in harness/nat_lab.py: a public network with the host (the rendezvous: an observed-
address echo) and one public member, members behind port-preserving ("cone", iptables
MASQUERADE), symmetric (MASQUERADE --random-fully) and open-input (cone, but only forwarded
datagrams are filtered) NATs. For each pair of kinds: both ends observe their public address at
the host, are introduced, and punch (net/punch.py) from fresh sockets, the second end ``--skew``
seconds after the first (its ticket came later), in both orders; the row says how many trials
opened a path both ways and how long that took (median and worst, from the first end's start).
``--no-opening`` sends full-TTL probes from the start (as before issue 29 item 4). Prints JSON;
needs root (network namespaces, iptables); skips with one line otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from net.endpoint import Address
from net.punch import OPENING_TTL, PunchFailed, open_shared, punch
from net.rendezvous import ObservedAddressEcho, introduce, observe
from harness.nat_lab import HOST_IP, NatLab
from harness.netns import LabUnavailable

ECHO_PORT = 3478
TIMEOUT_S = 3.0  # net.punch.PUNCH_TIMEOUT: what a member waits before asking for a relay
MEMBERS = {"cone1": "cone", "cone2": "cone", "sym1": "symmetric", "sym2": "symmetric", "open1": "open-input",
           "open2": "open-input"}
PUBLIC = ("pub1",)
KIND = {**MEMBERS, **{name: "public" for name in PUBLIC}}


async def _trial(lab: NatLab, a: str, b: str, port: int, skew: float, options: dict) -> float | None:
    """Seconds until both ends punched, or None if either failed."""
    sa = await open_shared(lab.udp_socket(a, port))
    sb = await open_shared(lab.udp_socket(b, port))
    try:
        pa, pb = await asyncio.gather(observe(sa, Address(HOST_IP, ECHO_PORT)), observe(sb, Address(HOST_IP, ECHO_PORT)))
        ta, tb = introduce(pa, pb)

        async def later():
            await asyncio.sleep(skew)
            return await punch(sb, tb, timeout=TIMEOUT_S, **options)

        start = time.perf_counter()
        results = await asyncio.gather(punch(sa, ta, timeout=TIMEOUT_S, **options), later(), return_exceptions=True)
        took = time.perf_counter() - start
        if any(isinstance(r, PunchFailed) for r in results):
            return None
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return took
    finally:
        sa.close()
        sb.close()


async def _run(lab: NatLab, trials: int, skew: float, options: dict) -> list[dict]:
    echo = ObservedAddressEcho()
    await echo.start(lab.udp_socket("host", ECHO_PORT))
    rows = []
    try:
        names = [*MEMBERS, *PUBLIC]
        pairs = [pair for a, b in itertools.combinations(names, 2) for pair in ((a, b), (b, a))]
        seen_kinds = set()
        port = 20000
        for a, b in pairs:
            kinds = (KIND[a], KIND[b])  # the first starts first
            if kinds in seen_kinds:
                continue
            seen_kinds.add(kinds)
            times = []
            for _ in range(trials):
                port += 1  # fresh ports: no mapping left over from the trial before
                times.append(await _trial(lab, a, b, port, skew, options))
            ok = [t for t in times if t is not None]
            rows.append({"pair": f"{kinds[0]} → {kinds[1]}", "succeeded": len(ok), "trials": trials,
                         "median_s": round(statistics.median(ok), 3) if ok else None,
                         "worst_s": round(max(ok), 3) if ok else None})
    finally:
        echo.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--skew", type=float, default=0.1, help="seconds between the two ends' starts")
    parser.add_argument("--no-opening", action="store_true", help="no low-TTL opening probes")
    args = parser.parse_args()
    options = {"opening_ttl": None} if args.no_opening else {}
    if shutil.which("iptables") is None:
        print(json.dumps({"skipped": "needs iptables"}))
        return 0
    root = Path(tempfile.mkdtemp(prefix="bench-punch-"))
    try:
        lab = NatLab(MEMBERS, root, public=PUBLIC)
    except LabUnavailable as e:
        print(json.dumps({"skipped": f"needs network namespaces: {e}"}))
        return 0
    try:
        rows = asyncio.run(_run(lab, args.trials, args.skew, options))
    finally:
        lab.close()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"benchmark": "punch", "timeout_s": TIMEOUT_S, "skew_s": args.skew,
                      "opening_ttl": None if args.no_opening else OPENING_TTL, "rows": rows}, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
