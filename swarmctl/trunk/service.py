"""TrunkService: a trunk's lifecycle, and the dispatch of what arrives to the part that handles it.

Frames from any connection come here (it is the connections' ``ConnectionHandler``): slice
transfers go to the host link, activation packets to the data path, expert calls to the expert
server, and control messages are dispatched from here: results subscriptions, link probes and
stats answered here, relayed links by ``links``, the host's layer checks by ``layer_checks``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from pathlib import Path

from kernels.devices import device_budget
from net import clock
from net.endpoint import Address
from net.punch import serve_on
from net.turn import NatRelay
from net.identity import revoked_reason, verify_member
from net.protocol import ConnectionHandler, SwarmProtocol
from net import messages as m
from net.dispatch import Dispatcher
from net.packet_cost import measure_datagram_cost
from net.probe import ProbeSink
from net.wire import Frame, FrameType, WireError, decode_control
from plans.plan import Plan
from swarmctl.batching import compute_thread
from swarmctl.node.home import SwarmHome
from swarmctl.node.layer_proof import CHALLENGES
from swarmctl.model_files.models import resolve_model
from swarmctl.reaching.reach import Dialer, ask_route
from swarmctl.trunk.assignment import Assignment
from swarmctl.trunk.capture import FrameCapture
from swarmctl.trunk.context import TrunkContext, TrunkOptions
from swarmctl.trunk.experts import ExpertClient, ExpertServer
from swarmctl.trunk.host_link import HostLink
from swarmctl.trunk.layer_checks import LayerChecks
from swarmctl.trunk.layer_fetch import LayerFetch
from swarmctl.trunk.layer_share import LayerShare, PeerFetches
from swarmctl.trunk.links import TrunkLinks
from swarmctl.trunk.requests import StageRequests
from swarmctl.trunk.registration import local_address, ram_offer
from swarmctl.trunk.results import ResultStreams
from swarmctl.trunk.speed_report import SpeedReport
from swarmctl.trunk.stats import available_memory, stats_reply

log = logging.getLogger("swarmctl.trunk")


class TrunkService:
    def __init__(self, home: SwarmHome, options: TrunkOptions, stop: asyncio.Event) -> None:
        """Built on the event loop it will run on; ``stop`` ends ``run`` (set by the caller, or here
        when this trunk cannot serve: ``fatal`` says why)."""
        config = home.load_config()
        creds = home.credentials()
        device = options.device
        self.ctx = TrunkContext(
            name=creds.name, creds=creds, config=config, model_path=resolve_model(config.model),
            slices_dir=home.path / "slices",
            memory=options.memory or (device_budget(device) if device is not None and not device.is_cpu
                                      else available_memory()),
            n_threads=options.n_threads, device=device,
            executor=compute_thread(),  # steps, loading and unloading all happen on the compute thread
            loop=asyncio.get_running_loop(), handler=self, spawn=self._spawn, connect=self._connect_member,
            connect_host=self._connect_host)
        self.options = options
        self.config, self.creds, self.name = config, creds, creds.name
        self.model_path, self.device, self.memory = self.ctx.model_path, device, self.ctx.memory
        self.advertise = Address.parse(options.advertise) if options.advertise else None
        self.address: Address | None = None  # where we listen, once we do
        self.connections: dict[SwarmProtocol, None] = {}  # every open connection, ours and our peers', oldest first
        self.fatal: str | None = None  # set when this trunk cannot serve; run() reports it
        self.datagram_us: float | None = None  # measured as run() starts (net/packet_cost.py)
        # On a GPU: host RAM offered for routed experts (--memory there), and its rate, measured as
        # run() starts (kernels/speed.py RamRate; None: not measured, or a dense model).
        self.ram_bytes = options.ram if device is not None and not device.is_cpu else 0
        self.ram_gb_s: float | None = None
        self._stop = stop
        self._tasks: set[asyncio.Task] = set()
        self._capture = FrameCapture(options.capture_dir)  # --capture: every frame, as bytes
        # What a trunk answers on streams other than the host's plan stream (net/dispatch.py).
        self.answers = Dispatcher({m.Subscribe: self._subscribe, m.Probe: self._probe, m.GetStats: self._stats,
                                   m.AllocateRelay: self._relay_wanted, m.FetchChunks: self._fetch_chunks,
                                   **{challenge: self._challenge for challenge in CHALLENGES.values()}})
        self._server = None
        self.dialer: Dialer | None = None  # our swarm socket: serves, reaches the host and peers (once run)
        self.host = HostLink(self.ctx, self)
        self.speed = SpeedReport(self.ctx, self.host.tell)
        self.expert_client = ExpertClient(
            self.ctx, lambda: self.held.plan.experts,
            on_unanswered=lambda member: self._spawn(self.host.tell(m.Unanswered(member=member))))
        # layers from everyone who holds them: what we hold, served; members we fetch from
        self.share = LayerShare(self.name, self.ctx.model_path, self.ctx.slices_dir, options.upload_mbit,
                                lambda: self.held.plan.model_hash if self.held.plan else None)
        self.peers = PeerFetches(self._connect_member, self)
        self.held = Assignment(self.ctx, self, self.host, self.speed, remote_experts=self.expert_client.forward,
                               fetch=LayerFetch(self.ctx, self.host, self.share, self.peers))
        self.expert_server = ExpertServer(self.ctx.executor, lambda: self.held.experts)
        self.results = ResultStreams()
        self.requests = StageRequests(self.ctx, self.held, self.results, capture=self._capture,
                                      expert_calls=self.expert_client.calls_between)
        self.checks = LayerChecks(self.ctx, self.host, self._proof_sources)  # the host's checks of our layers
        self.probes = ProbeSink()  # peers measuring their link to us (net/probe.py)
        self.links = TrunkLinks(self.ctx, self.host, lambda: self.requests.next_conn)  # ours measured; relays

    # --- lifecycle ---

    async def run(self) -> None:
        # Bind first: the port is ours before the measurements below (seconds at a real model's
        # size), which otherwise left it free for another process to take meanwhile (a test's
        # asker did: "Address already in use").
        listen = Address.parse(self.config.listen)
        self.dialer = await Dialer.open(self.creds, listen, ask_host=lambda message: ask_route(self.host.conn, message))
        try:
            await self._measure()
        except BaseException:
            self.dialer.close()
            raise
        if self.options.relay:
            self.links.relay = NatRelay(listen.host)
        self._server = serve_on(self.dialer.shared, self.creds, self, client_check=self._check_member)
        self.address = Address(listen.host, self.dialer.shared.local_address.port)
        log.info("trunk %s listening on %s", self.name, self.address)
        tasks = [asyncio.ensure_future(self.host.keep(self._stop, self._registration, self._own_links, self._tick)),
                 asyncio.ensure_future(self.requests.reap_idle(self.options.idle_timeout)),
                 asyncio.ensure_future(self.links.refresh(lambda: self.held.plan, self._busy))]
        try:
            await self._stop.wait()
        finally:
            for task in tasks:
                task.cancel()
            await self._shutdown()

    async def _measure(self) -> None:
        """What the host plans with: this machine's speed on the model (and its RAM's, offered
        beside a GPU), and what a hop's datagram costs it."""
        if self.model_path.exists():
            await self.speed.measure_at_start()
            if self.ram_bytes:
                self.ram_gb_s = await self.speed.measure_ram_rate()
                if self.ram_gb_s is None:
                    log.info("--memory offers host RAM for routed experts; %s has none: it stays unused",
                             self.model_path.name)
        else:
            log.info("no model file at %s: layers will be fetched from the swarm", self.model_path)
        self.datagram_us = await self._measure_datagram_cost()

    async def _measure_datagram_cost(self) -> float | None:
        """What a hop's datagram costs this machine (net/packet_cost.py): the planner charges it."""
        try:
            cost = await measure_datagram_cost()
        except Exception as e:  # noqa: BLE001 - a figure for the planner, never a reason not to serve
            log.warning("could not measure what a datagram costs here (%s): planned with the default", e)
            return None
        log.info("a %d-byte datagram costs this machine %.0f us of CPU (both ends of a hop)", cost.datagram_bytes,
                 cost.us_per_datagram)
        return cost.us_per_datagram

    async def _connect_member(self, member: str, address: str, handler: ConnectionHandler) -> SwarmProtocol:
        """A member, by the path the host gives (our dialer: swarmctl/reaching/reach.py)."""
        if self.dialer is None:
            raise ConnectionError("this trunk is not listening yet")
        return await self.dialer.connect(member, address, handler)

    async def _connect_host(self, addresses: list[str]) -> SwarmProtocol:
        """The host, from our swarm socket (so the host sees where it leads)."""
        if self.dialer is None:
            raise ConnectionError("this trunk is not listening yet")
        return await self.dialer.connect_host(addresses, self.config.host_name, self)

    async def _shutdown(self) -> None:
        await self.host.close()
        await self.requests.close()
        self.share.close()
        if self.dialer is not None:
            self.dialer.close()  # (the server and every connection on the socket)
        self.links.close()
        await asyncio.get_running_loop().run_in_executor(self.ctx.executor, self.held.close)

    # --- what the parts tell the trunk (TrunkEvents) ---

    def fail(self, reason: str) -> None:
        """This trunk cannot serve (revoked, refused, its layers unloadable): stop, and say why."""
        self.fatal = reason
        log.error("%s", reason)
        self._stop.set()

    def plan_received(self, plan: Plan) -> None:
        if plan.staged:  # to load beside the plan in use, which is served until the host publishes it
            self.held.prepare(plan)
            return
        if not self.held.accept(plan):
            return
        revoked = set(plan.revoked_serials)
        for conn in list(self.connections):  # every one: a member may hold several (a trunk and asks)
            if conn.peer_cert is not None and conn.peer_cert.serial_number in revoked:
                conn.close_with(revoked_reason(conn.peer_name))
        self.held.apply()

    def drop_routes(self, reason: str) -> None:
        self.requests.drop_all(reason)

    async def serving(self, plan: Plan) -> None:
        await self.links.measure(plan)

    def _check_member(self, cert) -> None:
        plan = self.held.plan
        verify_member(cert, self.creds.ca_cert, frozenset(plan.revoked_serials) if plan else frozenset())

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("unexpected error while handling a packet: %r", task.exception())

    # --- the host ---

    def _registration(self) -> m.Register:
        self.held.host_reconnected()
        return m.Register(listen=str(self.advertise or self.address), memory=self.memory,
                          ms_per_layer_token=self.speed.ms_per_layer_token,
                          device=self.device.label if self.device is not None else "cpu",
                          local="" if self.advertise else local_address(self.address, self.config.host_addresses),
                          relay=self.links.relay is not None,
                          datagram_us=self.datagram_us, prompt_ms_per_layer_row=self.speed.prompt_figure,
                          holds=self.share.holds(), fetches=not self.model_path.exists(),
                          **ram_offer(self.ram_bytes, self.ram_gb_s))

    def peer_coming(self, message: m.Message) -> None:
        if self.dialer is not None:
            self.links.peer_coming(self.dialer, message, self.connections)

    def _own_links(self) -> list[SwarmProtocol | None]:
        return [self.requests.next_conn, *self.expert_client.conns.values()]

    def _tick(self) -> None:
        held = self.held
        serving = held.runner is not None and held.stage is not None and not (held.plan and held.plan.experts)
        self.speed.refresh((held.runner, held.stage.stop - held.stage.start) if serving else None,
                           idle=held.stage is None and held.experts is None)
        kept = self.requests.prefixes.news()
        if kept is not None:  # (what status and top show: the host hears of it when it changes)
            self._spawn(self.host.tell(m.Cached(tokens=kept[0], kv_bytes=kept[1])))

    def _busy(self) -> tuple[int, list[float]]:
        """What says whether this stage is idle enough to measure links (link_survey.refresh_due):
        the compute thread's queue, and when each request's last step arrived."""
        runner = self.held.runner
        return (runner.queue_depth if runner is not None else 0,
                [route.last_active for _, route in self.requests.routes.items()])

    # --- ConnectionHandler ---

    def connection_made(self, conn: SwarmProtocol) -> None:
        log.debug("connection from %s", conn.peer_name)
        self.connections[conn] = None

    def connection_lost(self, conn: SwarmProtocol) -> None:
        self.connections.pop(conn, None)
        self.probes.connection_lost(conn)
        self.requests.connection_lost(conn)
        self.results.connection_lost(conn)

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        self.probes.stream_ended(conn, stream_id)
        self.requests.stream_ended(conn, stream_id)

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if self.host.take_frame(conn, stream_id, frame) or self.probes.take_data(conn, stream_id, frame) \
                or self.peers.take_frame(conn, stream_id, frame):
            return
        self._capture("recv", frame)
        if frame.type == FrameType.CONTROL:
            self._control(conn, stream_id, frame)
        elif frame.type == FrameType.DATA:  # an expert call (expert parallelism)
            self._spawn(self.expert_server.serve(conn, stream_id, frame))
        else:
            self.requests.packet_frame(conn, stream_id, frame)

    # --- control messages ---

    def _control(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        try:
            message = decode_control(frame.body)
            if self.host.is_plan_stream(conn, stream_id):
                self.host.received(message)
                return
            request = self.answers.parse(message)
        except (m.UnknownMessage, m.MalformedMessage) as e:  # (a JSON object: answered, not reset)
            conn.send(stream_id, m.encode(m.Error(message=str(e))), end=True)
            return
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        self.answers.dispatch(request, conn, stream_id)

    def _challenge(self, conn: SwarmProtocol, stream_id: int, request: m.Message) -> None:
        """The host checks we hold our layers, and times us."""
        self._spawn(self.checks.answer(conn, stream_id, request))

    def _subscribe(self, conn: SwarmProtocol, stream_id: int, request: m.Subscribe) -> None:
        for old in self.results.subscribe(conn, stream_id, request.session):
            old.conn.finish(old.stream_id)
        conn.send(stream_id, m.encode(m.Ok()))

    def _probe(self, conn: SwarmProtocol, stream_id: int, request: m.Probe) -> None:
        self.probes.start(conn, stream_id, request)  # a peer measuring our link (net/probe.py)

    def _relay_wanted(self, conn: SwarmProtocol, stream_id: int, request: m.AllocateRelay) -> None:
        self._spawn(self.links.allocate_relay(conn, stream_id))

    def _fetch_chunks(self, conn: SwarmProtocol, stream_id: int, request: m.FetchChunks) -> None:
        """A member fetching layers we hold (swarmctl/trunk/layer_share.py): only trunks fetch layers."""
        refusal = Dispatcher.refusal(request, conn.peer_role, conn.peer_name)
        if refusal is not None:
            conn.send(stream_id, m.encode(m.Error(message=refusal)), end=True)
            return
        self._spawn(self.share.serve(conn, stream_id, request))

    def _stats(self, conn: SwarmProtocol, stream_id: int, request: m.GetStats) -> None:
        conn.send(stream_id, m.encode(self.stats()), end=True)

    def _proof_sources(self) -> list[Path]:
        """Files that may hold the layers the host asks about: the one loaded, the one loaded beside
        it for a staged plan, then the model file."""
        loaded = self.held.gguf.path if self.held.gguf is not None else None
        standby = self.held.standby.model if self.held.standby is not None else None
        return [p for p in (loaded, standby, self.model_path) if p is not None and p.exists()]

    # --- what this trunk reports ---

    def stats(self, window_s: float = 10.0) -> m.Stats:
        """``recent_batches`` over the last ``window_s`` seconds; ``requests_detail``: what this stage holds now."""
        return stats_reply(self, now=clock.now(), wall_time=time.time(), window_s=window_s)
