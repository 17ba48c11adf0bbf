"""Decode speed of a real swarm across home routers, with a WAN delay (issue 17); prints JSON.

    sudo .venv/bin/python benchmarks/bench_nat.py [--delay-ms 20] [--repeats 5] [--out FILE]

Needs root (network namespaces, iptables): harness/nat_lab.py builds the machines and
harness/wan_delay.py holds every frame that crosses the "public" network for --delay-ms (one
crossing one way, so a round trip between two machines is twice that). Where namespaces are not
permitted it prints one line and exits 0.

Three layouts, each a fresh lab with a host, two trunks (alice, bob) and an asker (dave), the
bundled model, `swarmctl init --objective even` (a stage on each trunk):

    a  no NATs: every machine on the public network (links "direct");
    b  alice, bob and dave each behind a port-preserving ("cone") NAT: every link punched;
    c  like b, but bob behind a symmetric NAT: his links are relayed through the host.

Measured per layout: dave runs greedy `swarmctl ask -v --raw --temperature 0` with a fixed prompt
for --short and for --long tokens, --repeats times. `ask -v` logs the generation's own time
(from the first request to the last token; connecting and loading the model excluded, printed
to 10 ms). The decode time per token is (long time - short time) / (long tokens - short tokens),
so the prompt's pass and the first token cancel out; tok/s is its inverse. Medians over the
repeats. The paths and round trips are the host's `status --json` after the last ask.

With --long-prompt N: the first-token time (`ask -v` with --max-tokens 1) of a prompt of about N
tokens, --repeats times: the prompt's activations cross every hop before the first token.

With --model PATH (e.g. the Kimi-width file benchmarks/bench_plan_vs_measured.py writes),
--head-layers K and --uplink-mbit R (each machine's uplink to the public network capped: the
hub paces what it takes from each port): the same, on that model, plus the plan's prediction
(issue 33 item 4): `swarmctl plan --json --asker alice` on the host after the runs (the members'
figures as the host has them then; dave, the asker, is charged at alice's speed: the same box),
whole ms per token next to the measured decode ms per token, and with --long-prompt, the plan's
first-token time for that prompt (`--prompt-tokens`, plans/prefill.py) next to the measured one.

Compared: b / a decode tok/s (issue 17's target: at least 0.9), and c's extra ms per token next
to the extra public-network crossings its relayed hops add (the relay's round trip to the host).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from benchmarks.lab_swarm import BenchError, LabSwarm  # noqa: E402
from harness.nat_lab import HOST_IP, NatLab  # noqa: E402
from harness.netns import LabUnavailable  # noqa: E402

PROMPT = "Once upon a time, in a lighthouse by a cold grey sea, there lived a keeper who"
TRUNKS = ("alice", "bob")
ASKER = "dave"
LAYOUTS = {
    "a_no_nat": {"nats": {}, "public": (*TRUNKS, ASKER)},
    "b_cone_punched": {"nats": {"alice": "cone", "bob": "cone", ASKER: "cone"}, "public": ()},
    "c_symmetric_relayed": {"nats": {"alice": "cone", "bob": "symmetric", ASKER: "cone"}, "public": ()},
}
ASK_LOG = re.compile(r"(\d+) prompt tokens, (\d+) generated in ([\d.]+)s \(([\d.]+) tok/s\), finish: (\w+)")


class Swarm(LabSwarm):
    def __init__(self, lab: NatLab, root: Path, threads: int, model: Path | None = None,
                 head_layers: int | None = None) -> None:
        super().__init__(lab, root, (*TRUNKS, ASKER))
        self.threads, self.model, self.head_layers = threads, model, head_layers

    def wait_complete(self, timeout: float = 180) -> dict:
        def complete(status: dict) -> bool:
            staged = [m for m in status["members"] if m["layers"]]
            return status["complete"] and {m["name"] for m in staged} == set(TRUNKS) \
                and all(m["health"] == "ready" for m in staged)

        return self.wait_for("a complete plan with a stage on every trunk", complete, timeout)

    def form(self) -> None:
        model = ["--model", str(self.model)] if self.model else []
        self.swarmctl("host", "init", "--advertise", f"{HOST_IP}:7470", "--objective", "even", *model,
                      *(["--head-layers", str(self.head_layers)] if self.head_layers is not None else []))
        self.nodes["host"] = self.lab.net.start("host", self.homes["host"], "run", "--role", "host")
        self.wait_for("the host to answer status", lambda status: True, timeout=60)
        for name in (*TRUNKS, ASKER):
            code = self.swarmctl("host", "invite", "--role", "trunk" if name in TRUNKS else "asker").stdout.strip()
            self.swarmctl(name, "join", code, "--name", name, *model)
        for name in TRUNKS:
            self.nodes[name] = self.lab.net.start(name, self.homes[name], "run", "--role", "trunk", "--memory", "12G",
                                                  "--threads", str(self.threads))
        self.wait_complete()

    def ask(self, max_tokens: int, prompt: str = PROMPT) -> dict:
        r = self.swarmctl(ASKER, "ask", "-v", "--raw", "--temperature", "0", "--max-tokens", str(max_tokens),
                          "--threads", str(self.threads), prompt, timeout=300)
        found = ASK_LOG.search(r.stderr)
        if not found:
            raise BenchError(f"no timing line in `ask -v` output: {r.stderr.strip()[-300:]}")
        prompt, n, elapsed, rate, finish = found.groups()
        return {"prompt_tokens": int(prompt), "tokens": int(n), "elapsed_s": float(elapsed),
                "cli_tok_s": float(rate), "finish": finish, "text": r.stdout.strip()}


def _paths(status: dict) -> list[dict]:
    return [{"link": f"{row['source']} → {row['target']}", "path": row["path"],
             "rtt_ms": round(row["rtt_ms"], 2) if row.get("rtt_ms") is not None else None,
             "measured": row.get("measured")} for row in status["links"]]


def _expected(layout: str, paths: list[dict]) -> bool:
    kinds = [p["path"] for p in paths]
    if layout == "a_no_nat":
        return all(k.startswith("direct") for k in kinds)
    if layout == "b_cone_punched":
        return all(k.startswith("punched") for k in kinds)
    return any(k.startswith("relayed via host") for k in kinds)


def run_layout(name: str, spec: dict, args, root: Path) -> dict:
    lab = NatLab(spec["nats"], root, public=spec["public"], wan_delay_ms=args.delay_ms, uplink_mbit=args.uplink_mbit)
    try:
        swarm = Swarm(lab, root, args.threads, args.model, args.head_layers)
        swarm.form()
        swarm.ask(args.short)  # warm-up: first punches, page cache
        runs = []
        for _ in range(args.repeats):
            short, long = swarm.ask(args.short), swarm.ask(args.long)
            if short["text"] != long["text"][:len(short["text"])]:
                raise BenchError("the short answer is not a prefix of the long one (not greedy?)")
            if long["tokens"] <= short["tokens"]:
                raise BenchError(f"generation stopped early ({long['finish']}): pick a longer-running prompt")
            per_token_s = (long["elapsed_s"] - short["elapsed_s"]) / (long["tokens"] - short["tokens"])
            runs.append({"short": {k: short[k] for k in ("tokens", "elapsed_s")},
                         "long": {k: long[k] for k in ("tokens", "elapsed_s", "cli_tok_s", "finish")},
                         "decode_ms_per_token": round(per_token_s * 1e3, 2)})
        first_token = []
        if args.long_prompt:  # first-token time: the whole prompt crosses every hop before the first token
            long_prompt = " ".join([PROMPT] * max(1, args.long_prompt // 20))  # (~20 tokens per copy)
            for _ in range(args.repeats):
                first = swarm.ask(1, long_prompt)
                first_token.append({"prompt_tokens": first["prompt_tokens"], "elapsed_s": first["elapsed_s"]})
        status = swarm.wait_complete()
        paths = _paths(status)
        ms = statistics.median(r["decode_ms_per_token"] for r in runs)
        predicted = {}
        if args.model:  # what the plan says for the same token, on the members' figures now
            prompt_tokens = first_token[0]["prompt_tokens"] if first_token else long["prompt_tokens"]
            plan = json.loads(swarm.swarmctl("host", "plan", "--json", "--asker", TRUNKS[0], "--prompt-tokens",
                                             str(prompt_tokens)).stdout)
            predicted = {"plan_whole_ms_per_token": round(plan["whole_ms_per_token"], 2),
                         "plan_asker_ms": round(plan["asker_ms"], 2), "plan_asker_basis": plan["asker_basis"],
                         "plan_time": {t["part"]: round(t["ms"], 2) for t in plan["time"]},
                         "plan_over_measured": round(plan["whole_ms_per_token"] / ms, 3)}
            if first_token and plan["first_token"]["ms"] is not None:  # (plans/prefill.py)
                measured_first = statistics.median(f["elapsed_s"] for f in first_token)
                predicted.update(plan_first_token_s=round(plan["first_token"]["ms"] / 1e3, 3),
                                 plan_first_token_over_measured=round(plan["first_token"]["ms"] / 1e3 / measured_first, 3),
                                 plan_first_token=plan["first_token"]["said"])
        return {"decode_tok_s_median": round(1e3 / ms, 3), "decode_ms_per_token_median": round(ms, 2),
                "decode_ms_per_token_runs": [r["decode_ms_per_token"] for r in runs],
                "cli_tok_s_long_median": statistics.median(r["long"]["cli_tok_s"] for r in runs),
                "prompt_tokens": long["prompt_tokens"],
                **({"long_prompt_tokens": first_token[0]["prompt_tokens"],
                    "first_token_s_median": statistics.median(f["elapsed_s"] for f in first_token),
                    "first_token_s_runs": [f["elapsed_s"] for f in first_token]} if first_token else {}),
                "order": [m["name"] for m in sorted((m for m in status["members"] if m["layers"]),
                                                    key=lambda m: m["layers"][0])],
                **predicted,
                "paths": paths, "paths_as_expected": _expected(name, paths), "runs": runs,
                "answer": long["text"]}
    finally:
        lab.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay per public-network crossing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--short", type=int, default=8, help="tokens of the short generation")
    p.add_argument("--long", type=int, default=40, help="tokens of the long generation")
    p.add_argument("--threads", type=int, default=1, help="compute threads per process (2 cores: 1)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    p.add_argument("--long-prompt", type=int, default=0, metavar="TOKENS",
                   help="also time the first token of a prompt of about this many tokens (0: not)")
    p.add_argument("--model", type=Path, help="a GGUF every machine runs (default: the bundled model)")
    p.add_argument("--head-layers", type=int, help="layers the asker keeps at each end (default: init's)")
    p.add_argument("--uplink-mbit", type=float, default=0.0, help="each machine's uplink cap (0: none)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        print(f"bench_nat: unknown layout {bad[0] if bad else '(none)'}; choose from {', '.join(LAYOUTS)}",
              file=sys.stderr)
        return 2
    if args.delay_ms < 0 or args.repeats < 1 or not 0 < args.short < args.long or args.threads < 1:
        print("bench_nat: need --delay-ms >= 0, --repeats >= 1, 0 < --short < --long, --threads >= 1",
              file=sys.stderr)
        return 2
    result: dict = {"delay_ms_one_way": args.delay_ms, "uplink_mbit": args.uplink_mbit,
                    "model": args.model.name if args.model else "bundled", "head_layers": args.head_layers,
                    "short_tokens": args.short, "long_tokens": args.long,
                    "repeats": args.repeats, "threads_per_process": args.threads, "prompt": PROMPT,
                    "measured": "decode ms/token = (ask -v time for --long tokens - for --short) / token difference",
                    "layouts": {}}
    try:
        for name in layouts:
            with tempfile.TemporaryDirectory(prefix=f"bench-nat-{name}-") as tmp:
                result["layouts"][name] = run_layout(name, LAYOUTS[name], args, Path(tmp))
                hub_log = Path(tmp) / "wan_delay.log"  # the hub's frame counters, written as it stops
                if hub_log.exists():
                    result["layouts"][name]["wan_delay_hub"] = hub_log.read_text().strip()
    except LabUnavailable as e:
        print(f"bench_nat: skipped: {e}")
        return 0
    except BenchError as e:
        print(f"bench_nat: {e}", file=sys.stderr)
        return 1
    got = result["layouts"]
    if "a_no_nat" in got and "b_cone_punched" in got:
        result["punched_over_no_nat"] = round(got["b_cone_punched"]["decode_tok_s_median"]
                                              / got["a_no_nat"]["decode_tok_s_median"], 3)
        result["punched_over_no_nat_target"] = 0.9
    if "b_cone_punched" in got and "c_symmetric_relayed" in got:
        c, b = got["c_symmetric_relayed"], got["b_cone_punched"]
        relayed = [p for p in c["paths"] if p["path"].startswith("relayed")]

        def rtts(paths, asker_rows: bool) -> float | None:
            values = [p["rtt_ms"] for p in paths if p["rtt_ms"] is not None and ("asker" in p["link"]) == asker_rows]
            return statistics.median(values) if values else None

        result["relayed"] = {
            "extra_ms_per_token": round(c["decode_ms_per_token_median"] - b["decode_ms_per_token_median"], 2),
            "relayed_hops_per_token": len(relayed),
            # each relayed hop crosses the public network twice (member → host → member) instead of once
            "extra_crossings_ms": len(relayed) * args.delay_ms,
            # status's rows between two trunks carry their own measurement over the path they use;
            # the asker's rows carry the trunk's round trip to the host (the planner's stand-in for
            # the asker), i.e. the round trip of the relay hop through the host
            "relayed_trunk_link_rtt_ms": rtts(relayed, asker_rows=False),
            "punched_trunk_link_rtt_ms": rtts(b["paths"], asker_rows=False),
            "trunk_to_host_rtt_ms_median": rtts(c["paths"], asker_rows=True),
        }
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
