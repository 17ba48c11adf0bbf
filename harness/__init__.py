"""What tests and benchmarks share, owned by neither: real processes and labs to run swarmctl in.

    swarm.py        a swarm of real `swarmctl` processes driven through the CLI (Swarm, Node, swarmctl())
    tiny_models.py  tiny random-weight GGUFs of every supported architecture (TINY_CONFIGS by name)
    oracle.py       the oracle rule: our logits against llama-cpp-python's on the same GGUF
    netns.py        machines as Linux network namespaces on a "public" bridge (root, iproute2)
    nat_lab.py      members behind home routers (NAT kinds, iptables) on that network
    wan_delay.py    a userspace hub that delays every crossing of the public network
    soak/           a long run under load and faults (benchmarks/soak.py; tests/test_soak.py runs a short one)
    sim/            the whole swarm in one process on a simulated network and clock, faults from a seed
                    (python -m harness.sim --seed N; tests/test_sim.py; benchmarks/bench_sim.py)
"""
