"""The asker's side, ready to generate: the model, the ``Asker`` and the trunk it talks to.

``swarmctl ask`` and ``swarmctl serve`` pick the trunk the same way: a joined swarm (a node home
in $SWARMCTL_HOME), else a throwaway local swarm on loopback, or every slice in this process
with ``transport="inproc"``. ``open_session`` does that and undoes it on exit.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

from kernels.backend import describe_kernels
from kernels.devices import choose_device
from kernels.errors import EngineError
from kernels.slice import Placement
from plans.proposal import HEAD_LAYERS
from swarmctl.asker.head_tail import DEFAULT_MAX_IN_FLIGHT, Asker, Trunk
from swarmctl.asker.speculate import MAX_DRAFT, Drafting, open_drafting

if TYPE_CHECKING:
    from kernels.spec import ModelSpec

log = logging.getLogger("swarmctl.asker.session")


@dataclass(frozen=True)
class SessionOptions:
    transport: str = "swarm"  # "swarm": a joined swarm or a local one; "inproc": all slices here
    model: str | None = None  # a GGUF path; None: the swarm's, or the bundled default
    trunk_nodes: int | None = None  # trunk processes of the local swarm started when none is joined (None: sized)
    streams: int = 1  # requests expected at once (serve: many): how a local swarm splits the cores
    head_layers: int | None = None  # None: HEAD_LAYERS, or what a joined swarm's plan says
    stages: int = 2  # trunk stages with transport "inproc"
    threads: int | None = None
    ctx: int | None = None
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    verify: float = 0.0  # share of trunk steps recomputed here and compared (swarmctl/asker/verify.py); 0: none
    device: str = "auto"  # where this process's slices compute (kernels.devices)
    speculate: str = "off"  # drafting: off, ngram or draft (swarmctl/asker/speculate.py)
    draft_model: str | None = None  # with speculate "draft": a GGUF with the model's vocabulary
    draft_tokens: int = MAX_DRAFT  # drafted tokens per step at most
    trace: bool = False  # stages list their expert calls in their hop records (--trace; costs bytes per hop)


@dataclass
class Session:
    asker: Asker
    trunk: Trunk | None  # None when the asker's head and tail are the whole model
    model: Path
    drafting: Drafting = field(default_factory=Drafting)  # each request's speculation (--speculate)

    def describe_nodes(self) -> dict[str, str]:
        """What each trunk node holds, by the name its hop records give it (for --trace)."""
        trunk = getattr(self.trunk, "link", self.trunk)  # a VerifyingTrunk checks a SwarmLink's answers
        describe = getattr(trunk, "describe_nodes", None)
        return describe() if describe is not None else {}


def _drafting(options: SessionOptions, model: Path, threads: int | None, head_layers: int | None = None) -> Drafting:
    """``head_layers``: the asker's, once known (``--speculate layerskip`` drafts with them)."""
    drafting = open_drafting(options.speculate, options.draft_model, model, k_max=options.draft_tokens,
                             n_threads=threads, max_context=options.ctx, head_layers=head_layers)
    if drafting.mode != "off":
        log.info("speculative steps: %s, up to %d drafted tokens per step%s", drafting.mode, drafting.k_max,
                 f" (draft model {Path(options.draft_model).name})" if options.draft_model else "")
    return drafting


def _header_spec(model: Path) -> ModelSpec:
    """The model's shape, from its header (milliseconds: tensors are not read)."""
    from kernels.gguf_file import GGUFFile
    from kernels.spec import ModelSpec

    with GGUFFile(model) as gguf:
        return ModelSpec.from_gguf(gguf)


def _check_local_head_layers(n_layer: int, head_layers: int, trunks: int) -> None:
    """Before a local swarm starts: its trunks must have a layer each (else its host could never
    make a plan, and the asker would wait for one until its bound)."""
    if n_layer - 2 * head_layers < trunks:
        most = (n_layer - trunks) // 2
        raise EngineError(f"--head-layers {head_layers} leaves {max(0, n_layer - 2 * head_layers)} of the model's "
                          f"{n_layer} layers for {trunks} local trunk{'s' if trunks > 1 else ''}: use at most {most}")


async def _model_for_swarm(home, link, options: SessionOptions) -> Path:
    """For a home that names no model file: the bundled default where the swarm runs it and this
    copy's layers match, else this asker's part of the swarm's model, fetched if not yet here."""
    from kernels.gguf_file import GGUFFile
    from swarmctl.asker.model_part import asker_part, runs_bundled_default

    bundled = runs_bundled_default(link.plan)
    if bundled is not None:
        with GGUFFile(bundled) as gguf:
            try:
                link.check_model(gguf)
                return bundled
            except EngineError:
                pass  # another build of the same name: the swarm's own part, then
    if options.verify:
        raise EngineError("--verify recomputes the trunk's layers here, and this home holds no model file: "
                          "pass --model with the swarm's GGUF (or name it at join)")
    return await asker_part(home, link.plan)


@asynccontextmanager
async def open_session(options: SessionOptions) -> AsyncIterator[Session]:
    opener = _open_inproc if options.transport == "inproc" else _open_swarm
    async with opener(options) as session:
        yield session


