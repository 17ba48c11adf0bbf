"""A newly joined trunk fetching its slice across home routers, from (a) the host alone, (b) the host
and two members holding the layers, (c) a web mirror in the lab and the host; prints JSON side by
side (issue 44, "Measured, not assumed").

    sudo .venv/bin/python benchmarks/bench_fetch_sources.py [--layers-per-trunk 8] [--out FILE]

Needs root (network namespaces, iptables): harness/nat_lab.py builds the machines and
harness/wan_delay.py carries every frame that crosses the "public" network, --delay-ms later
(20 ms: a round trip between two homes is 40 ms), each machine's uplink capped at --uplink-mbit
(20 Mbit/s). Downlinks are not capped (faster than any uplink: the hub paces only what a port
sends). Where namespaces are not permitted it prints one line and exits 0.

The machines: alice, bob and newbie each behind a port-preserving NAT of their own (links
punched), the host on the public network beside a web server ("mirror", for c). The model is a
tiny llama GGUF written here (random F16 weights, harness/tiny_models.py) whose trunk layers
split in three equal slices of --layers-per-trunk layers each (121.6 MB a layer): the host, alice
and bob have the file; newbie has none. Each scenario is a fresh lab and swarm (`init --objective
even --head-layers 1`): alice and bob serve two stages, then newbie starts, the plan gives each
trunk a third, and newbie fetches its third. alice and bob run with --upload-mbit 100 in (b) (the
20 Mbit/s uplink is then the limit) and 0 in (a) and (c) (they hold the layers but serve none, so
the plan and the slice are the same in all three); in (c) `init --model-url` names the mirror.

Measured from newbie's log, polled every 0.1 s: the fetch starting (the manifest in, its sources
named; connecting to the members is part of the fetch), every chunk in ("fetched layers ...
from the ..."), and "serving layers" (its layers checked and loaded, the plan's stage served),
each from the moment its process started. rate = slice bytes / (all in - start); ideal = the smaller
of newbie's downlink (not capped) and the summed uplinks of the sources it fetched from; the goal
for (b) is a ratio of at least 0.8. Link rates count every byte the hub paces (QUIC, UDP, IP and
Ethernet headers too), so even a perfect fetch is a few percent under its ideal in payload.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json, process_cpu_s  # noqa: E402
from benchmarks.lab_swarm import BenchError, LabSwarm  # noqa: E402
from harness.nat_lab import HOST_IP, NatLab  # noqa: E402
from harness.netns import LabUnavailable  # noqa: E402

MIRROR_PORT = 8080
LAYER_MB = 121.6  # an F16 layer of the model below (n_embd 2048, n_ff 8192, 16 heads, 4 KV heads)
SCENARIOS = {
    "a_host_only": {"members_serve": False, "mirror": False},
    "b_host_and_two_members": {"members_serve": True, "mirror": False},
    "c_mirror_and_host": {"members_serve": False, "mirror": True},
}
NAMES = ("alice", "bob", "newbie")


def write_model(path: Path, layers_per_trunk: int) -> Path:
    from harness.tiny_models import TinyConfig, write_tiny_model
    from swarmctl.model_files.models import default_model_path

    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = TinyConfig(n_layer=2 + 3 * layers_per_trunk, n_embd=2048, n_head=16, n_head_kv=4, n_ff=8192,
                     qtype="F16", seed=44)
    return write_tiny_model(path, cfg, default_model_path())


class Timeline:
    """When newbie's log first shows each marker, in seconds since its process started."""

    # (the shares line marks every chunk in: swarmctl/model_files/distribution.py logs it before the final check)
    MARKS = {"pull_start": ("fetching layers [", "not on disk yet) from"), "all_in": ("fetched layers [", "% from the"),
             "serving": ("serving layers [",)}

    def __init__(self, log_path: Path, started: float, pids: dict[str, int]) -> None:
        self.log_path, self.started, self.pids = log_path, started, pids
        self.at: dict[str, float] = {}
        self.lines: dict[str, str] = {}
        self.cpu: dict[str, dict[str, float]] = {}  # mark → process → CPU seconds so far (is the box the limit?)

    def poll(self) -> None:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        now = time.monotonic() - self.started
        for mark, needles in self.MARKS.items():
            if mark not in self.at:
                line = next((ln for ln in text.splitlines() if all(n in ln for n in needles)), None)
                if line is not None:
                    self.at[mark], self.lines[mark] = now, line
                    self.cpu[mark] = {name: process_cpu_s(pid) for name, pid in self.pids.items()}


