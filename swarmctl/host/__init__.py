"""The host role: membership, joins, and the plan (who serves which layers).

    service.py        HostService: connections, membership, and the handler table of the messages it answers
    trunk_reports.py  TrunkReports: a trunk's register, ready, refuse, speed, fetching and cached
    slices.py         SliceServer: the model file served in slices to members that fetch (and who else holds them)
    source_reports.py who holds which layers, as a fetch's manifest lists them, and wrong chunks reported
    model_hashes.py   the host's hashes of the model, one per 1 MiB chunk of each tensor
    reaching.py       Reaching: measured links, probes of a link to the host, routes to a trunk (reach)
    rendezvous.py     how a member reaches a trunk through the host
    reach_limit.py    how often one member may make trunks punch towards it
    accusations.py    Accusations: recoveries, unanswered calls and wrong results members report
    reports.py        AskerReports: the tallies of recoveries and wrong results, and which count
    recheck.py        the host's own re-check of a stage's results
    stage_stats.py    what the host reads from its stages' own stats
    replies.py        reply, ok, error: how a handler answers
    liveness.py       watch_trunks: a silent trunk is marked down and planned around
    planning.py       PlanKeeper: the plan, the speeds it is made with, re-planning and pushing it
    staging.py        make-before-break's decisions, no I/O, given now (deadlines, members held out)
    figures.py        the figures a plan is made with, and when a change in them re-plans
    plan_members.py   PlanMembers: which trunks a plan is made over; members' holds as refusals
    proposals.py      a plan from the planner's answer, no I/O
    plan_push.py      telling members the plan
    alarm.py          one timer on the event loop for the keeper
    checks.py         ClaimChecks: layer proofs and the host's own timing of each trunk
    check_core.py     CheckRecord: what the checks decide, no I/O, given now (holds, strikes, timings)
    check_tasks.py    CheckTasks: running the checks (tasks, retries, one challenge per trunk)
    trunks.py         TrunkInfo: what the host knows of a registered trunk
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
