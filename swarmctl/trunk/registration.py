"""What a trunk tells the host when it registers, beyond its figures: the address it sees for its
swarm socket, and the host RAM it offers for routed experts."""

from __future__ import annotations

from net import messages as m
from net.endpoint import Address
from swarmctl.reaching.reach import local_ip_towards


def ram_offer(ram_bytes: int, ram_gb_s: float | None) -> dict:
    """Host RAM for routed experts, with its measured rate: offered together or not at all."""
    if not ram_bytes or ram_gb_s is None:
        return {}
    return {"ram_bytes": ram_bytes, "ram_gb_s": min(ram_gb_s, m.MAX_RAM_GB_S)}


def local_address(address: Address, host_addresses: list[str]) -> str:
    """Our swarm socket as we see it on the route to the host (the host compares it with where it
    sees the socket: a difference means a NAT); "" where no route says."""
    if address.host not in ("0.0.0.0", "::"):
        return str(address)
    for text in host_addresses:
        try:
            ip = local_ip_towards(Address.parse(text))
        except ValueError:
            continue
        if ip is not None:
            return str(Address(ip, address.port))
    return ""
