"""kill -9 of an expert node while an answer is under way, across home routers; prints JSON.

    sudo .venv/bin/python benchmarks/bench_expert_kill.py [--delay-ms 20] [--repeats 3] [--out FILE]

Issue 29 item 2: a stage waited for a dead expert node's answer until QUIC's idle timeout; now
an expert call has a deadline from the node's recent calls and a ping tells slow from dead
(swarmctl/trunk/call_deadline.py), and the request is replayed as for a dead stage.

The lab (harness/nat_lab.py, --delay-ms per crossing of the public network, so a round trip between
homes is twice that): the host on the public network; stages alice and bob, expert nodes carol
and erin, each behind a port-preserving NAT of its own; dave asks from behind another. A tiny
random-weight MoE GGUF (harness/tiny_models.py, --model), `init --expert-nodes 2 --head-layers 1`.
Each repeat is a fresh swarm: dave runs `swarmctl ask --raw --temperature 0 --max-tokens N`;
once --kill-after bytes of the answer have streamed, carol (an expert node) is killed with
SIGKILL. Measured: seconds from the kill to the end of the answer, the longest pause in the
answer's stream after the kill (the recovery), and whether the answer equals the one-process
answer (`--transport inproc`). Where namespaces are not permitted it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from benchmarks.lab_swarm import BenchError, LabSwarm  # noqa: E402
from harness.nat_lab import HOST_IP, NatLab  # noqa: E402
from harness.netns import LabUnavailable  # noqa: E402

PROMPT = "Once upon a time"
STAGES, EXPERT_NODES, ASKER, VICTIM = ("alice", "bob"), ("carol", "erin"), "dave", "carol"
NATS = {name: "cone" for name in (*STAGES, *EXPERT_NODES, ASKER)}


def tiny_model(name: str, directory: Path) -> Path:
    from swarmctl.model_files.models import default_model_path
    from harness.tiny_models import TINY_CONFIGS
    from harness.tiny_models import write_tiny_model

    if name not in TINY_CONFIGS or not TINY_CONFIGS[name].n_expert:
        raise BenchError(f"--model must name a tiny MoE model of harness/tiny_models.py, not {name!r}")
    return write_tiny_model(directory / f"{name}.gguf", TINY_CONFIGS[name], Path(default_model_path()))


class Swarm(LabSwarm):
    def __init__(self, lab: NatLab, root: Path, model: Path) -> None:
        super().__init__(lab, root, (*STAGES, *EXPERT_NODES, ASKER))
        self.model = model

    def form(self) -> None:
        self.swarmctl("host", "init", "--advertise", f"{HOST_IP}:7470", "--objective", "even", "--model",
                      str(self.model), "--head-layers", "1", "--expert-nodes", "2", "--context", "512")
        self.nodes["host"] = self.lab.net.start("host", self.homes["host"], "run", "--role", "host")
        self.wait_for("the host", lambda s: True)
        for name in (*STAGES, *EXPERT_NODES, ASKER):
            code = self.swarmctl("host", "invite", "--role", "asker" if name == ASKER else "trunk").stdout.strip()
            self.swarmctl(name, "join", code, "--name", name, "--model", str(self.model))
        for name in (*STAGES, *EXPERT_NODES):  # the planner gives experts to the members with the most memory
            memory = "2G" if name in EXPERT_NODES else "1G"
            self.nodes[name] = self.lab.net.start(name, self.homes[name], "run", "--role", "trunk", "--threads", "1",
                                                  "--memory", memory)

        def whole(status: dict) -> bool:
            experts = {m["name"] for m in status["members"] if m.get("experts")}
            staged = [m for m in status["members"] if m["layers"]]
            return status["complete"] and experts == set(EXPERT_NODES) and len(staged) == len(STAGES) \
                and all(m["health"] == "ready" for m in staged)

        self.wait_for("a complete plan with both expert nodes", whole)

    def ask_and_kill(self, max_tokens: int, kill_after: int) -> dict:
        argv = self.lab.net[ASKER].command(sys.executable, "-m", "swarmctl", "ask", "--raw", "--temperature", "0",
                                           "--max-tokens", str(max_tokens), "--threads", "1", PROMPT)
        ask = subprocess.Popen(argv, env=self.lab.net._env(self.homes[ASKER]), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        out, killed, last, pause = b"", None, 0.0, 0.0
        fd = ask.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], 300)
            if not ready:
                ask.kill()
                raise BenchError("the answer stalled for 300 s")
            chunk = os.read(fd, 4096)
            now = time.monotonic()
            if killed is not None:
                pause = max(pause, now - last)
            last = now
            if not chunk:
                break
            out += chunk
            if killed is None and len(out) >= kill_after:
                self.nodes.pop(VICTIM).popen.kill()  # SIGKILL: no goodbye
                killed = last = time.monotonic()
        err = ask.stderr.read().decode(errors="replace")
        if ask.wait() != 0:
            raise BenchError(f"ask failed: {err.strip()[-300:]}")
        if killed is None:
            raise BenchError(f"the answer ended before --kill-after {kill_after} bytes ({len(out)})")
        return {"kill_to_answer_s": round(last - killed, 2), "longest_pause_after_kill_s": round(pause, 2),
                "bytes_before_kill": kill_after, "answer": out.decode(errors="replace")}


def run_once(args, model: Path, root: Path, want: str) -> dict:
    lab = NatLab(NATS, root, wan_delay_ms=args.delay_ms)
    try:
        swarm = Swarm(lab, root, model)
        swarm.form()
        run = swarm.ask_and_kill(args.max_tokens, args.kill_after)
        run["identical"] = run.pop("answer") == want
        return run
    finally:
        lab.close()
        if args.logs is not None:  # each node's log, for the timeline
            keep = args.logs / root.name
            keep.mkdir(parents=True, exist_ok=True)
            for log in root.glob("*.log"):
                shutil.copy(log, keep / log.name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay per public-network crossing")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="qwen3moe-q8_0", help="a tiny MoE model of harness/tiny_models.py")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kill-after", type=int, default=24, help="bytes of the answer streamed before the kill")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--logs", type=Path, help="keep each run's node logs under this directory")
    args = p.parse_args()
    if args.delay_ms < 0 or args.repeats < 1 or args.max_tokens < 2 or args.kill_after < 1:
        print("bench_expert_kill: need --delay-ms >= 0, --repeats >= 1, --max-tokens >= 2, --kill-after >= 1",
              file=sys.stderr)
        return 2
    try:
        with tempfile.TemporaryDirectory(prefix="bench-expert-kill-") as tmp:
            model = tiny_model(args.model, Path(tmp))
            inproc = subprocess.run([sys.executable, "-m", "swarmctl", "ask", "--transport", "inproc", "--model",
                                     str(model), "--head-layers", "1", "--raw", "--temperature", "0", "--max-tokens",
                                     str(args.max_tokens), "--threads", "1", PROMPT],
                                    capture_output=True, text=True, timeout=300,
                                    env={k: v for k, v in os.environ.items() if k != "SWARMCTL_HOME"})
            if inproc.returncode != 0:
                raise BenchError(f"the one-process answer failed: {inproc.stderr.strip()[-300:]}")
            runs = []
            for i in range(args.repeats):
                root = Path(tmp) / f"run{i}"
                root.mkdir()
                runs.append(run_once(args, model, root, inproc.stdout))
    except LabUnavailable as e:
        print(f"bench_expert_kill: skipped: {e}")
        return 0
    except BenchError as e:
        print(f"bench_expert_kill: {e}", file=sys.stderr)
        return 1
    result = {"delay_ms_one_way": args.delay_ms, "model": args.model, "max_tokens": args.max_tokens,
              "measured": "seconds from SIGKILL of expert node carol to the end of dave's answer, and the longest "
                          "pause in the answer's stream after the kill; identical: equals the one-process answer",
              "kill_to_answer_s_median": statistics.median(r["kill_to_answer_s"] for r in runs),
              "longest_pause_s_median": statistics.median(r["longest_pause_after_kill_s"] for r in runs),
              "all_identical": all(r["identical"] for r in runs), "runs": runs}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
