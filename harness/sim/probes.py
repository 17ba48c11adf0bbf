"""Link probes cut to a size the simulated network can say something about.

A trunk measures each link it plans with by a throughput probe of 512 KiB (net/probe.py): some 400
full datagrams and their acknowledgements, each through aioquic, for every link, after every
plan: a quarter of a run's datagrams. The simulated network has delay, loss and cuts but no
bandwidth, so what such a probe reads is how fast this process carried it, whatever its size.
Within ``SMALL_PROBES`` every probe a trunk sends carries PROBE_BYTES: the same protocol on the
same connections (announced, sent, acknowledged, refused or cut by a fault), a few datagrams long.
"""

from __future__ import annotations

PROBE_BYTES = 16 * 1024


class SmallProbes:
    def __enter__(self) -> "SmallProbes":
        import swarmctl.trunk.links as links

        self.module, self.real = links, links.measure_or_none
        real = self.real

        async def measure_or_none(conn, n_bytes: int = PROBE_BYTES):
            return await real(conn, min(n_bytes, PROBE_BYTES))

        links.measure_or_none = measure_or_none
        return self

    def __exit__(self, *exc) -> None:
        self.module.measure_or_none = self.real


SMALL_PROBES = SmallProbes()
