"""The host role: membership, joins, and the plan (who serves which layers).

Control messages (JSON frames, one request per stream unless noted):

    join        {token_id, secret, csr, name}          joiner (join ALPN) → host → joined | error
    register    {listen, memory, ms_per_layer_token,   trunk → host; the stream stays open and
                 device, rtt_ms}                       the host sends every new plan on it
    links       {links: {peer: {rtt_ms, bandwidth_mb_s}}}  trunk's measured links → ok
    speed       {ms_per_layer_token}                   a trunk's new figure (measured after a fetch or again,
                                                       or seen while serving) → ok; re-plans if material
    recovered   {recovery_s, replayed_bytes}           an asker rerouted a request after a failure → ok
    bad_result  {members, plan_version, layers, ...}   an asker's spot check (--verify) caught its route
                                                       returning a wrong result → ok (counted, shown in status)
    watch_plan  {}                                     asker → plan now, and every new plan after
    fetch_slice {start, stop, have}                    a trunk without the model → manifest, data
    nodes       {}                                     anyone → the planner's view of the members
    ready       {plan_version}                         trunk loaded its layers → ok
    refuse      {reason}                               trunk cannot serve (e.g. model mismatch) → ok
    get_plan    {}                                     anyone → plan
    status      {}                                     anyone → status
    revoked     {}                                     the host's own CLI after 'swarmctl revoke' → ok
    reconfigure {}                                     the host's own CLI after 'swarmctl config' → ok

The host asks too (host → trunk, on new streams of the trunk's register connection): ``prove``,
``probe_run``, ``probe_reveal`` (swarmctl/layer_proof.py). A trunk becomes a ready stage only once
it proved it holds its layers, and a claimed speed is planned on only once the host timed the
trunk itself, and never faster than it timed it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import secrets
import statistics
import time
from dataclasses import dataclass, field

from cryptography import x509

from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from net.endpoint import Address, serve_member
from net.identity import REVOKED_REASON, cert_pem, verify_member
from net.liveness import SilenceClock
from net.protocol import SwarmProtocol
from net.tls import ALPN_JOIN
from net.wire import Frame, FrameType, WireError, decode_control, encode_control
from plans.layout import ModelLayout
from plans.nodes import ASKER, Link, NodeDescriptor
from plans.plan import ExpertAssignment, Plan
from plans.hysteresis import SPEED_FACTOR, SpeedDecision, decide_on_speed, sticky_speed
from plans.planner import Constraints, PlanError, add_expert_calls, place_experts, plan_layers
from swarmctl import claims, layer_proof
from swarmctl.distribution import build_manifest, serve_slice
from swarmctl.home import SwarmHome
from swarmctl.log_limit import LogLimit
from swarmctl.membership import JoinRefused, admit
from swarmctl.models import resolve_model

log = logging.getLogger("swarmctl.host")


DEFAULT_MS_PER_LAYER = 1.0  # for a trunk that could not measure yet (it has no model file)
SILENCE_LIMIT = 4.0  # seconds without a datagram (trunks ping every second) before a trunk is marked down
FAILED_CHECK_HOLD_S = 300.0  # a member that failed a layer check is refused again if it re-registers this soon
REPROBES = 3  # a claim faster than the host measured is timed again this often, after 10, 20, 40 s
REPROBE_AFTER_S = 10.0


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def reachable_address(stated: Address, conn: SwarmProtocol) -> Address:
    """Where the swarm reaches a trunk: the address it stated (its ``--advertise``, or a specific
    listen address), or, when it listens on every interface (README's default ``0.0.0.0:7471``),
    its listen port at the IP its connection to this host comes from."""
    seen = conn.peer_address
    if stated.host not in WILDCARD_HOSTS or seen is None:
        return stated
    return Address(seen[0], stated.port)


# Messages only some certificates may send (the rest: any member). A trunk's messages shape the
# plan; the host's own CLI announces revocations and new settings.
ROLES_ALLOWED: dict[str, tuple[str, ...]] = {
    "register": ("trunk",), "ready": ("trunk",), "refuse": ("trunk",), "links": ("trunk",), "speed": ("trunk",),
    "fetch_slice": ("trunk",), "revoked": ("host",), "reconfigure": ("host",),
}


@dataclass
class TrunkInfo:
    conn: SwarmProtocol
    plan_stream: int  # the register stream; new plans go out on it
    listen: str
    memory: int
    ms_per_layer_token: float | None = None  # measured at join; None until the trunk has the model
    device: str = "cpu"
    rtt_ms: float | None = None  # to the host, which stands in for the asker when planning
    links: dict[str, Link] = field(default_factory=dict)
    registered_at: float = field(default_factory=time.time)
    refused: str = ""  # why it cannot serve, if it said so
    served_bytes: int = 0  # slice bytes the host sent it
    # What the host saw itself (swarmctl/layer_proof.py): a claimed speed is planned on only once
    # the host has timed the trunk, and never faster than the host timed it.
    measured_ms_per_layer: float | None = None  # the fastest verified probe so far
    checking: bool = False  # its claims are being checked: not planned until they are
    unchecked: bool = False  # not timed yet: planned with the others' figure, not with its claim
    reprobes: int = 0
    excused: bool = False  # a late answer to a layer check was excused (the plan had moved meanwhile)
    proving: tuple[int, int, int] | None = None  # (plan version, start, stop) of a layer check in flight

    @property
    def planning_speed(self) -> float | None:
        """The figure the host plans this trunk with (None: the others' median)."""
        return self.planning_speed_with(self.ms_per_layer_token)

    def planning_speed_with(self, claim: float | None) -> float | None:
        if self.measured_ms_per_layer is not None:
            return max(claim or 0.0, self.measured_ms_per_layer)
        return None if self.unchecked else claim


class HostService:
    def __init__(self, home: SwarmHome) -> None:
        self.home = home
        self.config = home.load_config()
        self.creds = home.credentials()
        self.model_path = resolve_model(self.config.model)
        self.gguf = GGUFFile(self.model_path)  # kept open: the host serves slices from it
        spec = ModelSpec.from_gguf(self.gguf)
        hashes = [self.gguf.layer_hash(i) for i in range(spec.n_layer)]
        self.layout = ModelLayout.from_gguf(self.model_path)
        self.plan = Plan(version=0, model_name=self.model_path.name, n_layer=spec.n_layer,
                         head_layers=self.config.head_layers, layer_hashes=hashes,
                         revoked_serials=sorted(home.revoked_serials()),
                         model_hash=hashlib.sha256("".join(hashes).encode()).hexdigest(),
                         objective=self.config.objective, n_expert=spec.n_expert)
        self.constraints = Constraints(self.config.head_layers, self.config.plan_context,
                                       self.config.plan_concurrent, self.config.objective,
                                       max_stages=self.config.plan_max_stages)
        self.trunks: dict[str, TrunkInfo] = {}
        # The speed each member is planned with: a new figure replaces it only when it moved by
        # SPEED_FACTOR or more (plans/hysteresis.py), so a wobble reshuffles no plan.
        self.speed_basis: dict[str, float] = {}
        self.watchers: list[tuple[SwarmProtocol, int]] = []  # askers following the plan
        self.plan.version = self._load_plan_version()  # a restarted host continues the numbering
        self.recovery = {"recoveries": 0, "replayed_bytes": 0, "last_recovery_s": None, "last_marked_down": None}
        self.bad_results: dict[str, dict[str, int]] = {}  # accused member → {accusing member: reports}
        self._bad_result_log = LogLimit(log)  # a flood of reports must not fill the disk
        self._monitor: asyncio.Task | None = None
        # Every authenticated connection: a member may hold several at once (its trunk, two asks,
        # serve, top), so "online" means any of them is open, and revoking closes them all.
        self.connections: set[SwarmProtocol] = set()
        self.failed_checks: dict[str, float] = {}  # member → time.monotonic() it failed a layer check
        self.measured_speeds: dict[str, float] = {}  # member → the fastest the host timed it (kept across rejoins)
        self._timing_lock = asyncio.Lock()  # one speed probe at a time
        self._checks: set[asyncio.Task] = set()
        self.server = None
        self.address: Address | None = None

    async def start(self) -> Address:
        listen = Address.parse(self.config.listen)
        self.server = await serve_member(listen, self.creds, self, client_check=self._check_member,
                                         accept_joins=True)
        port = self.server._transport.get_extra_info("sockname")[1]
        self.address = Address(listen.host, port)
        self._monitor = asyncio.ensure_future(self._watch_liveness())
        log.info("host %s listening on %s (model %s, %d layers)", self.config.name, self.address,
                 self.plan.model_name, self.plan.n_layer)
        return self.address

    def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for conn in list(self.connections):
            conn.close_with("host shutting down")
        if self.server is not None:
            self.server.close()
        self.gguf.close()

    async def _watch_liveness(self) -> None:
        """A trunk that falls silent (killed, asleep, off the network) is marked down within
        seconds, and the plan moves to the survivors."""
        clock = SilenceClock(1.0)
        while True:
            await asyncio.sleep(clock.interval)
            clock.tick()
            for name, trunk in list(self.trunks.items()):
                silent = clock.silence(trunk.conn)
                if silent > SILENCE_LIMIT:
                    log.warning("trunk %s silent for %.1fs: marked down", name, silent)
                    self.recovery["last_marked_down"] = name
                    trunk.conn.close_with("silent too long")
                    if self.trunks.get(name) is trunk:
                        del self.trunks[name]
                        try:
                            self._replan()
                        except Exception:  # noqa: BLE001 - the watcher must outlive any one bad plan
                            log.exception("re-planning after %s went silent failed", name)

    def _load_plan_version(self) -> int:
        try:
            return int(self.home.file("plan_version").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def _save_plan_version(self) -> None:
        from net.identity import write_public

        write_public(self.home.file("plan_version"), str(self.plan.version).encode())

    def _check_member(self, cert: x509.Certificate) -> None:
        verify_member(cert, self.creds.ca_cert, self.home.revoked_serials())

    # --- ConnectionHandler ---

    def online(self) -> set[str]:
        """Members with at least one open connection."""
        return {c.peer_name for c in self.connections if c.is_open}

    def connection_made(self, conn: SwarmProtocol) -> None:
        if conn.peer_name:
            self.connections.add(conn)
            log.info("member %s connected", conn.peer_name)

    def connection_lost(self, conn: SwarmProtocol) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            log.info("member %s disconnected%s", conn.peer_name,
                     "" if conn.peer_name not in self.online() else " (its other connections stay)")
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None and trunk.conn is conn:
            del self.trunks[conn.peer_name]
            self._replan()

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        pass

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if frame.type != FrameType.CONTROL:
            conn.reject_stream(stream_id, "the host accepts only control messages")
            return
        try:
            message = decode_control(frame.body)
        except WireError as e:
            conn.reject_stream(stream_id, str(e))
            return
        if conn.alpn == ALPN_JOIN:
            if message["type"] != "join":
                conn.reject_stream(stream_id, "only 'join' is accepted before joining")
                return
            asyncio.ensure_future(self._join(conn, stream_id, message))
            return
        handler = {
            "register": self._register, "ready": self._ready, "refuse": self._refuse,
            "get_plan": self._get_plan, "status": self._status, "revoked": self._revoked,
            "reconfigure": self._reconfigure,
            "links": self._links, "watch_plan": self._watch_plan, "fetch_slice": self._fetch_slice,
            "nodes": self._nodes, "speed": self._speed, "recovered": self._recovered,
            "bad_result": self._bad_result,
        }.get(message["type"])
        if handler is None:
            self._reply(conn, stream_id, {"type": "error", "message": f"unknown request {message['type']!r}"})
            return
        allowed = ROLES_ALLOWED.get(message["type"])
        if allowed is not None and conn.peer_role not in allowed:
            self._reply(conn, stream_id, {"type": "error", "message": f"{message['type']!r} needs a "
                                          f"{' or '.join(allowed)} certificate; {conn.peer_name} joined as "
                                          f"{conn.peer_role}"}, end=True)
            return
        try:
            handler(conn, stream_id, message)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            self._reply(conn, stream_id, {"type": "error", "message": f"malformed {message['type']}: {e}"[:300]},
                        end=True)
        except Exception as e:  # noqa: BLE001 - the edge: a bug answers the sender, the host carries on
            log.exception("%s from %s: unexpected error", message["type"], conn.peer_name)
            self._reply(conn, stream_id, {"type": "error", "message": f"internal error: {type(e).__name__}"},
                        end=True)

    # --- requests ---

    async def _join(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        try:
            secret = base64.urlsafe_b64decode(str(message["secret"]) + "==")
            cert = await asyncio.to_thread(admit, self.home, token_id=str(message["token_id"]), secret=secret,
                                           csr_pem=str(message["csr"]).encode(), name=str(message["name"]))
        except (JoinRefused, KeyError, ValueError) as e:
            reason = str(e) if isinstance(e, JoinRefused) else "malformed join request"
            log.warning("join refused: %s", reason)
            self._reply(conn, stream_id, {"type": "error", "message": reason}, end=True)
            return
        log.info("member %s joined", message["name"])
        self._reply(conn, stream_id, {
            "type": "joined", "name": message["name"], "cert": cert_pem(cert).decode(),
            "ca": cert_pem(self.creds.ca_cert).decode(), "swarm_name": self.config.swarm_name,
            "host_name": self.config.name, "host_addresses": self.config.host_addresses,
            "model_name": self.plan.model_name}, end=True)

    def _register(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        listen = str(reachable_address(Address.parse(str(message["listen"])), conn))
        memory = claims.memory(message["memory"])
        speed = claims.ms_per_layer(message.get("ms_per_layer_token"))
        rtt = claims.rtt_ms(message.get("rtt_ms"))
        trunk = self.trunks[conn.peer_name] = TrunkInfo(conn, stream_id, listen, memory, speed,
                                                        str(message.get("device", "cpu"))[:64], rtt)
        log.info("trunk %s registered at %s with %.1f GB, %s ms per layer", conn.peer_name, listen, memory / 1e9,
                 f"{speed:.2f}" if speed is not None else "unmeasured")
        self._check_claims(conn.peer_name, trunk)
        self._replan(also_send_to=conn.peer_name)

    def _links(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.links = {peer: Link(rtt, bandwidth or Link().bandwidth_mb_s)
                           for peer, (rtt, bandwidth) in claims.links(message["links"]).items()}
        self._reply(conn, stream_id, {"type": "ok"}, end=True)

    def _recovered(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        """An asker rerouted a request after a failure: how long it took, how much it replayed."""
        replayed = int(claims.number(message["replayed_bytes"], 0, claims.MAX_MEMORY, "replayed_bytes"))
        seconds = claims.number(message["recovery_s"], 0, 86400, "recovery_s")
        self.recovery["recoveries"] += 1
        self.recovery["replayed_bytes"] += replayed
        self.recovery["last_recovery_s"] = seconds
        self._reply(conn, stream_id, {"type": "ok"}, end=True)

    def _bad_result(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        """An asker recomputed a step itself (swarmctl/verify.py) and its route's result was wrong.
        Counted per accused member and accuser, logged, shown in status; nothing more. One
        asker's word removes no trunk: the host cannot check the claim (it never sees the asker's
        activations), so a lying asker could otherwise evict honest trunks one by one. The accuser
        already routes around the trunk for itself; the operator decides (``swarmctl revoke``)."""
        members = message["members"]
        if not isinstance(members, list) or not 0 < len(members) <= 64:
            raise ValueError("members must be a list of 1 to 64 names")
        serving = {s.member for s in self.plan.stages} | set(self.trunks)
        counted = sorted({str(m)[:64] for m in members} & serving - {conn.peer_name})
        for name in counted:
            by = self.bad_results.setdefault(name, {})
            by[conn.peer_name] = by.get(conn.peer_name, 0) + 1
        tally = "; ".join(f"{n}: {sum(self.bad_results[n].values())} reports from {len(self.bad_results[n])} members"
                          for n in counted) or "ignored"
        self._bad_result_log.warning("%s reports a wrong result from %s (plan v%s, relative error %s): %s",
                                     conn.peer_name, " / ".join(counted) or "no serving member",
                                     str(message.get("plan_version"))[:12], str(message.get("rel_error"))[:12], tally)
        self._reply(conn, stream_id, {"type": "ok", "counted": counted}, end=True)

    def _speed(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        """A trunk has a new figure: measured once its fetched layers arrived, measured again, or
        seen while serving. The host plans with it if it moved materially, and re-plans now only
        if that makes the plan materially better (plans/hysteresis.py)."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            figure = claims.number(message["ms_per_layer_token"], *claims.MS_PER_LAYER, "ms_per_layer_token")
            planned = trunk.planning_speed_with(figure)  # never faster than the host timed it
            decision = self._speed_decision(conn.peer_name, planned) if planned is not None else None
            trunk.ms_per_layer_token = figure  # (status shows the latest claim)
            if decision is None:
                log.debug("speed of %s: %.3f ms claimed, not planned on until the host has timed it",
                          conn.peer_name, figure)
            else:
                if decision.adopt or conn.peer_name not in self.speed_basis:
                    self.speed_basis[conn.peer_name] = planned
                (log.info if decision.adopt else log.debug)("speed of %s: %s", conn.peer_name, decision.reason)
                if decision.replan:
                    self._replan()
            if planned is not None and figure * SPEED_FACTOR <= planned:  # it says it got faster: look
                self._reprobe(conn.peer_name, trunk)
        self._reply(conn, stream_id, {"type": "ok"}, end=True)

    def _speed_decision(self, name: str, figure: float) -> SpeedDecision:
        nodes = self._descriptors()
        try:
            placement = place_experts(self.layout, nodes, self.constraints, self.config.expert_nodes)
        except PlanError as e:
            return SpeedDecision(True, False, f"no plan to compare with: {e}")
        current = [(s.member, s.start, s.stop) for s in self.plan.stages]
        return decide_on_speed(placement.stage_layout, placement.stage_nodes, self.constraints, current, name, figure)

    def _watch_plan(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        self.watchers.append((conn, stream_id))
        self._reply(conn, stream_id, {"type": "plan", "plan": self.plan.to_dict()})

    def _fetch_slice(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        start, stop = int(message["start"]), int(message["stop"])
        lo, hi = self.plan.trunk_range
        if not lo <= start < stop <= hi:
            self._reply(conn, stream_id, {"type": "error", "message": f"layers [{start}, {stop}) are not trunk "
                                                                       f"layers [{lo}, {hi})"}, end=True)
            return
        manifest = build_manifest(self.gguf, start, stop, self.plan.model_hash)
        have = {str(c) for c in message.get("have") or []}
        log.info("sending layers [%d, %d) to %s (%d chunks already there)", start, stop, conn.peer_name, len(have))
        asyncio.ensure_future(self._send_slice(conn, stream_id, manifest, have))

    async def _send_slice(self, conn: SwarmProtocol, stream_id: int, manifest, have: set[str]) -> None:
        try:
            sent = await serve_slice(conn, stream_id, self.gguf, manifest, have)
        except ConnectionError:
            return
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.served_bytes += sent
        log.info("sent %.1f MB of layers [%d, %d) to %s", sent / 1e6, manifest.start, manifest.stop, conn.peer_name)

    def _nodes(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        nodes = [{"name": n.name, "memory_bytes": n.memory_bytes, "ms_per_layer_token": n.ms_per_layer_token,
                  "device": n.device, "address": n.address,
                  "links": {k: {"rtt_ms": v.rtt_ms, "bandwidth_mb_s": v.bandwidth_mb_s} for k, v in n.links.items()}}
                 for n in self._descriptors()]
        self._reply(conn, stream_id, {"type": "nodes", "nodes": nodes}, end=True)

    def _ready(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        """A trunk says it loaded its layers: it becomes a ready stage once it proved it holds them
        (and, if the host has not timed it yet, once it was timed on one of them)."""
        stage = self.plan.stage_for(conn.peer_name) or self.plan.expert_for(conn.peer_name)
        trunk = self.trunks.get(conn.peer_name)
        version = int(message["plan_version"])
        if stage is not None and trunk is not None and version == self.plan.version and not stage.ready \
                and trunk.proving != (version, stage.start, stage.stop):
            trunk.proving = (version, stage.start, stage.stop)
            self._spawn_check(self._check_ready(conn.peer_name, trunk, trunk.proving))
        self._reply(conn, stream_id, {"type": "ok"}, end=True)

    def _refuse(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            trunk.refused = str(message["reason"])[:300]
            log.warning("trunk %s cannot serve: %s", conn.peer_name, trunk.refused)
            self._replan()
        self._reply(conn, stream_id, {"type": "ok"}, end=True)

    def _get_plan(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        self._reply(conn, stream_id, {"type": "plan", "plan": self.plan.to_dict()}, end=True)

    def _status(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        self._reply(conn, stream_id, {"type": "status", **self.status()}, end=True)

    def _revoked(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        if conn.peer_cert is None or conn.peer_cert.serial_number != self.creds.cert.serial_number:
            self._reply(conn, stream_id, {"type": "error", "message": "only the host may announce revocations"})
            return
        revoked = self.home.revoked_serials()
        self.plan.revoked_serials = sorted(revoked)
        closed = 0
        for live in list(self.connections):
            if live.peer_cert is not None and live.peer_cert.serial_number in revoked:
                live.close_with(REVOKED_REASON)
                closed += 1
        for name, trunk in list(self.trunks.items()):  # out of the plan now, not when the close completes
            if trunk.conn.peer_cert is not None and trunk.conn.peer_cert.serial_number in revoked:
                del self.trunks[name]
        self._reply(conn, stream_id, {"type": "ok", "closed": closed}, end=True)
        self._replan(force_push=True)

    def _reconfigure(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        """The host's own CLI after 'swarmctl config': the planner's settings again from node.json,
        and a new plan under them, pushed to everyone."""
        from dataclasses import replace

        if conn.peer_cert is None or conn.peer_cert.serial_number != self.creds.cert.serial_number:
            self._reply(conn, stream_id, {"type": "error", "message": "only the host may change its settings"},
                        end=True)
            return
        saved = self.home.load_config()
        for key in ("objective", "plan_context", "plan_concurrent", "plan_max_stages", "expert_nodes"):
            setattr(self.config, key, getattr(saved, key))
        self.constraints = replace(self.constraints, objective=saved.objective, context_tokens=saved.plan_context,
                                   max_concurrent=saved.plan_concurrent, max_stages=saved.plan_max_stages)
        self.plan.objective = saved.objective  # also while no trunk is there to plan for
        log.info("settings changed: objective %s, context %d, concurrent %d, max stages %d, expert nodes %d",
                 saved.objective, saved.plan_context, saved.plan_concurrent, saved.plan_max_stages,
                 saved.expert_nodes)
        self._replan(force_push=True)
        self._reply(conn, stream_id, {"type": "ok", "plan_version": self.plan.version,
                                      "objective": self.plan.objective, "warnings": self.plan.warnings}, end=True)

    # --- checking what trunks claim (swarmctl/layer_proof.py) ---

    def _spawn_check(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._checks.add(task)
        task.add_done_callback(self._check_done)

    def _check_done(self, task: asyncio.Task) -> None:
        self._checks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("checking a trunk failed: %r", task.exception())

    def _check_claims(self, name: str, trunk: TrunkInfo) -> None:
        """At registration: a member that failed a check lately stays out; one the host timed
        before keeps that figure; a claimed speed is timed before the trunk is planned at all."""
        failed = self.failed_checks.get(name)
        if failed is not None and time.monotonic() - failed < FAILED_CHECK_HOLD_S:
            trunk.refused = f"failed a layer check {time.monotonic() - failed:.0f} s ago"
            log.warning("trunk %s %s: left out of the plan", name, trunk.refused)
            return
        before = self.measured_speeds.get(name)
        if before is not None:
            trunk.measured_ms_per_layer = before
            if trunk.ms_per_layer_token is not None and trunk.ms_per_layer_token * SPEED_FACTOR <= before:
                self._reprobe(name, trunk)
            return
        trunk.unchecked = True
        if trunk.ms_per_layer_token is not None:  # it has the model file: time it now, plan it after
            trunk.checking = True
            self._spawn_check(self._check_registration(name, trunk))

    async def _check_registration(self, name: str, trunk: TrunkInfo) -> None:
        lo, hi = self.plan.trunk_range
        layer = lo + secrets.randbelow(hi - lo)
        outcome = await layer_proof.challenge(trunk.conn, self.gguf, [layer], probe_layer=layer,
                                              claimed_ms=trunk.ms_per_layer_token, timing_lock=self._timing_lock)
        if self.trunks.get(name) is not trunk:
            return
        trunk.checking = False
        if outcome.problem:
            self._failed_check(name, trunk, outcome.problem)  # (it was not planned: nothing to re-plan)
            return
        if outcome.missing:  # e.g. a slice file only: timed on its own layers once it says ready
            log.info("trunk %s could not be timed yet (%s): planned with the others' figure", name, outcome.missing)
        else:
            self._took_measurement(name, trunk, outcome)
        self._replan()

    async def _check_ready(self, name: str, trunk: TrunkInfo, key: tuple[int, int, int]) -> None:
        version, start, stop = key
        expert = self.plan.expert_for(name) is not None
        layers = list(range(*self.plan.trunk_range)) if expert else list(range(start, stop))
        probe = layers[secrets.randbelow(len(layers))] if trunk.measured_ms_per_layer is None and not expert else None
        outcome = await layer_proof.challenge(trunk.conn, self.gguf, layers, probe_layer=probe,
                                              claimed_ms=trunk.ms_per_layer_token, timing_lock=self._timing_lock)
        if trunk.proving == key:
            trunk.proving = None
        if self.trunks.get(name) is not trunk:
            return
        current = self.plan.stage_for(name) or self.plan.expert_for(name)
        same = self.plan.version == version and current is not None and (current.start, current.stop) == (start, stop)
        # A plan that moved meanwhile excuses "not held" (the trunk may have loaded other layers
        # since) and, once between two passed checks, a late answer; a wrong answer never.
        excused = not same and (outcome.missing or (outcome.timed_out and not trunk.excused))
        if excused:
            trunk.excused = trunk.excused or outcome.timed_out
        elif outcome.problem or outcome.missing:
            self._failed_check(name, trunk, outcome.problem or
                               f"said it was ready with layers it does not hold ({outcome.missing})")
            self._replan()
            return
        if outcome.ms_per_layer is not None:
            self._took_measurement(name, trunk, outcome)
        if not same or excused:
            return  # the plan moved on: the trunk confirms the new one, and is checked again
        current.ready = True
        trunk.excused = False
        log.info("trunk %s ready with %s [%d, %d) (layer check: %d bytes, %.1f ms)", name,
                 "experts" if expert else "layers", start, stop, outcome.bytes_read, outcome.proof_ms)
        self._push_plan()
        if outcome.ms_per_layer is not None:
            self._plan_speed(name, trunk)

    def _reprobe(self, name: str, trunk: TrunkInfo) -> None:
        """Time a trunk again later: it claims to be faster than the host saw it (another process
        may have had its cores then, or it got faster). At most ``REPROBES`` times, further apart."""
        if trunk.reprobes < REPROBES:
            self._spawn_check(self._probe_again(name, trunk, REPROBE_AFTER_S * 2 ** trunk.reprobes))
            trunk.reprobes += 1

    async def _probe_again(self, name: str, trunk: TrunkInfo, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.trunks.get(name) is not trunk or trunk.refused:
            return
        stage = self.plan.stage_for(name)
        lo, hi = (stage.start, stage.stop) if stage is not None else self.plan.trunk_range
        layer = lo + secrets.randbelow(hi - lo)
        outcome = await layer_proof.challenge(trunk.conn, self.gguf, [layer], probe_layer=layer,
                                              claimed_ms=trunk.ms_per_layer_token, timing_lock=self._timing_lock)
        if self.trunks.get(name) is not trunk or trunk.refused:
            return
        if outcome.problem and not outcome.timed_out:  # (a busy trunk may answer late; a wrong answer is a lie)
            self._failed_check(name, trunk, outcome.problem)
            self._replan()
        elif outcome.ms_per_layer is not None:
            self._took_measurement(name, trunk, outcome)
            self._plan_speed(name, trunk)

    def _took_measurement(self, name: str, trunk: TrunkInfo, outcome: layer_proof.Outcome) -> None:
        figure = max(outcome.ms_per_layer, claims.MS_PER_LAYER[0])
        if trunk.measured_ms_per_layer is None or figure < trunk.measured_ms_per_layer:
            trunk.measured_ms_per_layer = figure  # interference only adds time: the fastest is the machine's
        self.measured_speeds[name] = trunk.measured_ms_per_layer
        trunk.unchecked = False
        log.info("trunk %s timed by the host on layer %d: %.3f ms per layer (%d steps, runs %s ms, round trip "
                 "%.2f ms; it claims %s): planned with %.3f", name, outcome.layer, figure, outcome.steps,
                 "/".join(f"{ms:.1f}" for ms in outcome.runs_ms), outcome.rtt_ms or 0.0,
                 f"{trunk.ms_per_layer_token:.3f}" if trunk.ms_per_layer_token else "nothing", trunk.planning_speed)
        if trunk.ms_per_layer_token is not None and trunk.ms_per_layer_token * SPEED_FACTOR <= trunk.measured_ms_per_layer:
            self._reprobe(name, trunk)

    def _plan_speed(self, name: str, trunk: TrunkInfo) -> None:
        """A new planning figure from the host's own timing: adopted and re-planned on as a claimed
        one would be (plans/hysteresis.py)."""
        figure = trunk.planning_speed
        if figure is None or self.trunks.get(name) is not trunk or trunk.refused or trunk.checking:
            return
        decision = self._speed_decision(name, figure)
        if decision.adopt or name not in self.speed_basis:
            self.speed_basis[name] = figure
        (log.info if decision.adopt else log.debug)("speed of %s as timed: %s", name, decision.reason)
        if decision.replan:
            self._replan()

    def _failed_check(self, name: str, trunk: TrunkInfo, problem: str) -> None:
        trunk.refused = problem[:300]
        self.failed_checks[name] = time.monotonic()
        log.warning("trunk %s %s: left out of the plan", name, trunk.refused)

    # --- planning ---

    def _descriptors(self) -> list[NodeDescriptor]:
        """The planner's view of the trunks that can serve: speed (its claim, never faster than the
        host timed it; the others' median until the host could time it), memory, and links (to the
        host standing in for the asker). A trunk whose claims are being checked is not planned yet."""
        ready = [(name, t) for name, t in sorted(self.trunks.items(), key=lambda kv: kv[1].registered_at)
                 if not t.refused and not t.checking]
        for name, t in ready:  # a figure within the band of the one planned with leaves that one in place
            speed = sticky_speed(self.speed_basis.get(name), t.planning_speed)
            if speed is not None:
                self.speed_basis[name] = speed
        known = [self.speed_basis[name] for name, t in ready if t.planning_speed]
        fallback = statistics.median(known) if known else DEFAULT_MS_PER_LAYER
        nodes = []
        for name, t in ready:
            links = dict(t.links)
            if t.rtt_ms is not None:
                links[ASKER] = Link(t.rtt_ms, links.get(ASKER, Link()).bandwidth_mb_s)
            speed = self.speed_basis[name] if t.planning_speed else fallback
            nodes.append(NodeDescriptor(name, t.memory, speed, t.device, t.listen, links))
        return nodes

    def _replan(self, also_send_to: str | None = None, force_push: bool = False) -> None:
        # (stages bound each member's KV by what the plan reserves there: swarmctl/budget.py)
        self.plan.context_tokens = self.constraints.context_tokens
        self.plan.max_concurrent = self.constraints.max_concurrent
        every_node = nodes = self._descriptors()
        experts: list[ExpertAssignment] = []
        try:
            placement = place_experts(self.layout, every_node, self.constraints, self.config.expert_nodes)
            nodes, experts = placement.stage_nodes, placement.experts
            proposal = plan_layers(placement.stage_layout, nodes, self.constraints) if nodes else None
            if proposal is not None:
                add_expert_calls(proposal, placement, every_node, self.layout)
        except PlanError as e:
            proposal = None
            log.warning("cannot plan: %s", e)
            self.plan.warnings = [str(e)]
        if proposal is None:
            changed = bool(self.plan.stages)
            if changed:
                self.plan.version += 1
                self.plan.stages = []
        else:
            changed = self.plan.apply(proposal, {n.name: n.address for n in nodes})
            self.plan.warnings += placement.warnings
        if [(e.member, e.start, e.stop) for e in experts] != [(e.member, e.start, e.stop) for e in self.plan.experts]:
            if not changed:
                self.plan.version += 1
                for s in self.plan.stages:
                    s.ready = False
            self.plan.experts = experts
            self.plan.check_experts()
            changed = True
        if changed:
            self._save_plan_version()
            log.info("plan v%d: %s%s%s", self.plan.version,
                     ", ".join(f"{s.member}[{s.start},{s.stop})" for s in self.plan.stages) or "no trunks",
                     "".join(f"; experts {e.member}[{e.start},{e.stop})" for e in self.plan.experts),
                     "".join(f"; {w}" for w in self.plan.warnings))
            self._push_plan()
        elif force_push:
            self._push_plan()
        elif also_send_to is not None:
            self._push_plan(only=also_send_to)

    def _push_plan(self, only: str | None = None) -> None:
        frame = encode_control({"type": "plan", "plan": self.plan.to_dict()})
        for name, trunk in self.trunks.items():
            if (only is None or name == only) and trunk.conn.is_open:
                trunk.conn.send(trunk.plan_stream, frame)
        if only is None:
            self.watchers = [(c, sid) for c, sid in self.watchers if c.is_open]
            for conn, stream_id in self.watchers:
                conn.send(stream_id, frame)

    def status(self) -> dict:
        members = []
        online = self.online()
        for name, record in sorted(self.home.members().items()):
            stage = self.plan.stage_for(name)
            expert = self.plan.expert_for(name)
            trunk = self.trunks.get(name)
            if record.revoked:
                health = "revoked"
            elif name == self.config.name:
                health = "up (host)"
            elif trunk is not None and trunk.refused:
                health = f"refused: {trunk.refused}"
            elif trunk is not None and trunk.checking:
                health = "checking its claims"
            elif stage is not None:
                health = "ready" if stage.ready else "loading"
            elif expert is not None:
                health = "ready" if expert.ready else "loading"
            else:
                health = "up" if name in online else "down"
            members.append({"name": name, "role": "host" if name == self.config.name else
                            ("trunk" if trunk is not None else "member"),
                            "may": record.role,  # what its certificate lets it be: host, trunk or asker
                            "address": self._advertised() if name == self.config.name else (trunk.listen if trunk else ""),
                            "layers": [stage.start, stage.stop] if stage else None,
                            "experts": [expert.start, expert.stop] if expert else None,
                            "memory": trunk.memory if trunk else None, "health": health,
                            "ms_per_layer_token": trunk.ms_per_layer_token if trunk else None,
                            # what the host timed itself, and the figure it plans with (never below it)
                            "measured_ms_per_layer": trunk.measured_ms_per_layer if trunk else None,
                            "planned_ms_per_layer": trunk.planning_speed if trunk else None,
                            "slice_bytes_sent": trunk.served_bytes if trunk else 0,
                            # spot checks that caught it (swarmctl/verify.py): reports, and how many members made them
                            "bad_results": sum(self.bad_results.get(name, {}).values()),
                            "bad_result_reporters": len(self.bad_results.get(name, {}))})
        return {"swarm": self.config.swarm_name, "model": self.plan.model_name, "n_layer": self.plan.n_layer,
                "head_layers": self.plan.head_layers, "plan_version": self.plan.version,
                "complete": self.plan.complete, "missing_layers": self.plan.missing_layers(), "members": members,
                "objective": self.plan.objective, "expected_ms_per_token": self.plan.expected_ms_per_token,
                "expected_tokens_per_s": self.plan.expected_tokens_per_s, "bottleneck": self.plan.bottleneck,
                "warnings": self.plan.warnings, "recovery": self.recovery}

    def _advertised(self) -> str:
        """The host's address as members reach it (what init advertised), not its listen address
        (which is 0.0.0.0 by default)."""
        return self.config.host_addresses[0] if self.config.host_addresses else str(self.address)

    def _reply(self, conn: SwarmProtocol, stream_id: int, message: dict, end: bool = False) -> None:
        if conn.is_open:
            conn.send(stream_id, encode_control(message), end=end)


async def run_host(home: SwarmHome, stop: asyncio.Event, ready_file=None) -> None:
    service = HostService(home)
    address = await service.start()
    if ready_file is not None:
        ready_file.write_text(str(address))
    try:
        await stop.wait()
    finally:
        service.close()

