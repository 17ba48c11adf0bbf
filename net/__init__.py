"""Bytes on the wire and the connections that carry them: QUIC with mutual TLS between members.
Imports nothing from ``swarmctl``.

    wire.py      frames, activation packets, expert calls and control messages: pure encode/decode
    messages.py  control messages as types: one frozen struct each, checked once where it arrives
    protocol.py  one QUIC connection as an aioquic protocol: frames in, per-stream handlers, requests
    endpoint.py  opening endpoints: a member's server, member connections, a joiner's pinned one,
                 the first of several addresses that answers
    tls.py       QUIC/TLS configuration and the mutual certificate checks on top of aioquic
    identity.py  the swarm CA, member keys and certificates, names and roles
    invite.py    invite codes: one line a friend pastes into ``swarmctl join``
    liveness.py  ping interval, silence limit and timeouts, and a silence clock that ignores our own stalls
    ping.py      keepalive pings and round-trip times
    relay.py     a UDP relay that delays, drops or cuts a link (tests and benchmarks)
    probe.py     a bounded throughput probe over a member connection (links the planner uses)
    rendezvous.py  what a member's address looks like from outside its NAT; introducing two members
    punch.py     UDP hole punching on the socket QUIC uses (not yet used by the swarm's roles)
    turn.py      a relay of QUIC datagrams for links that cannot be punched (not yet used by the roles)
"""
