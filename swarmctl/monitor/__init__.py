"""Watching a running swarm: poll the host's status and every trunk's stats over QUIC
(``poller``), turn each poll into an immutable ``SwarmSnapshot`` (``build``), and record or
replay polls (``recording``). Views such as ``swarmctl top`` read snapshots and nothing else."""