def shares_of(line: str) -> dict[str, int]:
    """"fetched layers [a, b) (N MB): 60% from the member alice; 40% from the host" → shares."""
    tail = line.split("MB): ", 1)[1]
    return {part.split(" from the ")[1].strip(): int(part.split("%")[0]) for part in tail.split("; ")}


def run_scenario(name: str, spec: dict, args, model: Path, root: Path, hash_cache: Path) -> dict:
    lab = NatLab({n: "cone" for n in NAMES}, root, public=("mirror",) if spec["mirror"] else (),
                 wan_delay_ms=args.delay_ms, uplink_mbit=args.uplink_mbit)
    mirror = None
    try:
        swarm = LabSwarm(lab, root, NAMES)
        extra = ["--model-url", f"http://{lab.net['mirror'].ip}:{MIRROR_PORT}/"] if spec["mirror"] else []
        if spec["mirror"]:
            mirror = subprocess.Popen(lab.net["mirror"].command(
                sys.executable, str(Path(__file__).resolve()), "--serve-mirror", str(model.parent)),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(root / "mirror.log", "wb"))
        swarm.swarmctl("host", "init", "--advertise", f"{HOST_IP}:7470", "--objective", "even", "--model", str(model),
                       "--head-layers", "1", *extra)
        if hash_cache.exists():  # the host's hashes of the same file, from the first scenario (no re-read)
            shutil.copytree(hash_cache, swarm.homes["host"] / hash_cache.name)
        swarm.nodes["host"] = lab.net.start("host", swarm.homes["host"], "run", "--role", "host")
        swarm.wait_for("the host to answer status", lambda status: True, timeout=300)
        for member in NAMES:
            code = swarm.swarmctl("host", "invite", "--role", "trunk").stdout.strip()
            has = str(model) if member != "newbie" else str(root / "no-model-here.gguf")
            swarm.swarmctl(member, "join", code, "--name", member, "--model", has)
        upload = "100" if spec["members_serve"] else "0"
        for member in ("alice", "bob"):
            swarm.nodes[member] = lab.net.start(member, swarm.homes[member], "run", "--role", "trunk", "--memory",
                                                "12G", "--threads", "1", "--upload-mbit", upload)
        swarm.wait_for("alice and bob serving", lambda s: s["complete"] and sum(1 for m in s["members"] if m["layers"]
                                                                               and m["health"] == "ready") == 2,
                       timeout=600)
        started = time.monotonic()
        swarm.nodes["newbie"] = lab.net.start("newbie", swarm.homes["newbie"], "run", "--role", "trunk", "--memory",
                                              "12G", "--threads", "1", "--upload-mbit", "0")
        pids = {n: swarm.nodes[n].popen.pid for n in ("host", "alice", "bob", "newbie")}
        if lab.wan_delay is not None:
            pids["wan_delay_hub"] = lab.wan_delay.popen.pid
        if mirror is not None:
            pids["mirror"] = mirror.pid
        if args.renice is not None:  # the fetcher and the hub ahead of the box's other work (a shared box)
            for pid in (pids["newbie"], pids.get("wan_delay_hub")):
                if pid is not None:
                    os.setpriority(os.PRIO_PROCESS, pid, args.renice)
        timeline = Timeline(root / "newbie.log", started, pids)
        deadline = started + args.timeout
        while "serving" not in timeline.at:
            if time.monotonic() > deadline:
                raise BenchError(f"{name}: newbie not serving after {args.timeout:.0f} s: "
                                 f"{swarm.nodes['newbie'].log()[-600:]}")
            if not swarm.nodes["newbie"].alive:
                raise BenchError(f"{name}: newbie exited: {swarm.nodes['newbie'].log()[-600:]}")
            time.sleep(0.1)
            timeline.poll()
        if not hash_cache.exists() and (swarm.homes["host"] / hash_cache.name).exists():
            shutil.copytree(swarm.homes["host"] / hash_cache.name, hash_cache)
        line = timeline.lines["all_in"]
        slice_mb = float(line.split("(", 1)[1].split(" MB)", 1)[0])
        shares = shares_of(line)
        fetch_s = timeline.at["all_in"] - timeline.at["pull_start"]
        rate = slice_mb / fetch_s
        sources = [s for s in shares if shares[s] > 0]
        ideal = len(sources) * args.uplink_mbit / 8  # MB/s: the downlink is not capped
        holders = [ln.split("for newbie: ", 1)[1] for ln in swarm.nodes["host"].log().splitlines()
                   if "members holding" in ln and "for newbie" in ln]
        own = [ln.split("swarmctl.trunk: ", 1)[-1] for ln in swarm.nodes["newbie"].log().splitlines()
               if "fetched layers [" in ln and "MB/s)" in ln]  # the trunk's own progress line, where it logs one
        return {"slice_mb": slice_mb, "newbie_says": own[:1], "layers": line.split("fetched layers ", 1)[1].split(" (", 1)[0],
                "sources": sources, "shares_percent": shares, "holders_listed_by_host": holders[:1],
                "pull_start_s": round(timeline.at["pull_start"], 2), "all_in_s": round(timeline.at["all_in"], 2),
                "serving_s": round(timeline.at["serving"], 2), "fetch_s": round(fetch_s, 2),
                "rate_mb_s": round(rate, 3), "ideal_mb_s": round(ideal, 3), "ratio_to_ideal": round(rate / ideal, 3),
                # share of one core each process used during the fetch (this box has os.cpu_count() cores, shared)
                "cpu_core_share_during_fetch": {n: round((timeline.cpu["all_in"][n] - timeline.cpu["pull_start"][n])
                                                         / fetch_s, 2) for n in pids},
                "load_average_after": [round(x, 2) for x in os.getloadavg()]}
    finally:
        if mirror is not None:
            mirror.terminate()
            mirror.wait(10)
        lab.close()


