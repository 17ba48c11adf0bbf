"""The whole swarm in one process on a simulated network and clock (see harness/sim/run.py).

    clock.py       an asyncio loop on virtual time; threads' work freezes the clock
    network.py     in-memory UDP for the nodes' real QUIC datagrams: delay, jitter, loss, dup, reorder, cuts
    world.py       the homes (a tiny model, every member's identity) and starting/killing a node
    standin.py     the stand-in compute: SliceEngine's interface, outputs a cheap function of the inputs
    headers.py     model headers parsed once per process
    probes.py      link probes cut to 16 KiB (the simulated network has no bandwidth)
    schedule.py    a run's asks and faults, drawn from its seed
    run.py         one run: the swarm, the schedule played, the results
    invariants.py  what every run must satisfy
"""
