"""The host role: membership, joins, and the plan (who serves which layers).

    service.py        HostService: connections, membership, and the handler table of the messages it answers
    trunk_reports.py  TrunkReports: a trunk's register, ready, refuse, speed, fetching and cached
    slices.py         SliceServer: the model file served in slices to members that fetch (and who else holds them)
    reaching.py       Reaching: measured links, probes of a link to the host, routes to a trunk (reach)
    accusations.py    Accusations: recoveries, unanswered calls and wrong results members report
    stage_stats.py    what the host reads from its stages' own stats
    replies.py        reply, ok, error: how a handler answers
    liveness.py       watch_trunks: a silent trunk is marked down and planned around
    planning.py       PlanKeeper: the plan, the speeds it is made with, re-planning and pushing it
    checks.py         ClaimChecks: layer proofs and the host's own timing of each trunk
    trunks.py         TrunkInfo: what the host knows of a registered trunk
    reports.py        AskerReports: the tallies of recoveries and wrong results, and which count
    status.py         swarm_status: the answer to ``status``

The control messages it answers are the handler table in ``HostService.__init__`` (each entry a
method of the part whose job it is); every message, its fields and who sends it are in
docs/protocol.md, generated from net/messages.py.

The host asks too (host → trunk, on new streams of the trunk's register connection): ``prove``,
``probe_run``, ``probe_reveal`` (swarmctl/node/layer_proof.py). A trunk becomes a ready stage only once
it proved it holds its layers, and a claimed speed is planned on only once the host timed the
trunk itself, and never faster than it timed it.
"""

from .service import HostService, run_host
from .trunks import TrunkInfo, reachable_address

__all__ = ["HostService", "TrunkInfo", "reachable_address", "run_host"]
