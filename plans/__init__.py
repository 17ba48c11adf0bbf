"""Placement: what a model needs and what the machines offer, in; a versioned plan of who serves
which layers (and, for MoE models, which experts), out. No network, no processes: plans can be
made on paper (``swarmctl plan``) as well as by the running host.

    layout.py      a model's per-layer costs (weights, KV per token, FLOPs, activations), from its GGUF
                   metadata or from known dimensions
    nodes.py       what the planner knows of each machine: memory, speed per layer, links
    links.py       the links the planner charges: measured, relayed, or bounded from the measured ones
    planner.py     the topology planner: plan_layers() and the proposal it describes (warnings, hops)
    proposal.py    what the planner is given (Constraints) and answers (Proposal), and time_breakdown
    cost.py        the cost model: what a member holds, what a link costs, how an order scores
    search.py      the search over members, orders and cuts, on the cost model (Search extends CostModel)
    experts.py     expert placement (expert parallelism) and what expert calls cost
    options.py     the planner's options, written once for init, plan, config and the host
    plan.py        the Plan (stage and expert assignments, version) as it travels from the host as JSON
    hysteresis.py  when a changed speed or link figure is worth a new plan
    whatif.py      a plan's floors, speculative steps and stage orders, by the planner's cost model
"""
