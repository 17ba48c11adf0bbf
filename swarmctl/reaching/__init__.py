"""Reaching other members: one UDP socket for all swarm connections, the path to each trunk
(direct, punched or relayed) and what the last attempts found, and the host's addresses."""
