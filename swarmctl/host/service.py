"""The host's service: its connections and the control messages it answers, each handed to the
part whose job it is: PlanKeeper (planning.py) keeps the plan, ClaimChecks (checks.py) checks what
trunks claim, TrunkReports (trunk_reports.py) takes what trunks say of themselves, SliceServer
(slices.py) serves the model file, Reaching (reaching.py) links and routes, Accusations
(accusations.py) what members report against others. Membership (join, revocations, new settings)
and the plan's readers are answered here; revocations the CLI could not tell are read from the
member records (revocations.py)."""

from __future__ import annotations

import asyncio
import base64
import logging

from cryptography import x509

from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from net.endpoint import Address, serve_member
from net.identity import cert_pem, revoked_reason, verify_member
from net import clock
from net.dispatch import Dispatcher
from net.protocol import SwarmProtocol
from net.turn import NatRelay
from net.tls import ALPN_JOIN
from net import messages as m
from net.wire import Frame, FrameType, WireError, decode_control
from plans.layout import ModelLayout
from plans.options import PlannerSettings
from plans.plan import Plan
from swarmctl.node.home import SwarmHome
from swarmctl.node.membership import JoinRefused, accounts, admit
from swarmctl.model_files.models import resolve_model

from .accusations import Accusations
from .checks import ClaimChecks
from .liveness import watch_trunks
from .planning import PlanKeeper
from .reaching import Reaching
from .rendezvous import Rendezvous
from .replies import error, ok, reply
from .revocations import watch_revocations
from .reports import AskerReports
from .model_hashes import CACHE_FOLDER as HASH_CACHE_FOLDER, model_hashes
from .slices import SliceServer
from .stage_stats import stage_requests
from .status import StatusSources, swarm_status
from .trunk_reports import TrunkReports
from .trunks import Trunks

log = logging.getLogger("swarmctl.host")


