"""The trunk role: serve a slice of layers (a stage) or a range of experts for the swarm.

A trunk registers with the host, receives the plan, checks its own copy of the model against the
host's per-layer hashes, loads what the plan gives it and serves it. Its parts:

    service       TrunkService: lifecycle, and the dispatch of frames and control messages to the parts
    context       TrunkContext: what the parts share, built once by the service; TrunkEvents: what they tell it
    host_link     HostLink: register, keepalive, telling the host, receiving plans
    assignment    Assignment: applying a plan; loading a stage or experts (slice fetch, hash-checked open)
    requests      StageRequests: the data path (run a request's steps, pass results on, errors back)
    routes        RouteTable: each request's streams, with no I/O; returns the actions to take
    results       ResultStreams: the askers' results streams at the last stage
    experts       ExpertClient (a stage's calls to expert nodes) and ExpertServer (an expert node)
    speed_report  SpeedReport: the speed the host plans with, kept current
    stats         the figures of a trunk's `stats` reply (net.messages.Stats): what `status` and `top` read
"""

from swarmctl.trunk.results import results_key, valid_session
from swarmctl.trunk.service import TrunkService
from swarmctl.trunk.stats import available_memory

__all__ = ["TrunkService", "available_memory", "results_key", "valid_session"]
