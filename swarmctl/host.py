"""The host role: membership, joins, and the plan (who serves which layers).

Control messages (JSON frames, one request per stream unless noted):

    join        {token_id, secret, csr, name}          joiner (join ALPN) → host → joined | error
    register    {listen, memory, ms_per_layer_token,   trunk → host; the stream stays open and
                 device, rtt_ms}                       the host sends every new plan on it
    links       {links: {peer: {rtt_ms, bandwidth_mb_s}}}  trunk's measured links → ok
    speed       {ms_per_layer_token}                   a trunk's new figure (measured after a fetch or again,
                                                       or seen while serving) → ok; re-plans if material
    recovered   {recovery_s, replayed_bytes}           an asker rerouted a request after a failure → ok
    watch_plan  {}                                     asker → plan now, and every new plan after
    fetch_slice {start, stop, have}                    a trunk without the model → manifest, data
    nodes       {}                                     anyone → the planner's view of the members
    ready       {plan_version}                         trunk loaded its layers → ok
    refuse      {reason}                               trunk cannot serve (e.g. model mismatch) → ok
    get_plan    {}                                     anyone → plan
    status      {}                                     anyone → status
    revoked     {}                                     the host's own CLI after 'swarmctl revoke' → ok
    reconfigure {}                                     the host's own CLI after 'swarmctl config' → ok
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
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
from plans.hysteresis import SpeedDecision, decide_on_speed, sticky_speed
from plans.planner import Constraints, PlanError, add_expert_calls, place_experts, plan_layers
from swarmctl import claims
from swarmctl.distribution import build_manifest, serve_slice
from swarmctl.home import SwarmHome
from swarmctl.membership import JoinRefused, admit
from swarmctl.models import resolve_model

log = logging.getLogger("swarmctl.host")


DEFAULT_MS_PER_LAYER = 1.0  # for a trunk that could not measure yet (it has no model file)
SILENCE_LIMIT = 4.0  # seconds without a datagram (trunks ping every second) before a trunk is marked down


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
        self._monitor: asyncio.Task | None = None
        # Every authenticated connection: a member may hold several at once (its trunk, two asks,
        # serve, top), so "online" means any of them is open, and revoking closes them all.
        self.connections: set[SwarmProtocol] = set()
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
        self.trunks[conn.peer_name] = TrunkInfo(conn, stream_id, listen, memory, speed,
                                                str(message.get("device", "cpu"))[:64], rtt)
        log.info("trunk %s registered at %s with %.1f GB, %s ms per layer", conn.peer_name, listen, memory / 1e9,
                 f"{speed:.2f}" if speed is not None else "unmeasured")
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

    def _speed(self, conn: SwarmProtocol, stream_id: int, message: dict) -> None:
        """A trunk has a new figure: measured once its fetched layers arrived, measured again, or
        seen while serving. The host plans with it if it moved materially, and re-plans now only
        if that makes the plan materially better (plans/hysteresis.py)."""
        trunk = self.trunks.get(conn.peer_name)
        if trunk is not None:
            figure = claims.number(message["ms_per_layer_token"], *claims.MS_PER_LAYER, "ms_per_layer_token")
            decision = self._speed_decision(conn.peer_name, figure)  # against the figures planned with
            trunk.ms_per_layer_token = figure
            if decision.adopt or conn.peer_name not in self.speed_basis:
                self.speed_basis[conn.peer_name] = figure
            (log.info if decision.adopt else log.debug)("speed of %s: %s", conn.peer_name, decision.reason)
            if decision.replan:
                self._replan()
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
        stage = self.plan.stage_for(conn.peer_name) or self.plan.expert_for(conn.peer_name)
        if stage is not None and int(message["plan_version"]) == self.plan.version and not stage.ready:
            stage.ready = True
            what = "experts" if self.plan.expert_for(conn.peer_name) else "layers"
            log.info("trunk %s ready with %s [%d, %d)", conn.peer_name, what, stage.start, stage.stop)
            self._push_plan()
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

    # --- planning ---

    def _descriptors(self) -> list[NodeDescriptor]:
        """The planner's view of the trunks that can serve: measured speed (or the others' median
        until a trunk can measure), memory, and links (to the host standing in for the asker)."""
        ready = [(name, t) for name, t in sorted(self.trunks.items(), key=lambda kv: kv[1].registered_at)
                 if not t.refused]
        for name, t in ready:  # a figure within the band of the one planned with leaves that one in place
            speed = sticky_speed(self.speed_basis.get(name), t.ms_per_layer_token)
            if speed is not None:
                self.speed_basis[name] = speed
        known = [self.speed_basis[name] for name, t in ready if t.ms_per_layer_token]
        fallback = statistics.median(known) if known else DEFAULT_MS_PER_LAYER
        nodes = []
        for name, t in ready:
            links = dict(t.links)
            if t.rtt_ms is not None:
                links[ASKER] = Link(t.rtt_ms, links.get(ASKER, Link()).bandwidth_mb_s)
            speed = self.speed_basis[name] if t.ms_per_layer_token else fallback
            nodes.append(NodeDescriptor(name, t.memory, speed, t.device, t.listen, links))
        return nodes

    def _replan(self, also_send_to: str | None = None, force_push: bool = False) -> None:
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
                            "slice_bytes_sent": trunk.served_bytes if trunk else 0})
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

