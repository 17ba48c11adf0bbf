"""The soak (benchmarks/soak.py), short: under a minute of mixed load on a real swarm of separate
processes (`ask` processes from one member's home and another's, a streaming client of `serve`),
with a trunk killed with SIGKILL and restarted and one frozen with SIGSTOP. Every request must end
with its solo run's text or with a clear error during an outage, none may hang, and once the load
has stopped the trunks' open QUIC streams must be back to the idle few. No timed assertions: the
soak's own deadline only decides when a request counts as lost."""

from __future__ import annotations

import json

import pytest

from harness.soak.config import IDLE_STREAMS, PROMPTS, Config
from harness.soak.run import run_soak

# The heavy tier (tests/markers.py): the simulator's seeds kill, restart and freeze trunks under
# asks and check the same (exact tokens or a clear error, nothing held afterwards), replayably.
pytestmark = pytest.mark.heavy

SHORT = Config(minutes=0.8, deadline_s=120.0, askers=2, friend_askers=1, api_clients=1, join=False, poll_s=3.0,
               kill_at=0.15, freeze_at=0.5)
# short and long prompts, chat and raw; one of about 500 tokens rather than two
SHORT_PROMPTS = [PROMPTS[i] for i in (0, 1, 3, 5, 6)]


def test_a_short_soak_loses_no_request_and_leaves_no_stream_open():
    result = run_soak(SHORT, prompts=SHORT_PROMPTS)
    # (on a failure the run adds what each node and `serve` logged last: node_log_tails)
    summary = json.dumps({k: result[k] for k in ("requests", "failures", "wrong", "events", "host", "node_log_tails")
                          if k in result}, indent=1)
    requests, verdict = result["requests"], result["verdict"]
    assert requests["completed_correct"] > 0, summary
    assert "kill" in [e["kind"] for e in result["events"]], summary  # the freeze waits for the kill's recovery
    assert requests["completed_wrong"] == 0, summary
    assert verdict["zero_lost_requests"], summary
    # each trunk: the host's plan stream, the stats query and, at the last stage, serve's results stream
    assert verdict["open_streams_idle"], (f"open streams after the load: {verdict['open_streams_at_end']}, "
                                          f"expected at most {IDLE_STREAMS} each\n{summary}")
