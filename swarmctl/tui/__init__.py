"""``swarmctl top``: a Textual view of a running swarm. It reads ``SwarmSnapshot``s from a feed
(a live ``Monitor`` or a replayed recording) on a timer, and knows nothing of QUIC."""
