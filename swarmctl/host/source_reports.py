"""Who holds which layers, as the host lists them in a fetch's manifest, and what fetching members
reported of the ones that sent wrong bytes (``bad_source``).

A report counts only against a member the host listed to that reporter, once per (reporter,
accused), and a reporter has at most MAX_PER_REPORTER reports counted: a member cannot inflate a
count by repeating itself or accuse members it was never sent to. One report evicts nobody; a
member that DISTRUST_AFTER different members reported is no longer listed as a holder (it stays
in the swarm: the host's own checks decide about its stage, swarmctl/host/checks.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from net import messages as m

log = logging.getLogger("swarmctl.host")

MAX_PER_REPORTER = 8
DISTRUST_AFTER = 2  # different reporters
MAX_HOLDERS = 8  # listed per manifest


@dataclass
class SourceReports:
    listed: dict[str, set[str]] = field(default_factory=dict)  # reporter → members listed to it
    against: dict[str, set[str]] = field(default_factory=dict)  # accused → members that reported it

    def holders(self, asker: str, start: int, stop: int, held: dict[str, tuple[str, list[tuple[int, int]]]]) \
            -> list[m.Holder]:
        """Members holding any of layers [start, stop), most of them first: ``held`` is each
        member's (address, ranges). Never the asker itself, nor a distrusted member."""
        found = []
        for name, (address, ranges) in held.items():
            if name == asker or self.distrusted(name):
                continue
            for a, b in ranges:
                overlap = min(b, stop) - max(a, start)
                if overlap > 0:
                    found.append((-overlap, name, m.Holder(name=name, address=address, start=a, stop=b)))
        chosen, seen = [], set()
        for _, name, holder in sorted(found, key=lambda f: (f[0], f[1])):
            if name not in seen and len(chosen) < MAX_HOLDERS:
                seen.add(name)
                chosen.append(holder)
        self.listed.setdefault(asker, set()).update(h.name for h in chosen)
        return chosen

    def report(self, reporter: str, accused: str, reason: str) -> bool:
        """Whether the report counted (see the module's rules)."""
        if accused not in self.listed.get(reporter, ()):
            log.info("%s reported %s for wrong chunks, but the host never listed %s to it: not counted",
                     reporter, accused, accused)
            return False
        already = sum(reporter in who for who in self.against.values())
        reporters = self.against.setdefault(accused, set())
        if reporter in reporters or already >= MAX_PER_REPORTER:
            return False
        reporters.add(reporter)
        log.warning("member %s sent %s chunks that fail the host's hashes (%s); reported by %d member%s%s",
                    accused, reporter, reason[:200], len(reporters), "" if len(reporters) == 1 else "s",
                    "; no longer listed as a source" if self.distrusted(accused) else "")
        return True

    def distrusted(self, member: str) -> bool:
        return len(self.against.get(member, ())) >= DISTRUST_AFTER

    def count(self, member: str) -> int:
        return len(self.against.get(member, ()))