def serve_mirror(folder: Path) -> int:
    """A static web server with Range (aiohttp's FileResponse) on MIRROR_PORT, until killed."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        path = folder / request.match_info["name"]
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    app = web.Application()
    app.router.add_get("/{name}", handle)
    web.run_app(app, host="0.0.0.0", port=MIRROR_PORT, print=None)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers-per-trunk", type=int, default=8, help=f"the slice's layers ({LAYER_MB} MB each)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay per public-network crossing")
    p.add_argument("--uplink-mbit", type=float, default=20.0, help="each machine's uplink")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of " + ",".join(SCENARIOS))
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds newbie may take to serve, per scenario")
    p.add_argument("--model", type=Path, help="reuse a model this benchmark wrote before (same --layers-per-trunk)")
    p.add_argument("--renice", type=int, metavar="NICE", help="run newbie and the lab's hub at this nice value "
                   "(e.g. -10: on a box shared with other work, whether their CPU share is the limit)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--serve-mirror", type=Path, help=argparse.SUPPRESS)  # (the mirror machine's web server)
    args = p.parse_args()
    if args.serve_mirror:
        return serve_mirror(args.serve_mirror)
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    if not scenarios or any(x not in SCENARIOS for x in scenarios) or args.layers_per_trunk < 1 \
            or args.uplink_mbit <= 0 or args.delay_ms < 0:
        print(f"bench_fetch_sources: scenarios from {', '.join(SCENARIOS)}; --layers-per-trunk >= 1, "
              "--uplink-mbit > 0, --delay-ms >= 0", file=sys.stderr)
        return 2
    result: dict = {"delay_ms_one_way": args.delay_ms, "uplink_mbit": args.uplink_mbit, "downlink": "not capped",
                    "layers_per_trunk": args.layers_per_trunk, "layer_mb": LAYER_MB, "renice": args.renice,
                    "measured": "rate = slice MB / (every chunk in - fetch started), newbie's log polled every "
                                "0.1 s; ideal = sources x uplink (the downlink is not capped)",
                    "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="bench-fetch-sources-") as tmp:
        model = args.model or write_model(Path(tmp) / "model" / "fetch-bench.gguf", args.layers_per_trunk)
        hash_cache = Path(tmp) / "model-hashes"
        try:
            for name in scenarios:
                root = Path(tmp) / name
                root.mkdir()
                result["scenarios"][name] = run_scenario(name, SCENARIOS[name], args, model, root, hash_cache)
                hub_log = root / "wan_delay.log"
                if hub_log.exists():
                    result["scenarios"][name]["wan_delay_hub"] = hub_log.read_text().strip()[-300:]
                print(f"bench_fetch_sources: {name}: {result['scenarios'][name]['rate_mb_s']} MB/s",
                      file=sys.stderr, flush=True)
        except LabUnavailable as e:
            print(f"bench_fetch_sources: skipped: {e}")
            return 0
        except BenchError as e:
            print(f"bench_fetch_sources: {e}", file=sys.stderr)
            return 1
    got = result["scenarios"]
    if "a_host_only" in got:
        for other in ("b_host_and_two_members", "c_mirror_and_host"):
            if other in got:
                result[f"{other}_over_a"] = round(got[other]["rate_mb_s"] / got["a_host_only"]["rate_mb_s"], 3)
    result["goal"] = "b's ratio_to_ideal >= 0.8"
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