@asynccontextmanager
async def _open_inproc(options: SessionOptions) -> AsyncIterator[Session]:
    from swarmctl.asker.head_tail import InprocTrunk, u_split
    from swarmctl.model_files.models import resolve_model

    if options.verify:
        raise EngineError("--verify checks what a swarm's trunks return; with --transport inproc every layer "
                          "already runs in this process")
    model = resolve_model(options.model)
    head_layers = HEAD_LAYERS if options.head_layers is None else options.head_layers
    device = choose_device(options.device)
    t0 = time.perf_counter()
    drafting = _drafting(options, model, options.threads, head_layers)
    try:
        asker = Asker(model, head_layers, n_threads=options.threads, max_context=options.ctx,
                      max_in_flight=options.max_in_flight, placement=Placement(device=device))
    except BaseException:
        drafting.close()
        raise
    trunk = None
    try:
        split = u_split(asker.spec.n_layer, head_layers, options.stages)
        if split.trunk:
            trunk = InprocTrunk(asker.gguf, split.trunk, n_threads=options.threads, max_context=asker.max_context,
                                device=device)
        log.info("loaded %s: %s | %s | %s on %s in %.2fs", model.name, split.head.describe(),
                 ", ".join(s.describe() for s in split.trunk) or "no trunk", split.tail.describe(),
                 device.label, time.perf_counter() - t0)
        yield Session(asker, trunk, model, drafting)
    finally:
        if trunk is not None:
            trunk.close()
        asker.close()
        drafting.close()


@asynccontextmanager
async def _open_swarm(options: SessionOptions) -> AsyncIterator[Session]:
    from swarmctl.node.home import SwarmHome
    from kernels.threads import usable_cores
    from swarmctl.node.local_swarm import LocalSwarm, size_local_swarm
    from plans.options import PlannerSettings
    from swarmctl.model_files.models import checked_model
    from swarmctl.asker.link import SwarmLink
    from swarmctl.asker.local_link import open_local_link

    home = SwarmHome()
    local = link = asker = verifier = None
    drafting = Drafting()
    threads = options.threads
    try:
        device = choose_device(options.device)  # a device this build lacks: one line, before anything starts
        # The model is checked before any node starts or any connection opens: a missing or
        # unusable file is one line at once, not a swarm that fails to come up.
        if home.exists:
            # a home that names no model file: the bundled default where the swarm runs it, else this
            # asker's part of the swarm's model (swarmctl/asker/model_part.py), once the plan is known
            named = options.model or home.load_config().model
            model = checked_model(named) if named else None
            swarm_home = home
        else:
            model = checked_model(options.model)
            drafting = _drafting(options, model, threads)  # a draft that cannot serve: one line, before nodes start
            # The local trunks and this process share this machine's cores (swarmctl/node/local_swarm.py).
            spec = _header_spec(model)
            layout = size_local_swarm(usable_cores(), trunks=options.trunk_nodes, threads=options.threads,
                                      streams=options.streams, width=spec.n_embd)
            head_layers = HEAD_LAYERS if options.head_layers is None else options.head_layers
            _check_local_head_layers(spec.n_layer, head_layers, layout.trunks)
            log.info("no swarm joined: starting a local one (%s)", layout.describe())
            threads = layout.asker_threads
            local = LocalSwarm(model=str(model.resolve()), n_trunks=layout.trunks,
                               planner=PlannerSettings(head_layers=head_layers),
                               threads=layout.trunk_threads)
            swarm_home = local.asker_home
        if home.exists and model is not None:
            drafting = _drafting(options, model, threads)
        if local is not None:  # started here: waited for until it says it is ready, not raced
            link = await open_local_link(local, min_stages=min(local.n_trunks, 22), trace=options.trace)
        else:
            link = await SwarmLink.open(swarm_home, trace=options.trace)
        if options.head_layers is not None and options.head_layers != link.head_layers:
            raise EngineError(f"this swarm's plan keeps {link.head_layers} layers at each end; "
                              f"--head-layers {options.head_layers} does not match")
        if model is None:
            model = await _model_for_swarm(home, link, options)
            drafting = _drafting(options, model, threads)
        # (the plan's kernels and attention, as the trunks compute: the same bits a single machine under them gives)
        placement = Placement(device=device, kernels=link.plan.kernels, attention=link.plan.attention)
        asker = Asker(model, link.head_layers, n_threads=threads, max_context=options.ctx,
                      max_in_flight=options.max_in_flight, placement=placement)
        log.info("head and tail: %s (%d weights repacked); %s", describe_kernels(link.plan.kernels),
                 len(asker.head.weights.repacked) + len(asker.tail.weights.repacked), asker.head.describe_attention())
        link.check_model(asker.gguf)
        if options.speculate == "layerskip":  # (it drafts with the head layers the plan gives this asker)
            drafting.close()
            drafting = _drafting(options, model, threads, link.head_layers)
        if options.verify:
            from swarmctl.asker.verify import VerifyingTrunk

            verifier = VerifyingTrunk(link, asker.gguf, share=options.verify, n_threads=threads,
                                      max_context=asker.max_context)
        yield Session(asker, verifier or link, model, drafting)
    finally:
        if verifier is not None:
            await verifier.flush()  # a mismatch's report reaches the host before the link closes
            verifier.close()
        if link is not None:
            await link.close()
        if asker is not None:
            asker.close()
        if local is not None:
            local.close()
        drafting.close()
