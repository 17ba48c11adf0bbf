"""This node on disk and in the swarm: its home (config, identity, secrets), the host's membership
rules, joining, the throwaway local swarm, a trunk's layer proofs, and rate-limited logs."""
