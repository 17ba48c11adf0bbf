"""The Plan: who serves which layers, under which version. Travels as JSON from the host."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from kernels.backend import KERNELS
from kernels.kv_cache import ATTENTION
from kernels.errors import EngineError
from net.wire import DType


@dataclass
class StageAssignment:
    member: str
    address: str  # "host:port" the member listens on
    start: int  # layers [start, stop)
    stop: int
    ready: bool = False  # loaded, hash-checked, serving
    compute_ms: float = 0.0  # expected per token
    memory_used: int = 0  # bytes: weights + KV for the planned context × concurrency
    memory_free: int = 0
    send_dtype: DType = DType.F32  # how its output travels on (to the next stage; the last's, to the asker): plans/wire.py


@dataclass
class ExpertAssignment:
    """Expert parallelism: ``member`` holds experts [start, stop) of every MoE trunk layer."""

    member: str
    address: str
    start: int
    stop: int
    ready: bool = False


class PlanError(EngineError):
    """A plan that cannot run as written: the swarm cannot hold the model, or experts nobody holds."""


@dataclass
class Plan:
    version: int
    model_name: str
    n_layer: int
    head_layers: int  # the asker keeps [0, K) and [L-K, L)
    stages: list[StageAssignment] = field(default_factory=list)
    layer_hashes: list[str] = field(default_factory=list)  # SHA-256 of each layer's tensors (host's copy)
    revoked_serials: list[int] = field(default_factory=list)
    model_hash: str = ""  # SHA-256 over the layer hashes: names the model exactly
    objective: str = "latency"
    expected_ms_per_token: float = 0.0  # single stream, trunk compute + links
    expected_tokens_per_s: float = 0.0  # pipelined bound
    bottleneck: str = ""
    warnings: list[str] = field(default_factory=list)
    experts: list[ExpertAssignment] = field(default_factory=list)  # empty: stages run their own experts
    n_expert: int = 0
    # What the planner reserved KV for at each stage: requests × tokens. Stages bound what one
    # member may hold by it (swarmctl/trunk/budget.py).
    context_tokens: int = 4096
    max_concurrent: int = 4
    # Members charged to another's budget at the stages: the names of one invite spend the budget
    # of the first that joined with it (swarmctl/node/membership.py accounts()).
    accounts: dict[str, str] = field(default_factory=dict)
    entry_dtype: DType = DType.F32  # how the asker's activations travel to the first stage (plans/wire.py)
    # Make-before-break (swarmctl/host/planning.py): a plan the host sent its trunks to load beside
    # the one in use, not yet published to askers. A trunk keeps serving the plan in use meanwhile.
    staged: bool = False
    next_version: int = 0  # on the plan in use: the version staged to follow it (0: none)
    # The CPU kernels every member computes with (plans/options.py): each applies the same, so a
    # step replayed on another member (a re-check, a take-over) gives the same bits.
    kernels: str = "plain"
    attention: str = "plain"  # plain or flash (plans/options.py), the same for the same reason

    def account(self, member: str) -> str:
        """Whose budget ``member``'s requests spend at a stage."""
        return self.accounts.get(member, member)

    @property
    def trunk_range(self) -> tuple[int, int]:
        return self.head_layers, self.n_layer - self.head_layers

    @property
    def complete(self) -> bool:
        """Every trunk layer is assigned, contiguously, to a stage that is ready (and, with expert
        parallelism, every expert to a ready expert node)."""
        start, stop = self.trunk_range
        cursor = start
        for stage in self.stages:
            if stage.start != cursor or not stage.ready:
                return False
            cursor = stage.stop
        return cursor == stop and all(e.ready for e in self.experts)

    def check_experts(self) -> None:
        """Refuse a placement that leaves an expert unplaced or places one twice, before anything runs."""
        if not self.experts:
            return
        held = [0] * self.n_expert
        for e in self.experts:
            if not 0 <= e.start < e.stop <= self.n_expert:
                raise PlanError(f"{e.member} is given experts [{e.start}, {e.stop}) of a model with {self.n_expert}")
            for i in range(e.start, e.stop):
                held[i] += 1
        missing = [i for i, n in enumerate(held) if n == 0]
        twice = [i for i, n in enumerate(held) if n > 1]
        if missing:
            raise PlanError(f"the plan leaves experts {_ranges(missing)} unplaced")
        if twice:
            raise PlanError(f"the plan places experts {_ranges(twice)} on more than one node")

    def expert_for(self, member: str) -> ExpertAssignment | None:
        return next((e for e in self.experts if e.member == member), None)

    def stage_for(self, member: str) -> StageAssignment | None:
        return next((s for s in self.stages if s.member == member), None)

    def next_stage(self, stage: StageAssignment) -> StageAssignment | None:
        return next((s for s in self.stages if s.start == stage.stop), None)

    def missing_layers(self) -> list[tuple[int, int]]:
        """Trunk layer ranges no ready stage serves."""
        start, stop = self.trunk_range
        covered = sorted((s.start, s.stop) for s in self.stages if s.ready)
        gaps, cursor = [], start
        for a, b in covered:
            if a > cursor:
                gaps.append((cursor, a))
            cursor = max(cursor, b)
        if cursor < stop:
            gaps.append((cursor, stop))
        return gaps

    def apply(self, proposal, addresses: dict[str, str]) -> bool:
        """Take a planner's proposal; returns True (and bumps the version) if assignments changed.
        Stages that keep their member and range keep their readiness."""
        old = {(s.member, s.start, s.stop): s for s in self.stages}
        sends = {h.src: h.dtype for h in proposal.hops}  # each stage's outgoing hop (plans/wire.py)
        stages = []
        for p in proposal.stages:
            kept = old.get((p.member, p.start, p.stop))
            stages.append(StageAssignment(p.member, addresses[p.member], p.start, p.stop,
                                          kept.ready if kept else False, p.compute_ms, p.memory_used,
                                          p.memory_free, sends.get(p.member, DType.F32)))
        entry = proposal.hops[0].dtype if proposal.hops else DType.F32
        changed = [(s.member, s.start, s.stop, s.send_dtype) for s in stages] != \
            [(s.member, s.start, s.stop, s.send_dtype) for s in self.stages] or entry != self.entry_dtype
        self.entry_dtype = entry
        if changed:
            self.version += 1
            for s in stages:
                s.ready = False  # every stage re-confirms under the new version
        self.stages = stages
        self.objective = proposal.objective
        self.expected_ms_per_token = proposal.ms_per_token
        self.expected_tokens_per_s = proposal.tokens_per_s if proposal.tokens_per_s != float("inf") else 0.0
        self.bottleneck = proposal.bottleneck
        self.warnings = list(proposal.warnings)
        return changed

    def assignments(self) -> tuple:
        """Who serves what, and how it travels: two plans with the same are the same plan."""
        return (tuple((s.member, s.start, s.stop, s.send_dtype) for s in self.stages), self.entry_dtype,
                tuple((e.member, e.start, e.stop) for e in self.experts), self.kernels, self.attention)

    def to_dict(self) -> dict:
        d = asdict(self)  # (dtypes travel by name: net/wire.py's DType labels)
        d["entry_dtype"] = self.entry_dtype.label
        for stage, s in zip(d["stages"], self.stages):
            stage["send_dtype"] = s.send_dtype.label
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """The plan as JSON carries it; each dtype parsed here, once (a name this version does not
        know, a newer host's, is taken as f32)."""
        stages = [StageAssignment(**{**s, "send_dtype": DType.in_plan(s.get("send_dtype", "f32"))})
                  for s in d.get("stages", [])]
        experts = [ExpertAssignment(**e) for e in d.get("experts", [])]
        # (kernels a newer host names that this version lacks: plain, which every CPU runs)
        kernels = d["kernels"] if d.get("kernels") in KERNELS else "plain"
        attention = d["attention"] if d.get("attention") in ATTENTION else "plain"
        return cls(**{**d, "stages": stages, "experts": experts, "kernels": kernels, "attention": attention,
                      "entry_dtype": DType.in_plan(d.get("entry_dtype", "f32"))})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _ranges(indices: list[int]) -> str:
    spans, start = [], indices[0]
    for prev, cur in zip(indices, indices[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"[{start}, {prev + 1})")
            start = cur
    return ", ".join(spans)

