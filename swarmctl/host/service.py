"""The host's service: its connections, the control messages it answers, and the liveness watch.
The plan lives in PlanKeeper (planning.py), trunk checks in ClaimChecks (checks.py), askers'
reports in AskerReports (reports.py); this class receives messages and hands them on."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Callable

from cryptography import x509

from kernels.errors import EngineError
from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from net.endpoint import Address, serve_member
from net.identity import cert_pem, revoked_reason, verify_member
from net.dispatch import Dispatcher
from net.probe import ProbeSink
from net.protocol import SwarmProtocol
from net.turn import NatRelay
from net.tls import ALPN_JOIN
from net import messages as m
from net.wire import Frame, FrameType, WireError, decode_control
from plans.hysteresis import CONVERGE_FACTOR, SERVED_REPORTS, SPEED_FACTOR, served_figure
from plans.layout import ModelLayout
from plans.nodes import Link
from plans.plan import Plan
from swarmctl.model_files.distribution import SliceManifest, build_asker_manifest, build_manifest, parse_chunk_ids, serve_slice
from swarmctl.model_files.expert_slices import build_expert_manifest
from swarmctl.node.home import SwarmHome
from swarmctl.node.membership import JoinRefused, accounts, admit
from swarmctl.model_files.models import resolve_model

from .checks import ClaimChecks
from .liveness import unanswered, watch_trunks
from .planning import PlanKeeper
from .rendezvous import NoRoute, Rendezvous
from .reports import AskerReports
from .source_reports import SourceReports
from .model_hashes import CACHE_FOLDER as HASH_CACHE_FOLDER, model_hashes
from .status import StatusSources, swarm_status
from .trunks import FetchReport, TrunkInfo, Trunks, observed, reachable_address

log = logging.getLogger("swarmctl.host")

EVIDENCE_TIMEOUT_S = 5.0  # how long the host waits for an accused stage's record (its stats)


class HostService:
    def __init__(self, home: SwarmHome) -> None:
        self.home = home
        self.config = home.load_config()
        self.creds = home.credentials()
        model_path = resolve_model(self.config.model)
        self.gguf = GGUFFile(model_path)  # kept open: the host serves slices from it
        spec = ModelSpec.from_gguf(self.gguf)
        # every tensor's hash, read once and kept in the home (a restart on the same file reads none)
        self.hashes, _ = model_hashes(self.gguf, spec.n_layer, home.file(HASH_CACHE_FOLDER))
        plan = Plan(version=0, model_name=model_path.name, n_layer=spec.n_layer,
                    head_layers=self.config.head_layers, layer_hashes=self.hashes.layers,
                    revoked_serials=sorted(home.revoked_serials()),
                    model_hash=self.hashes.model_hash,
                    objective=self.config.objective, n_expert=spec.n_expert)
        self.trunks: Trunks = {}
        self._sending_to: dict[str, asyncio.Lock] = {}  # one stream of chunks per member at a time
        self._manifests: dict[tuple[str, int, int], SliceManifest] = {}  # (kind, start, stop) → built once
        self.planning = PlanKeeper(home, self.config, ModelLayout.from_gguf(model_path), plan, self.trunks,
                                   stage_requests=self._stage_requests)
        self.checks = ClaimChecks(self.gguf, self.planning)
        self.reports = AskerReports()
        self.sources = SourceReports()  # who holds which layers for fetches, and reports of wrong chunks
        # Every authenticated connection: a member may hold several at once (its trunk, two asks,
        # serve, top), so "online" means any of them is open, and revoking closes them all.
        self.connections: dict[SwarmProtocol, None] = {}  # (a dict: in the order they came, not their addresses')
        self.last_seen: dict[str, float] = {}  # member → time.monotonic() its last connection closed (status)
        # Trunks measure their link to us (the asker's side in the planner) with a throughput probe;
        # which (trunk, peer) links came with a measured bandwidth, for status (others carry a default).
        self.probes = ProbeSink()
        self.bandwidth_measured: set[tuple[str, str]] = set()
        self._monitor: asyncio.Task | None = None
        self.server = None
        self.address: Address | None = None
        # What the host answers (net/dispatch.py). Some only certain certificates may send
        # (``Message.senders``): a trunk's messages shape the plan; the host's own CLI announces
        # revocations and new settings. A joiner (ALPN_JOIN) may send only ``join``.
        self.answers = Dispatcher({
            m.Register: self._register, m.Ready: self._ready, m.Refuse: self._refuse, m.Links: self._links_report,
            m.Speed: self._speed, m.FetchSlice: self._fetch_slice, m.FetchAskerPart: self._fetch_asker_part, m.WatchPlan: self._watch_plan,
            m.GetPlan: self._get_plan, m.GetNodes: self._nodes, m.GetStatus: self._status,
            m.Recovered: self._recovered, m.BadResult: self._bad_result,
            m.Revoked: self._revoked, m.Reconfigure: self._reconfigure,
            m.Probe: self._probe, m.Reach: self._reach, m.Unanswered: self._unanswered,
            m.BadSource: self._bad_source, m.Fetching: self._fetching, m.Cached: self._cached,
        })
        self.joins = Dispatcher({m.Join: self._join})
        self.rendezvous: Rendezvous | None = None  # once the host listens

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
        self.rendezvous = Rendezvous(self.config.name, self.trunks, NatRelay(listen.host), advertised.host,
                                     account=lambda name: self.plan.account(name))
        self._monitor = asyncio.ensure_future(watch_trunks(self.trunks, self.planning, self.reports.recovery))
        log.info("host %s listening on %s (model %s, %d layers)", self.config.name, self.address,
                 self.plan.model_name, self.plan.n_layer)
        return self.address

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        self.checks.close()
        self.planning.close()
        if self.rendezvous is not None:
            self.rendezvous.close()
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
        self.probes.connection_lost(conn)
        if conn in self.connections:
            del self.connections[conn]
            log.info("member %s disconnected%s", conn.peer_name,
                     "" if conn.peer_name not in self.online() else " (its other connections stay)")
            self.last_seen[conn.peer_name] = time.monotonic()
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None and trunk.conn is conn:
            del self.trunks[conn.peer_name]
            self.planning.lost(conn.peer_name)

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        # every host stream is one request, answered in full; a watcher's end changes nothing
        self.probes.stream_ended(conn, stream_id)  # (a probe's stream that ended short is answered)

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if self.probes.take_data(conn, stream_id, frame):  # a probe's payload (after its control frame)
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
            self._reply(conn, stream_id, m.Error(message=str(e)))
            return
        except m.MalformedMessage as e:
            self._error(conn, stream_id, str(e))
            return
        refusal = None if joining else dispatcher.refusal(request, conn.peer_role, conn.peer_name)
        if refusal is not None:
            self._error(conn, stream_id, refusal)
            return
        try:
            dispatcher.dispatch(request, conn, stream_id)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            self._error(conn, stream_id, f"malformed {kind}: {e}"[:300])
        except Exception as e:  # noqa: BLE001 - the edge: a bug answers the sender, the host carries on
            log.exception("%s from %s: unexpected error", kind, conn.peer_name)
            self._error(conn, stream_id, f"internal error: {type(e).__name__}")

    def _reply(self, conn: SwarmProtocol, stream_id: int, message: m.Message, end: bool = False) -> None:
        if conn.is_open:
            conn.send(stream_id, m.encode(message), end=end)

    def _ok(self, conn: SwarmProtocol, stream_id: int, **fields) -> None:
        self._reply(conn, stream_id, m.Ok(**fields), end=True)

    def _error(self, conn: SwarmProtocol, stream_id: int, message: str) -> None:
        self._reply(conn, stream_id, m.Error(message=message), end=True)

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
            self._error(conn, stream_id, reason)
            return
        log.info("member %s joined", message.name)
        if message.name in accounts(self.home.members()):  # another name of an invite: the stages must know now
            self.planning.push()
        self._reply(conn, stream_id, m.Joined(
            name=message.name, cert=cert_pem(cert).decode(), ca=cert_pem(self.creds.ca_cert).decode(),
            swarm_name=self.config.swarm_name, host_name=self.config.name,
            host_addresses=list(self.config.host_addresses), model_name=self.plan.model_name), end=True)

    def _revoked(self, conn: SwarmProtocol, stream_id: int, message: m.Revoked) -> None:
        if not self._from_host_itself(conn):
            self._reply(conn, stream_id, m.Error(message="only the host may announce revocations"))
            return
        revoked = self.home.revoked_serials()
        self.plan.revoked_serials = sorted(revoked)
        closed = 0
        for live in list(self.connections):
            if live.peer_cert is not None and live.peer_cert.serial_number in revoked:
                live.close_with(revoked_reason(live.peer_name))
                closed += 1
        for name, trunk in list(self.trunks.items()):  # out of the plan now, not when the close completes
            if trunk.conn.peer_cert is not None and trunk.conn.peer_cert.serial_number in revoked:
                del self.trunks[name]
        self._ok(conn, stream_id, closed=closed)
        self.planning.replan(force_push=True)

    def _reconfigure(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        """The host's own CLI after 'swarmctl config': the planner's settings again from node.json,
        and a new plan under them, pushed to everyone."""
        if not self._from_host_itself(conn):
            self._error(conn, stream_id, "only the host may change its settings")
            return
        self.planning.reconfigure(self.home.load_config())
        self._ok(conn, stream_id, plan_version=self.plan.version, objective=self.plan.objective,
                 warnings=self.plan.warnings)

    # --- trunks ---

    def _register(self, conn: SwarmProtocol, stream_id: int, message: m.Register) -> None:
        stated = Address.parse(message.listen)
        if observed(conn) is None:
            self._error(conn, stream_id, "the host does not see where your connection comes from")
            return
        # Its stated port at the IP we see: never an IP it names (trunks.reachable_address).
        listen = str(reachable_address(stated, conn))
        if stated.host not in ("0.0.0.0", "::", "") and str(stated) != listen:
            log.info("trunk %s said it is reached at %s; it is reached at %s, where its connection comes "
                     "from (addresses are observed, not claimed)", conn.peer_name, stated, listen)
        speed = message.ms_per_layer_token
        replaced = conn.peer_name in self.trunks
        trunk = self.trunks[conn.peer_name] = TrunkInfo(conn, stream_id, listen, message.memory, speed,
                                                        device=message.device, rtt_ms=message.rtt_ms,
                                                        local=message.local, relay=message.relay,
                                                        datagram_us=message.datagram_us,
                                                        prompt_ms_per_layer_row=message.prompt_ms_per_layer_row,
                                                        holds=self._layer_ranges(message.holds),
                                                        fetches=message.fetches, **_ram_offer(message))
        log.info("trunk %s registered at %s with %.1f GB, %s ms per layer%s", conn.peer_name, listen,
                 message.memory / 1e9, f"{speed:.2f}" if speed is not None else "unmeasured",
                 f", and {trunk.ram_bytes / 1e9:.1f} GB of host RAM for routed experts at {trunk.ram_gb_s:.1f} GB/s"
                 if trunk.ram_bytes else "")
        self.checks.at_registration(conn.peer_name, trunk)
        self.planning.registered(conn.peer_name, replaced=replaced)  # (a plan, sent to it)

    def _ready(self, conn: SwarmProtocol, stream_id: int, message: m.Ready) -> None:
        """A trunk says it loaded its layers: it becomes a ready stage once it proved it holds them
        (and, if the host has not timed it yet, once it was timed on one of them)."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            if message.placement != trunk.placement and message.placement not in ("", trunk.device):
                log.info("trunk %s computes its stage on %s", conn.peer_name, message.placement)
            trunk.placement = message.placement
            trunk.holds = self._layer_ranges(message.holds)
            self.checks.when_ready(conn.peer_name, trunk, message.plan_version)
        self._ok(conn, stream_id)

    def _refuse(self, conn: SwarmProtocol, stream_id: int, message: m.Refuse) -> None:
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.refused = message.reason[:300]
            log.warning("trunk %s cannot serve: %s", conn.peer_name, trunk.refused)
            self.planning.replan()
        self._ok(conn, stream_id)

    def _links(self, conn: SwarmProtocol, stream_id: int, message: m.Links) -> None:
        """A trunk's measured links: planned with once they move past the noise band, re-planned on
        only when that makes the plan materially better (plans/hysteresis.py)."""
        self.planning.consider_links(conn.peer_name, {
            peer: Link(claim.rtt_ms, claim.bandwidth_mb_s or Link().bandwidth_mb_s)
            for peer, claim in message.links.items()})
        self._ok(conn, stream_id)

    def _links_report(self, conn: SwarmProtocol, stream_id: int, message: m.Links) -> None:
        """Which reported links came with a measured bandwidth (status says which figures are
        defaults), then the report itself to ``_links``."""
        for peer, claim in message.links.items():
            if claim.bandwidth_mb_s is not None:
                self.bandwidth_measured.add((conn.peer_name, peer))
            else:
                self.bandwidth_measured.discard((conn.peer_name, peer))
        self._links(conn, stream_id, message)

    def _probe(self, conn: SwarmProtocol, stream_id: int, message: m.Probe) -> None:
        """A member measuring its link to us: answered once its bytes arrived (net/probe.py)."""
        self.probes.start(conn, stream_id, message)

    def _reach(self, conn: SwarmProtocol, stream_id: int, message: m.Reach) -> None:
        """How the sender reaches a trunk: direct, punch (the trunk is told too) or relay."""
        trunk = self.trunks.get(message.member)
        if trunk is None or not trunk.conn.is_open:
            self._error(conn, stream_id, f"{message.member!r} is not a trunk of this swarm now")
            return
        asyncio.ensure_future(self._send_route(conn, stream_id, message, trunk))

    async def _send_route(self, conn: SwarmProtocol, stream_id: int, message: m.Reach, trunk: TrunkInfo) -> None:
        try:
            route = await self.rendezvous.route(conn, message.member, trunk, message.relay, message.asking)
        except NoRoute as e:
            self._error(conn, stream_id, str(e))
            return
        self._reply(conn, stream_id, route, end=True)

    def _speed(self, conn: SwarmProtocol, stream_id: int, message: m.Speed) -> None:
        """A trunk has a new figure: measured once its fetched layers arrived, measured again, or
        seen in the batches it serves. A served figure is the best of the last few served reports,
        so what the host plans with converges to what the stage serves; the host plans with a figure once it moved past its
        band, and re-plans only on a sustained gain worth the move (plans/hysteresis.py)."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            if message.serving:  # the best of its last few served reports (plans/hysteresis.py)
                trunk.served = [*trunk.served, message.ms_per_layer_token][-SERVED_REPORTS:]
                claim, factor = served_figure(trunk.served), CONVERGE_FACTOR
            else:  # measured afresh: what it served before says less than this
                trunk.served = []
                claim, factor = message.ms_per_layer_token, SPEED_FACTOR
            trunk.ms_per_layer_token = claim  # (status shows the latest claim)
            if message.prompt_ms_per_layer_row is not None:
                trunk.prompt_ms_per_layer_row = message.prompt_ms_per_layer_row
            planned = trunk.planning_speed  # never faster than the host timed it
            if planned is None:
                log.debug("speed of %s: %.3f ms claimed, not planned on until the host has timed it",
                          conn.peer_name, claim)
            else:
                self.planning.consider_speed(conn.peer_name, planned, " as served" if message.serving else "",
                                             factor=factor)
            if planned is not None and claim * factor <= planned:  # it says it got faster: look
                self.checks.reprobe(conn.peer_name, trunk)
        self._ok(conn, stream_id)

    def _fetching(self, conn: SwarmProtocol, stream_id: int, message: m.Fetching) -> None:
        """A trunk's fetch, as it goes: for status and top, and its rate for pricing moves to it."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.took_fetch_report(FetchReport(message.what, message.done, message.total, message.bytes_per_s,
                                                message.finished))
            self.planning.fetch_progress(conn.peer_name, message.done)
        self._ok(conn, stream_id)

    def _cached(self, conn: SwarmProtocol, stream_id: int, message: m.Cached) -> None:
        """What a trunk's stage keeps as prefixes for askers' next requests: for status and top."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.cached = (message.tokens, message.kv_bytes)
        self._ok(conn, stream_id)

    async def _stage_requests(self) -> int:
        """Requests the current plan's stages hold now (each stage's own ``stats``): a re-plan on
        speed waits until there are none (swarmctl/host/planning.py). Raises when a stage cannot say."""
        held = 0
        for stage in list(self.plan.stages):
            trunk = self.trunks.get(stage.member)
            if trunk is None or not trunk.conn.is_open:
                continue
            reply = await trunk.conn.request(m.encode(m.GetStats()), timeout=5.0)
            held += m.decode(reply.body, m.Stats).routes
        return held

    def _fetch_slice(self, conn: SwarmProtocol, stream_id: int, message: m.FetchSlice) -> None:
        start, stop = message.start, message.stop
        lo, hi = self.plan.trunk_range
        if not lo <= start < stop <= hi:
            self._error(conn, stream_id, f"layers [{start}, {stop}) are not trunk layers [{lo}, {hi})")
            return
        if message.experts:  # an expert node: its experts of the layers' expert tensors
            first, last = (message.experts + [0])[:2]
            if not 0 <= first < last <= self.plan.n_expert:
                self._error(conn, stream_id, f"experts [{first}, {last}) are not among the plan's {self.plan.n_expert}")
                return
            try:
                manifest = self._manifest(("experts", start, stop, first, last), lambda: build_expert_manifest(
                    self.gguf, start, stop, first, last, self.plan.model_hash, self.hashes.chunks,
                    self.config.model_url))
            except EngineError as e:  # layers with no experts
                self._error(conn, stream_id, str(e))
                return
        else:
            manifest = self._manifest(("layers", start, stop), lambda: build_manifest(
                self.gguf, start, stop, self.plan.model_hash, self.hashes.chunks, self.config.model_url))
        if message.want is None or message.want == []:
            log.info("sending %s to %s (%d chunks already there)", manifest.describe(), conn.peer_name,
                     len(message.have))
        self._start_sending(conn, stream_id, manifest, message.have, message.want)

    def _fetch_asker_part(self, conn: SwarmProtocol, stream_id: int, message: m.FetchAskerPart) -> None:
        """An asker with no model file: what it runs, with the plan's head layers (no others). One
        stream of chunks per member at a time (the host's uplink is everyone's); a member's next
        batch waits for its last."""
        if message.head_layers != self.plan.head_layers:
            self._error(conn, stream_id, f"this swarm's askers keep {self.plan.head_layers} layers at each end, "
                                         f"not {message.head_layers}")
            return
        manifest = self._manifest(("asker", message.head_layers, message.head_layers), lambda: build_asker_manifest(
            self.gguf, message.head_layers, self.plan.model_hash, self.hashes.chunks, self.config.model_url))
        if message.want is None or message.want == []:
            log.info("sending the asker's part (%.1f MB) to %s (%d chunks already there)", manifest.n_bytes / 1e6,
                     conn.peer_name, len(message.have))
        self._start_sending(conn, stream_id, manifest, message.have, message.want)

    def _manifest(self, key: tuple, build: Callable[[], SliceManifest]) -> SliceManifest:
        """A slice's manifest, built once (each batch of a fetch names its chunks by it)."""
        if key not in self._manifests:
            self._manifests[key] = build()
        return self._manifests[key]

    def _start_sending(self, conn: SwarmProtocol, stream_id: int, manifest: SliceManifest, have: list[str],
                       want: list[str] | None) -> None:
        try:
            chunks = None if want is None else parse_chunk_ids(manifest, want)
        except ValueError as e:
            self._error(conn, stream_id, str(e))
            return
        holders = self._holders(conn.peer_name, manifest) if want == [] and manifest.kind != "asker" else []
        asyncio.ensure_future(self._send_slice(conn, stream_id, manifest, set(have), chunks, holders))

    def _holders(self, asker: str, manifest: SliceManifest) -> list[m.Holder]:
        """The members (trunks online, not refused, not distrusted) that say they hold some of the
        manifest's layers: the fetcher pulls from them too (source_reports.py)."""
        holders = self.sources.holders(asker, manifest.start, manifest.stop, {
            name: (t.listen, t.holds) for name, t in self.trunks.items() if t.holds and t.conn.is_open and not t.refused})
        if holders:
            log.info("members holding %s for %s: %s", manifest.describe(), asker, ", ".join(
                f"{h.name} [{h.start}, {h.stop})" for h in holders))
        return holders

    async def _send_slice(self, conn: SwarmProtocol, stream_id: int, manifest: SliceManifest, have: set[str],
                          want: list[tuple[int, int]] | None, holders: list[m.Holder] | None = None) -> None:
        lock = self._sending_to.setdefault(conn.peer_name, asyncio.Lock())
        try:
            if want == []:  # the manifest alone (and who else holds it): no need to wait
                sent = await serve_slice(conn, stream_id, self.gguf, manifest, have, want, holders)
            else:
                async with lock:
                    sent = await serve_slice(conn, stream_id, self.gguf, manifest, have, want)
        except ConnectionError:
            return
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.served_bytes += sent
        if want is None:
            log.info("sent %.1f MB of %s to %s", sent / 1e6, manifest.describe(), conn.peer_name)

    def _layer_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """What a trunk says it holds, within the model's layers (a claim: every chunk it sends is
        checked by the fetcher against our hashes)."""
        return [(a, min(b, self.plan.n_layer)) for a, b in ranges if a < min(b, self.plan.n_layer)]

    def _bad_source(self, conn: SwarmProtocol, stream_id: int, message: m.BadSource) -> None:
        """A fetching member got a wrong chunk from another: counted against it, bounded
        (source_reports.py); the host evicts nobody on it."""
        self._ok(conn, stream_id, counted=[message.member] if self.sources.report(
            conn.peer_name, message.member, message.reason) else [])

    # --- anyone ---

    def _watch_plan(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        self.planning.watch(conn, stream_id)

    def _get_plan(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        self._reply(conn, stream_id, m.PlanPush(plan=self.plan.to_dict()), end=True)

    def _nodes(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        self._reply(conn, stream_id, m.Nodes(nodes=self.planning.inputs.describe_nodes()), end=True)

    def _status(self, conn: SwarmProtocol, stream_id: int, message: m.Message) -> None:
        self._reply(conn, stream_id, self.status(), end=True)

    def status(self) -> m.Status:
        # the host's address as members reach it (what init advertised), not its listen address
        # (which is 0.0.0.0 by default)
        advertised = self.config.host_addresses[0] if self.config.host_addresses else str(self.address)
        return swarm_status(StatusSources(self.home, self.config.name, advertised, self.config.swarm_name,
                                          self.plan, self.trunks, self.online(), self.reports,
                                          self.bandwidth_measured, self.rendezvous, last_seen=self.last_seen,
                                          staged=self.planning.staged))

    def _recovered(self, conn: SwarmProtocol, stream_id: int, message: m.Recovered) -> None:
        self.reports.recovered(message.recovery_s, message.replayed_bytes)
        self._ok(conn, stream_id)

    def _unanswered(self, conn: SwarmProtocol, stream_id: int, message: m.Unanswered) -> None:
        """A stage's expert calls to a member went unanswered: judged by our own link now."""
        unanswered(message.member, conn.peer_name, self.trunks, self.planning, self.reports.recovery)
        self._ok(conn, stream_id)

    def _bad_result(self, conn: SwarmProtocol, stream_id: int, message: m.BadResult) -> None:
        """An asker's spot check caught a wrong result. A report naming a whole route is counted
        for status only. One whose re-check stage by stage named a member counts only with the
        accused stage's own record of the accuser's re-check steps (reports.py), and then only
        makes the host check the member itself (checks.py, recheck.py): the host's own check
        decides, never the askers' word, from however many invites."""
        serving = {s.member for s in self.plan.stages} | set(self.trunks)
        if not message.attributed:
            self._ok(conn, stream_id, counted=self.reports.bad_result(conn.peer_name, message, serving))
            return
        if conn.peer_name in self.reports.judging:  # one report of a member's judged at a time: the
            self._ok(conn, stream_id, counted=[])  # host asks the accused stage once per report
            return
        self.reports.judging.add(conn.peer_name)
        asyncio.ensure_future(self._attributed(conn, stream_id, message, serving))

    async def _attributed(self, conn: SwarmProtocol, stream_id: int, message: m.BadResult, serving: set[str]) -> None:
        counted = []
        try:
            for name in AskerReports.named(conn.peer_name, message, serving):
                trunk = self.trunks.get(name)
                if trunk is None or trunk.refused or self.plan.stage_for(name) is None:
                    continue
                record = await self._one_stage_record(trunk)
                if self.trunks.get(name) is not trunk:
                    continue
                if self.reports.found(conn.peer_name, self.plan.account(conn.peer_name), name, trunk.registered_at,
                                      message, record):
                    counted.append(name)
                    self.checks.recheck(name, trunk)
        except Exception:  # noqa: BLE001 - the edge, as in frame_received: the host carries on
            log.exception("bad_result from %s: unexpected error", conn.peer_name)
        finally:
            self.reports.judging.discard(conn.peer_name)
            self._ok(conn, stream_id, counted=counted)

    async def _one_stage_record(self, trunk: TrunkInfo) -> dict[str, list[int]]:
        """The stage's own record of who re-checked it (swarmctl/trunk/one_stage.py); {} when it
        does not answer in time or at all."""
        try:
            reply = await trunk.conn.request(m.encode(m.GetStats()), timeout=EVIDENCE_TIMEOUT_S)
            return m.decode(reply.body, m.Stats).one_stage
        except (ConnectionError, asyncio.TimeoutError, WireError, m.Refused) as e:
            log.info("no record of re-checks from trunk %s: %s", trunk.conn.peer_name, e)
            return {}


async def run_host(home: SwarmHome, stop: asyncio.Event, ready_file=None) -> None:
    service = HostService(home)
    address = await service.start()
    if ready_file is not None:
        ready_file.write_text(str(address))
    try:
        await stop.wait()
    finally:
        service.close()


def _ram_offer(message: m.Register) -> dict:
    """A trunk's host RAM for routed experts, planned on only with its rate and only beside a device
    (a trunk on the CPU offers its RAM as its memory already)."""
    if not message.ram_bytes or message.ram_gb_s is None or message.device == "cpu":
        return {}
    return {"ram_bytes": message.ram_bytes, "ram_gb_s": message.ram_gb_s}
