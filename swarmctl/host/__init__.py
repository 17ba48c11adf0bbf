"""The host role: membership, joins, and the plan (who serves which layers).

    service.py   HostService: connections and the control messages it answers
    liveness.py  watch_trunks: a silent trunk is marked down and planned around
    planning.py  PlanKeeper: the plan, the speeds it is made with, re-planning and pushing it
    checks.py    ClaimChecks: layer proofs and the host's own timing of each trunk
    trunks.py    TrunkInfo: what the host knows of a registered trunk
    reports.py   AskerReports: recoveries and wrong results askers report
    status.py    swarm_status: the answer to ``status``

Control messages (JSON frames, one request per stream unless noted):

    join        {token_id, secret, csr, name}          joiner (join ALPN) → host → joined | error
    register    {listen, memory, ms_per_layer_token,   trunk → host; the stream stays open and
                 device, rtt_ms}                       the host sends every new plan on it
    links       {links: {peer: {rtt_ms, bandwidth_mb_s}}}  trunk's measured links → ok
    speed       {ms_per_layer_token}                   a trunk's new figure (measured after a fetch or again,
                                                       or seen while serving) → ok; re-plans if material
    recovered   {recovery_s, replayed_bytes}           an asker rerouted a request after a failure → ok
    bad_result  {members, plan_version, layers, ...}   an asker's spot check (--verify) caught its route
                                                       returning a wrong result → ok (counted, shown in status;
                                                       attributed: found stage by stage, see service.py)
    watch_plan  {}                                     asker → plan now, and every new plan after
    fetch_slice {start, stop, have, want}              a trunk without the model → manifest ("want": []),
                                                       or the chunks "want" names, then done
    nodes       {}                                     anyone → the planner's view of the members
    ready       {plan_version}                         trunk loaded its layers → ok
    refuse      {reason}                               trunk cannot serve (e.g. model mismatch) → ok
    get_plan    {}                                     anyone → plan
    status      {}                                     anyone → status
    revoked     {}                                     the host's own CLI after 'swarmctl revoke' → ok
    reconfigure {}                                     the host's own CLI after 'swarmctl config' → ok

The host asks too (host → trunk, on new streams of the trunk's register connection): ``prove``,
``probe_run``, ``probe_reveal`` (swarmctl/layer_proof.py). A trunk becomes a ready stage only once
it proved it holds its layers, and a claimed speed is planned on only once the host timed the
trunk itself, and never faster than it timed it.
"""

from .service import HostService, run_host
from .trunks import TrunkInfo, reachable_address

__all__ = ["HostService", "TrunkInfo", "reachable_address", "run_host"]
