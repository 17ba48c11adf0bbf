"""A run's schedule, drawn from its seed: the network's conditions, the asks (who, when, what),
and the faults (what happens to which node, when). A schedule is plain data: it prints as the
event list a failure is replayed from, and shrinking removes events from it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from harness.sim.network import Conditions
from harness.sim.world import WorldSpec

# Faults: (kind, what it does)
FAULTS = {
    "kill": "kill -9 of a trunk: it never comes back",
    "restart": "kill -9 of a trunk, started again from its home after a pause",
    "freeze": "a node's datagrams stop both ways for a while, then flow again (its own timers still run)",
    "host_restart": "kill -9 of the host, started again from its home after a pause",
    "revoke": "the host revokes an asker while its asks may be running ('swarmctl revoke')",
    "slow": "a node's datagrams take longer for a while (a slow member)",
    "partition": "two nodes cannot reach each other for a while",
}
# Drawn only where the world allows and the kinds asked for include them (kinds_for; every seed
# recorded before these existed was drawn from FAULTS alone, and still is by default).
MORE_FAULTS = {
    "rejoin": "a trunk stops the way a user stops it (its stop event: Ctrl-C, SIGTERM), then starts "
              "again from its home after a pause and rejoins",
    "join": "a member not started with the swarm starts now and joins (worlds with spare trunks)",
    "wrong": "a trunk's results are wrong for a while: noise of their own size on every row it passes on "
             "(worlds whose askers verify every step)",
    "expert_kill": "kill -9 of an expert node, mid-call or not; started again from its home after a pause "
                   "(worlds with expert nodes)",
    "churn": "a trunk's stage serves slower or faster for a while (its speed reports from its batches say "
             "so); the host's re-plan gate is shortened in such a run so that it can re-plan on speed "
             "(worlds whose planner places layers by speed)",
    "stall": "a trunk's next load of the layers it is given (within 30 s) hangs for a while (a disk or "
             "fetch that stalls), so the host's deadline for a staged plan or a stage's readiness can pass "
             "(worlds with short deadlines)",
    "stop": "a trunk or the host stopped as by SIGSTOP (no code of its runs, its timers included; what "
            "reaches it waits in its sockets), then continued after a while (SIGCONT)",
}
# The kind added last: the seeds recorded before it, with --kinds all, replay without it ('--kinds
# pre-stop'; a kind added to a draw changes what every later choice in it picks).
STOP = "stop"
# Not drawn in a world whose askers do not check their steps (every ask it touches must fail
# there): for showing that the invariants catch wrong tokens. Drawn as 'wrong' where they check.
LIE = "lie"  # a trunk adds noise to every result it passes on, for a while
CLASSIC = tuple(sorted(FAULTS))  # the kinds a plain draw picks from
REVOKED_ASKER = "mallory"  # the asker a 'revoke' fault revokes (the other askers must be unaffected)


@dataclass(frozen=True)
class Ask:
    at: float  # virtual seconds after the swarm first served
    asker: str
    prompt: tuple[int, ...]
    max_tokens: int

    def describe(self) -> str:
        return f"{self.asker} asks {list(self.prompt)} for {self.max_tokens} tokens"


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    node: str
    other: str = ""  # the second node of a partition
    lasts: float = 0.0  # how long until it is undone (restart, freeze, slow, partition)
    extra_delay: float = 0.0  # for 'slow': added to each of its datagrams
    factor: float = 0.0  # for 'churn': what its speed figure is multiplied by

    def describe(self) -> str:
        what = {"partition": f"{self.node} <-/-> {self.other}",
                "slow": f"{self.node} +{self.extra_delay * 1e3:.0f} ms per datagram",
                "churn": f"{self.node} at {self.factor:g}x its time per layer"}.get(self.kind, self.node)
        return f"{self.kind} {what}" + (f" for {self.lasts:.1f} s" if self.lasts else "")


@dataclass(frozen=True)
class Schedule:
    seed: int
    conditions: Conditions
    asks: tuple[Ask, ...]
    faults: tuple[Fault, ...] = field(default=())

    def events(self) -> list[tuple[float, str]]:
        out = [(a.at, a.describe()) for a in self.asks] + [(f.at, f.describe()) for f in self.faults]
        return sorted(out)

    def without(self, asks: tuple[Ask, ...], faults: tuple[Fault, ...]) -> "Schedule":
        return replace(self, asks=asks, faults=faults)

    def describe(self) -> str:
        lines = [f"seed {self.seed}: {self.conditions.describe()}"]
        lines += [f"  t={at:7.2f}  {text}" for at, text in self.events()]
        return "\n".join(lines)


def kinds_for(spec: WorldSpec, *, stop: bool = True) -> tuple[str, ...]:
    """Every kind a run of ``spec`` can be given and keep its invariants: 'wrong' only where the
    askers check every step (nothing else in the product catches a trunk's wrong rows before they
    become tokens), 'join' where a member was left out at the start, 'expert_kill' where there are
    expert nodes, 'churn' where the planner places layers by speed, 'stall' where the host's
    deadlines are short (the churn world, made after 'stop', has both).
    ``stop=False``: as drawn before 'stop' existed (the seeds recorded then)."""
    more = ["rejoin", *([STOP] if stop else [])]
    more += ["churn"] if spec.objective != "even" else []
    more += ["stall"] if spec.deadlines_s else []
    more += ["join"] if spec.spare_trunks else []
    more += ["wrong"] if spec.verify >= 1.0 else []
    more += ["expert_kill"] if spec.expert_nodes else []
    return tuple(sorted((*FAULTS, *more)))


def draw(seed: int, spec: WorldSpec, *, asks: int = 8, faults: int = 3, window_s: float = 60.0,
         kinds: tuple[str, ...] = CLASSIC) -> Schedule:
    """The schedule of ``seed``: ``asks`` asks and up to ``faults`` faults within ``window_s``, of
    ``kinds`` (CLASSIC: the seven every recorded seed was drawn with; kinds_for(spec): all of the
    world's). The host's planner picks which trunks are expert nodes, so 'expert_kill' names a
    trunk the run takes if the plan has it as an expert node when the fault plays, and the plan's
    first expert node otherwise."""
    rng = random.Random(seed)
    conditions = Conditions(delay_s=rng.choice([0.0005, 0.002, 0.02]), jitter_s=rng.choice([0.0, 0.001, 0.01]),
                            loss=rng.choice([0.0, 0.0, 0.01, 0.05]), duplicate=rng.choice([0.0, 0.01]),
                            reorder=rng.choice([0.0, 0.01, 0.05]))
    drawn_asks = tuple(sorted((Ask(round(rng.uniform(0, window_s / 2), 2), rng.choice(spec.askers),
                                   tuple(rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))),
                                   rng.randint(4, 32)) for _ in range(asks)), key=lambda a: a.at))
    drawn_faults = []
    for _ in range(rng.randint(0, faults)):
        kind = rng.choice(sorted(kinds))
        trunk = rng.choice(spec.trunk_names)
        at = round(rng.uniform(0, window_s / 2), 2)
        lasts = round(rng.uniform(1, 20), 1)
        if kind == "kill":
            drawn_faults.append(Fault(at, kind, trunk))
        elif kind in ("rejoin", "wrong", "expert_kill", "stall"):  # (expert_kill: the run picks the expert node then)
            drawn_faults.append(Fault(at, kind, trunk, lasts=lasts))
        elif kind == "join":
            drawn_faults.append(Fault(at, kind, rng.choice(spec.spare_names)))
        elif kind in ("restart", "freeze", "stop"):
            drawn_faults.append(Fault(at, kind, trunk if kind == "restart" else rng.choice([trunk, "host"]),
                                      lasts=lasts))
        elif kind == "host_restart":
            drawn_faults.append(Fault(at, kind, "host", lasts=lasts))
        elif kind == "revoke":  # while a long ask of its runs
            long_ask = Ask(at, REVOKED_ASKER, tuple(rng.randrange(1, 1000) for _ in range(rng.randint(1, 12))), 150)
            drawn_asks = tuple(sorted((*drawn_asks, long_ask), key=lambda a: a.at))
            drawn_faults.append(Fault(round(at + rng.uniform(0.05, 1.0), 2), kind, REVOKED_ASKER))
        elif kind == "slow":
            drawn_faults.append(Fault(at, kind, trunk, lasts=lasts, extra_delay=rng.choice([0.05, 0.5, 2.0])))
        elif kind == "churn":
            drawn_faults.append(Fault(at, kind, trunk, lasts=lasts, factor=rng.choice([0.25, 4.0, 10.0])))
        else:
            others = [n for n in [*spec.trunk_names, "host", *spec.askers] if n != trunk]
            drawn_faults.append(Fault(at, kind, trunk, other=rng.choice(others), lasts=lasts))
    return Schedule(seed, conditions, drawn_asks, tuple(sorted(drawn_faults, key=lambda f: f.at)))
