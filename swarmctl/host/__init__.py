"""The host role: membership, joins, and the plan (who serves which layers).

    service.py   HostService: connections and the control messages it answers
    liveness.py  watch_trunks: a silent trunk is marked down and planned around
    planning.py  PlanKeeper: the plan, the speeds it is made with, re-planning and pushing it
    plan_members.py  PlanMembers: which trunks a plan is made over; members' holds as refusals
    checks.py    ClaimChecks: layer proofs and the host's own timing of each trunk
    check_core.py    CheckRecord: what the checks decide, no I/O, given now (holds, strikes, timings)
    check_tasks.py   CheckTasks: running the checks (tasks, retries, one challenge per trunk)
    trunks.py    TrunkInfo: what the host knows of a registered trunk
    reports.py   AskerReports: recoveries and wrong results askers report
    status.py    swarm_status: the answer to ``status``

The control messages it answers are the handler table in ``HostService.__init__``; every message,
its fields and who sends it are in docs/protocol.md, generated from net/messages.py.

The host asks too (host → trunk, on new streams of the trunk's register connection): ``prove``,
``probe_run``, ``probe_reveal`` (swarmctl/node/layer_proof.py). A trunk becomes a ready stage only once
it proved it holds its layers, and a claimed speed is planned on only once the host timed the
trunk itself, and never faster than it timed it.
"""

from .service import HostService, run_host
from .trunks import TrunkInfo, reachable_address

__all__ = ["HostService", "TrunkInfo", "reachable_address", "run_host"]
