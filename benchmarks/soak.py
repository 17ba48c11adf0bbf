"""Soak: minutes of mixed load against a real swarm of separate processes, with faults; prints JSON.

    python benchmarks/soak.py [--minutes 10] [--out FILE] [--seed 1] [--deadline 120] [--no-join]

The swarm is built the way a user builds one, through the CLI (harness/swarm.py): a host
(`init`, `run --role host`), two trunks that `join` with invites and `run --role trunk`, an asker
member, a second member ("friend") and a member that only polls (stats). Then, for --minutes,
bounded in time and in count (--max-requests):

  askers       `swarmctl ask` processes coming and going: --askers of them at once from the asker's
               home (one identity, several processes) and --friend-askers from the friend's home
  API clients  --api-clients streaming HTTP clients (server-sent events, stdlib asyncio) against
               one `swarmctl serve` running on the asker's home (the same identity as those `ask`
               processes): chat prompts through /v1/chat/completions, raw ones through /v1/completions
  prompts      chat and raw prompts of 5 to about 500 tokens, greedy (temperature 0), 8-32 tokens out
  faults       at 20 % of the run the first stage is killed with SIGKILL and restarted --restart-after
               seconds later (same home, no new invite); at 45 % the last stage is frozen with
               SIGSTOP for --freeze seconds, then SIGCONT; at 65 % a new member joins with an invite
               and runs a trunk (the swarm re-plans onto it). A fault also waits until the swarm is
               whole again after the one before, plus QUIET_S.

Before the swarm starts, each prompt's answer is computed once in this process (the asker and two
trunk stages in-process, greedy; in-process and swarm runs are token-identical: tested elsewhere).
A request counts as correct only if its text equals that reference.

Outcomes: "ok" (the reference text), "wrong" (completed, other text), "failed" (an error the
client was told: `ask`'s exit status and its error line, an HTTP error status or an error event in
the stream), "lost" (no answer and no error by the soak's --deadline: the process is killed or the
connection dropped; `ask`'s own deadline is 300 s, `serve`'s 600 s, so a hang shows up as lost).

Every few seconds (--poll) the host's status and each trunk's own `stats` (RSS, open QUIC
streams, requests held, tensor bytes) are read as the member "monitor", and the RSS of the host
and of `serve` from /proc. Each fault
opens an outage window: from the fault until the host reports the swarm complete again with every
running trunk serving, plus GRACE_S.

The verdict (thresholds below, repeated in the JSON):
  zero_lost_requests  no request lost; every failure carried a clear error (a message, no
                      traceback) and overlapped an outage window
  no_wrong_answers    every completed request's text equals its reference
  rss_flat            per process (each incarnation of a restarted trunk on its own): the median RSS
                      over the last third of the run is at most RSS_TOLERANCE above the median over
                      the middle third (the first third is warm-up, and so is the first
                      PROCESS_WARMUP_S of a restarted or new process); for a trunk, RSS less the bytes
                      of the tensors it holds, since re-plans move layers (and their mapped weights)
  open_streams_flat   per trunk: the median open-stream count over the last third is at most
                      STREAMS_SLACK above the middle third's
  open_streams_idle   once the load has stopped and the last request ended, every trunk's open
                      streams fall to IDLE_STREAMS or fewer within IDLE_WAIT_S: the host's plan
                      stream, the stats query itself and, at the last stage, `serve`'s results
                      subscription (a killed `ask`'s connection lasts QUIC's 8 s idle timeout)

Everything the soak starts is stopped when it ends, also on an error or Ctrl-C; `ask` and `serve`
processes also die with the soak (PR_SET_PDEATHSIG) if it is killed outright.

The parts, one module each: soak_config (settings, prompts, thresholds), soak_references (the
reference answers), soak_swarm (the processes), soak_load (the askers and API clients, with
soak_http), soak_faults (kill, freeze, join), soak_monitor (status, stats, samples), soak_records
(what is recorded) and soak_report (the JSON and its verdict); this file runs them together.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import emit_json  # noqa: E402
from harness.soak.config import Config  # noqa: E402
from harness.soak.run import run_soak  # noqa: E402

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Config()
    parser.add_argument("--minutes", type=float, default=d.minutes, help="length of the load (default 10)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--deadline", type=float, default=d.deadline_s, dest="deadline_s",
                        help="seconds a request may take before it counts as lost (default 120)")
    parser.add_argument("--askers", type=int, default=d.askers, help="concurrent `ask` processes, asker's home")
    parser.add_argument("--friend-askers", type=int, default=d.friend_askers,
                        help="concurrent `ask` processes from another member's home")
    parser.add_argument("--api-clients", type=int, default=d.api_clients, help="concurrent streaming HTTP clients")
    parser.add_argument("--max-requests", type=int, default=d.max_requests, help="0: 150 per minute")
    parser.add_argument("--poll", type=float, default=d.poll_s, dest="poll_s", help="seconds between stats polls")
    parser.add_argument("--restart-after", type=float, default=d.restart_after_s, dest="restart_after_s")
    parser.add_argument("--freeze", type=float, default=d.freeze_s, dest="freeze_s")
    parser.add_argument("--no-join", action="store_false", dest="join", help="no member joins mid-run")
    parser.add_argument("--threads", type=int, default=d.threads, help="compute threads per process (default 1)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--keep", type=Path, help="copy the nodes' homes and logs here at the end")
    args = parser.parse_args()
    config = Config(**{k: v for k, v in vars(args).items() if k not in ("out", "keep")})

    def interrupted(signum, frame):  # SIGTERM cleans up as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    try:
        result = run_soak(config, keep=args.keep, handle_signals=True)
    except KeyboardInterrupt:
        print("soak: interrupted; every process it started has been stopped", file=sys.stderr)
        sys.exit(130)
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
