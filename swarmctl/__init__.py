"""swarmctl: pool friends' machines to run one large language model.

The asker keeps the model's first and last layers (and the tokens); trunk members run the layers
between, as a pipeline of stages over mutually authenticated QUIC; the host admits members and
plans who serves what. Below this package: ``kernels`` (slices on llama.cpp's ggml), ``net``
(wire format, typed control messages and QUIC) and ``plans`` (placement), which import
nothing from here.

Roles and the swarm
    host/           the host role: joins, the plan and its re-planning, checks of what trunks
                    claim, liveness, status (service, planning, checks, trunks, reports, status)
    trunk/          the trunk role: a stage of layers or a range of experts, its routes, its host link
    asker           the asker's side of the U-shaped split, for many requests at once
    swarm_client    the asker's link to a swarm: the first and last stage, rerouting and replay
    plan_watch      the asker's link to the host: the newest plan, pushed; reports to the host
    session         an asker ready to generate: a joined swarm, a local one, or all in-process
    local_swarm     a throwaway swarm of processes on loopback for ``ask`` with no swarm joined
    batching        continuous batching for one slice engine
    budget          what each member may hold at one stage: requests and KV-cache bytes
    request_locks   one lock per request id, kept only while in use
    distribution    slice distribution: a trunk without the model fetches its layers' tensors
    layer_proof     a trunk proves it holds its layers; the host times them
    verify          ``--verify P``: the asker spot-checks the trunk's results

Membership and state
    home            a node's state on disk under $SWARMCTL_HOME
    membership      the host's rules: create the swarm, issue and redeem invites, revoke
    joiner          the joiner's side of ``swarmctl join``
    host_addresses  the host's addresses in the order to try, and the first that answers
    models          the bundled model, or a path the user gives

Command line and views
    cli             the ``swarmctl`` command table and the one place errors become exit codes
    commands/       one module per command (ask, serve, init, invite, join, run, status, top, ...)
    errors          errors of the command line itself
    log_limit       at most so many log lines of one kind per period
    api/            ``swarmctl serve``: the OpenAI-compatible HTTP API
    monitor/        polling a live swarm into immutable snapshots; recording and replay
    tui/            ``swarmctl top``: a Textual view of those snapshots
    audit/          the leakage meter: attack this project's own traffic with public knowledge
"""

__version__ = "0.1.0"