class HostService:
    def __init__(self, home: SwarmHome, upload_mbit: float | None = None) -> None:
        self.home = home
        self.config = home.load_config()
        self.creds = home.credentials()
        model_path = resolve_model(self.config.model)
        self.gguf = GGUFFile(model_path)  # kept open: the host serves slices from it
        spec = ModelSpec.from_gguf(self.gguf)
        # every tensor's hash, read once and kept in the home (a restart on the same file reads none)
        self.hashes, _ = model_hashes(self.gguf, spec.n_layer, home.file(HASH_CACHE_FOLDER))
        # Version 0 already names the swarm's kernels and attention: an asker watching from the start
        # (a local swarm, `serve` started with the swarm) would otherwise see the setting change at
        # the first real plan and warn that its head and tail keep the old one, before it loaded them.
        settings = PlannerSettings.from_config(self.config)
        plan = Plan(version=0, model_name=model_path.name, n_layer=spec.n_layer,
                    head_layers=self.config.head_layers, layer_hashes=self.hashes.layers,
                    revoked_serials=sorted(home.revoked_serials()),
                    model_hash=self.hashes.model_hash,
                    objective=self.config.objective, n_expert=spec.n_expert,
                    kernels=settings.kernels, attention=settings.attention)
        self.trunks: Trunks = {}
        self.planning = PlanKeeper(home, self.config, ModelLayout.from_gguf(model_path), plan, self.trunks,
                                   stage_requests=lambda: stage_requests(self.plan, self.trunks))
        self.checks = ClaimChecks(self.gguf, self.planning)
        self.reports = AskerReports()
        self.trunk_reports = TrunkReports(self.trunks, self.planning, self.checks)
        self.slices = SliceServer(self.gguf, self.hashes, self.config.model_url, lambda: self.plan, self.trunks,
                                  upload_mbit)
        self.reaching = Reaching(self.trunks, self.planning)
        self.accusations = Accusations(self.trunks, self.planning, self.checks, self.reports)
        # Every authenticated connection: a member may hold several at once (its trunk, two asks,
        # serve, top), so "online" means any of them is open, and revoking closes them all.
        self.connections: dict[SwarmProtocol, None] = {}  # (a dict: in the order they came, not their addresses')
        self.last_seen: dict[str, float] = {}  # member → clock.now() as its last connection closed (status)
        self._monitor: asyncio.Task | None = None
        self._records: asyncio.Task | None = None  # revocations written while this host did not hear the CLI
        self.server = None
        self.address: Address | None = None
        # What the host answers (net/dispatch.py). Some only certain certificates may send
        # (``Message.senders``): a trunk's messages shape the plan; the host's own CLI announces
        # revocations and new settings. A joiner (ALPN_JOIN) may send only ``join``.
        said, slices, reaching, accused = self.trunk_reports, self.slices, self.reaching, self.accusations
        self.answers = Dispatcher({
            m.Register: said.register, m.Ready: said.ready, m.Refuse: said.refuse, m.Speed: said.speed,
            m.Fetching: said.fetching, m.Cached: said.cached,
            m.FetchSlice: slices.fetch_slice, m.FetchAskerPart: slices.fetch_asker_part, m.BadSource: slices.bad_source,
            m.Links: reaching.links, m.Probe: reaching.probe, m.Reach: reaching.reach,
            m.Recovered: accused.recovered, m.BadResult: accused.bad_result, m.Unanswered: accused.unanswered,
            m.WatchPlan: self._watch_plan, m.GetPlan: self._get_plan, m.GetNodes: self._nodes,
            m.GetStatus: self._status, m.Revoked: self._revoked, m.Reconfigure: self._reconfigure,
        })
        self.joins = Dispatcher({m.Join: self._join})

    @property
    def plan(self) -> Plan:
        return self.planning.plan

    async def start(self) -> Address:
        listen = Address.parse(self.config.listen)
        self.server = await serve_member(listen, self.creds, self, client_check=self._check_member,
                                         accept_joins=True)
        port = self.server._transport.get_extra_info("sockname")[1]
        self.address = Address(listen.host, port)
        advertised = Address.parse(self.config.host_addresses[0]) if self.config.host_addresses else self.address
        self.reaching.rendezvous = Rendezvous(self.config.name, self.trunks, NatRelay(listen.host), advertised.host,
                                              account=lambda name: self.plan.account(name))
        self._monitor = asyncio.ensure_future(watch_trunks(self.trunks, self.planning, self.reports.recovery))
        self._records = asyncio.ensure_future(watch_revocations(
            self.home, known=lambda: frozenset(self.plan.revoked_serials), revoke=self.revoke))
        log.info("host %s listening on %s (model %s, %d layers)", self.config.name, self.address,
                 self.plan.model_name, self.plan.n_layer)
        return self.address

    def close(self) -> None:
        for task in (self._monitor, self._records):
            if task is not None:
                task.cancel()
        self.checks.close()
        self.planning.close()
        self.reaching.close()
        for conn in list(self.connections):
            conn.close_with("host shutting down")
        if self.server is not None:
            self.server.close()
        self.gguf.close()

    def _check_member(self, cert: x509.Certificate) -> None:
        verify_member(cert, self.creds.ca_cert, self.home.revoked_serials())

    def _from_host_itself(self, conn: SwarmProtocol) -> bool:
        return conn.peer_cert is not None and conn.peer_cert.serial_number == self.creds.cert.serial_number

    # --- ConnectionHandler ---

    def online(self) -> set[str]:
        """Members with at least one open connection."""
        return {c.peer_name for c in self.connections if c.is_open}

    def connection_made(self, conn: SwarmProtocol) -> None:
        if conn.peer_name:
            self.connections[conn] = None
            log.info("member %s connected", conn.peer_name)

    def connection_lost(self, conn: SwarmProtocol) -> None:
        self.reaching.probes.connection_lost(conn)
        if conn in self.connections:
            del self.connections[conn]
            log.info("member %s disconnected%s", conn.peer_name,
                     "" if conn.peer_name not in self.online() else " (its other connections stay)")
            self.last_seen[conn.peer_name] = clock.now()
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None and trunk.conn is conn:
            del self.trunks[conn.peer_name]
            self.planning.lost(conn.peer_name)

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        # every host stream is one request, answered in full; a watcher's end changes nothing
        self.reaching.probes.stream_ended(conn, stream_id)  # (a probe's stream that ended short is answered)

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if self.reaching.probes.take_data(conn, stream_id, frame):  # a probe's payload (after its control frame)
            return
        if self.checks.answers.take(conn, stream_id, frame):  # a stage's answer to the host's re-check (recheck.py)
            return
        if frame.type != FrameType.CONTROL:
            conn.reject_stream(stream_id, "the host accepts only control messages")
            return
        try:
            message = decode_control(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        kind = message["type"]
        joining = conn.alpn == ALPN_JOIN
        if joining and kind != "join":
            conn.reject_stream(stream_id, "only 'join' is accepted before joining")
            return
        dispatcher = self.joins if joining else self.answers
        try:
            request = dispatcher.parse(message)
        except m.UnknownMessage as e:
            reply(conn, stream_id, m.Error(message=str(e)))
            return
        except m.MalformedMessage as e:
            error(conn, stream_id, str(e))
            return
        refusal = None if joining else dispatcher.refusal(request, conn.peer_role, conn.peer_name)
        if refusal is not None:
            error(conn, stream_id, refusal)
            return
        try:
            dispatcher.dispatch(request, conn, stream_id)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            error(conn, stream_id, f"malformed {kind}: {e}"[:300])
        except Exception as e:  # noqa: BLE001 - the edge: a bug answers the sender, the host carries on
            log.exception("%s from %s: unexpected error", kind, conn.peer_name)
            error(conn, stream_id, f"internal error: {type(e).__name__}")

    # --- membership ---

    def _join(self, conn: SwarmProtocol, stream_id: int, message: m.Join) -> None:
        asyncio.ensure_future(self._admit(conn, stream_id, message))

    async def _admit(self, conn: SwarmProtocol, stream_id: int, message: m.Join) -> None:
        try:
            secret = base64.urlsafe_b64decode(message.secret + "==")
            cert = await asyncio.to_thread(admit, self.home, token_id=message.token_id, secret=secret,
                                           csr_pem=message.csr.encode(), name=message.name)
        except (JoinRefused, ValueError) as e:
            reason = str(e) if isinstance(e, JoinRefused) else "malformed join request"
            log.warning("join refused: %s", reason)
            error(conn, stream_id, reason)
            return
        log.info("member %s joined", message.name)
        if message.name in accounts(self.home.members()):  # another name of an invite: the stages must know now
            self.planning.push()
        reply(conn, stream_id, m.Joined(
            name=message.name, cert=cert_pem(cert).decode(), ca=cert_pem(self.creds.ca_cert).decode(),
            swarm_name=self.config.swarm_name, host_name=self.config.name,
            host_addresses=list(self.config.host_addresses), model_name=self.plan.model_name), end=True)

    def _revoked(self, conn: SwarmProtocol, stream_id: int, message: m.Revoked) -> None:
        if not self._from_host_itself(conn):
            reply(conn, stream_id, m.Error(message="only the host may announce revocations"))
            return
        ok(conn, stream_id, closed=self.revoke(self.home.revoked_serials()))

    def revoke(self, revoked: frozenset[int]) -> int:
        """Every connection of a revoked certificate closed and its trunk out of the plan, now, and a
        new plan pushed (its revoked serials tell the stages); returns how many connections closed."""
        self.plan.revoked_serials = sorted(revoked)
        closed = 0
        for live in list(self.connections):
            if live.peer_cert is not None and live.peer_cert.serial_number in revoked:
                live.close_with(revoked_reason(live.peer_name))
                closed += 1
        for name, trunk in list(self.trunks.items()):  # out of the plan now, not when the close completes
            if trunk.conn.peer_cert is not None and trunk.conn.peer_cert.serial_number in revoked:
                del self.trunks[name]
        self.planning.replan(force_push=True)
        return closed

    def _reconfigure(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        """The host's own CLI after 'swarmctl config': the planner's settings again from node.json,
        and a new plan under them, pushed to everyone."""
        if not self._from_host_itself(conn):
            error(conn, stream_id, "only the host may change its settings")
            return
        self.planning.reconfigure(self.home.load_config())
        ok(conn, stream_id, plan_version=self.plan.version, objective=self.plan.objective,
           warnings=self.plan.warnings)

    # --- anyone ---

    def _watch_plan(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        self.planning.watch(conn, stream_id)

    def _get_plan(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        reply(conn, stream_id, m.PlanPush(plan=self.plan.to_dict()), end=True)

    def _nodes(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        reply(conn, stream_id, m.Nodes(nodes=self.planning.inputs.describe_nodes()), end=True)

    def _status(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        reply(conn, stream_id, self.status(), end=True)

    def status(self) -> m.Status:
        # the host's address as members reach it (what init advertised), not its listen address
        # (which is 0.0.0.0 by default)
        advertised = self.config.host_addresses[0] if self.config.host_addresses else str(self.address)
        return swarm_status(StatusSources(self.home, self.config.name, advertised, self.config.swarm_name,
                                          self.plan, self.trunks, self.online(), self.reports,
                                          self.reaching.bandwidth_measured, self.reaching.rendezvous,
                                          last_seen=self.last_seen, staged=self.planning.staged))


async def run_host(home: SwarmHome, stop: asyncio.Event, ready_file=None, upload_mbit: float | None = None) -> None:
    """The host until ``stop``; ``upload_mbit``: a cap on the slices it serves (None: none)."""
    service = HostService(home, upload_mbit)
    address = await service.start()
    if ready_file is not None:
        ready_file.write_text(str(address))
    try:
        await stop.wait()
    finally:
        service.close()
