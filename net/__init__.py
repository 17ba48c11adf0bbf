"""Bytes on the wire: QUIC transport, framing, identities. (Filled in by the swarm issue.)"""
