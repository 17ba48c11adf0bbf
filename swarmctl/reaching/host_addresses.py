"""Reaching the swarm's host: the addresses to try, in order, and the first that answers."""

from __future__ import annotations

from net.endpoint import connect_first, connect_member
from net.identity import Credentials
from net.protocol import ConnectionHandler, SwarmProtocol
from swarmctl.node.home import NodeConfig


def host_addresses(config: NodeConfig) -> list[str]:
    """Where this node reaches the host. On the host itself its own listen address comes first
    (as 127.0.0.1 when it listens on every interface): the addresses it advertises are for the
    others, and need not be reachable from the host."""
    addresses = list(config.host_addresses)
    if config.role == "host":
        addresses.insert(0, config.listen.replace("0.0.0.0", "127.0.0.1"))
    return list(dict.fromkeys(addresses))


async def connect_host(config: NodeConfig, creds: Credentials, handler: ConnectionHandler, *,
                       addresses: list[str] | None = None) -> SwarmProtocol:
    """A member connection to the host at the first of ``addresses`` (default: ``host_addresses``)
    that answers; raises ``net.endpoint.NoAddressAnswered`` (a ``ConnectionError``) when none does."""
    return await connect_first(host_addresses(config) if addresses is None else addresses,
                               lambda address: connect_member(address, creds, config.host_name, handler))
