"""The trunk role: serve a slice of layers (a stage) or a range of experts for the swarm.

A trunk registers with the host, receives the plan, checks its own copy of the model against the
host's per-layer hashes, loads what the plan gives it and serves it. Its parts:

    service         TrunkService: lifecycle, and the dispatch of frames and control messages to the parts
    context         TrunkContext: what the parts share, built once by the service; TrunkEvents: what they tell it
    host_link       HostLink: register, keepalive, telling the host, receiving plans
    registration    what registering tells the host beyond figures (local address, RAM offered)
    assignment      Assignment: applying a plan; loading a stage or experts (hash-checked open)
    assignment_core AssignmentCore: which plan, load or re-confirm, swapping, ready once; no I/O
    standby         Standby: a staged plan's stage loaded beside the one served (make-before-break)
    checked_open    open_checked: a model or slice file opened only if its layers hash as the host's
    layer_fetch     LayerFetch: a stage's layers or an expert node's experts fetched from the swarm
    layer_share     LayerShare (serving held layers to members) and PeerFetches (fetching from them)
    layer_checks    LayerChecks: the host's checks of our layers, answered on the compute thread
    requests        StageRequests: the data path (run a request's steps, pass results on, errors back)
    stage_step      what a step may do and where its output goes; no I/O
    routes          RouteTable: each request's streams, with no I/O; returns the actions to take
    stage_sender    StageSender: sends packets, carries out the route table's actions
    next_stage      NextStage: the one connection to the next stage
    prefixes        StagePrefixes: requests' cells kept for their account's next request
    results         ResultStreams: the askers' results streams at the last stage
    experts         ExpertClient (a stage's calls to expert nodes) and ExpertServer (an expert node)
    call_deadline   CallDeadlines: how long an expert call may take, and nodes given up; no I/O
    link_survey     which links to measure, when, and whom to relay for; no I/O
    links           TrunkLinks: measures links for the host, allocates relayed links, punches
    speed_report    SpeedReport: the speed the host plans with, kept current
    stats           the trunk's `stats` reply (net.messages.Stats): what `status` and `top` read
    capture         FrameCapture: --capture's frames
    budget, request_locks, one_stage   what one member may hold; one request's packets in order; re-check evidence

The cores with no I/O (assignment_core, stage_step, routes, call_deadline, link_survey) are given
the plan, the state and ``now``, and are unit-tested without sockets or threads.
"""

from swarmctl.trunk.results import results_key, valid_session
from swarmctl.trunk.service import TrunkService
from swarmctl.trunk.stats import available_memory

__all__ = ["TrunkService", "available_memory", "results_key", "valid_session"]
