"""Control messages as types: one frozen struct per message, checked once where it arrives.

A control frame (net/wire.py) carries one JSON object whose ``type`` names the message. ``parse``
turns that object into its struct, or refuses it with one line: an unknown type, a missing field,
a field of the wrong type, or a number outside what a real machine can have (a 400-digit memory
once broke every re-plan). Handlers then dispatch on the struct's class and read attributes; no
``.get()`` chains, no second check.

Who sends which message: docs/protocol.md lists them by direction (member → host, host → trunk,
...), generated from this module by net/reference.py; the host's and the trunk's handler tables
say what each answers.

Structs decode with msgspec (typed structs, tagged unions, validating conversion); unknown extra
fields are ignored, so a newer member can add one without breaking an older one.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from .wire import MAX_CONTROL_BYTES as _MAX_CONTROL_BYTES, WireError, decode_control, encode_frame, FrameType

# What a member may claim about itself. Sanity bounds only: a fast liar is caught by the host's
# own timing (swarmctl/node/layer_proof.py), not here.
MAX_MEMORY = 2**50  # 1 PiB: more than any machine offers
MS_PER_LAYER = (0.001, 60_000.0)  # per token
MAX_RTT_MS = 60_000.0
MAX_BANDWIDTH_MB_S = 1e6
MAX_RAM_GB_S = 2000.0
MAX_LINKS = 1024
MAX_NAME = 64
MAX_ACCUSED = 64

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Memory = Annotated[int, msgspec.Meta(ge=0, le=MAX_MEMORY)]
MsPerLayer = Annotated[float, msgspec.Meta(ge=MS_PER_LAYER[0], le=MS_PER_LAYER[1])]
RttMs = Annotated[float, msgspec.Meta(ge=0, le=MAX_RTT_MS)]
DatagramUs = Annotated[float, msgspec.Meta(ge=0.01, le=100_000)]  # plans/nodes.py MAX_DATAGRAM_US
Bandwidth = Annotated[float, msgspec.Meta(ge=0, le=MAX_BANDWIDTH_MB_S)]
# A GPU member's host RAM read rate for routed experts (kernels/speed.py RamRate): the fastest desktop
# memory systems read a few hundred GB/s; a figure beyond this is no machine's.
RamGbS = Annotated[float, msgspec.Meta(gt=0, le=MAX_RAM_GB_S)]
Layer = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
Version = Annotated[int, msgspec.Meta(ge=-1, le=2**62)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
# Layer ranges [start, stop) a trunk holds on disk and serves to members fetching them.
LayerRanges = Annotated[list[tuple[Layer, Layer]], msgspec.Meta(max_length=64)]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    # The certificate roles that may send it (empty: any member); the host refuses the rest.
    senders: ClassVar[tuple[str, ...]] = ()


class Part(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a message (not a message of its own)."""


# --- member → host ---

class Join(Message, tag="join"):
    token_id: Text
    secret: Text
    csr: Annotated[str, msgspec.Meta(max_length=16384)]
    name: Text  # (the host checks it as a member name)


class Register(Message, tag="register"):
    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    listen: Text
    memory: Memory
    ms_per_layer_token: MsPerLayer | None = None  # None: it has no model file to measure with yet
    device: Name = "cpu"
    rtt_ms: RttMs | None = None  # to the host, which stands in for the asker when planning
    # The trunk's own ip:port for its swarm socket as it sees it ("" when it advertises an address
    # of its own). Where the host sees that socket elsewhere, a NAT is in between: peers reach it
    # by hole punching or through a relay, not at an address it listens on.
    local: Annotated[str, msgspec.Meta(max_length=64)] = ""
    relay: bool = False  # it offers to relay links (run --relay)
    datagram_us: DatagramUs | None = None  # CPU per datagram of a hop, both ends (net/packet_cost.py)
    # A trunk on a GPU may offer host RAM for the routed experts its device cannot hold (run's
    # --memory there), with the rate its CPU gets through them (measured at start): both or neither.
    ram_bytes: Memory = 0
    ram_gb_s: RamGbS | None = None
    # ms per prompt row through one layer, in a prompt's chunk (kernels/speed.py measure_prompt_rate):
    # what the plan's first-token time is computed with, never where layers go.
    prompt_ms_per_layer_row: MsPerLayer | None = None
    holds: LayerRanges = []  # layers it serves to fetching members (its upload budget is not 0)
    fetches: bool = False  # it has no model file: layers it is given are fetched (moves priced at its rate)


class Ready(Message, tag="ready"):
    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    plan_version: Version
    # Where its stage computes: "cpu", "vulkan:0", or under partial offload "cuda:0 for layers
    # [4, 9), cpu for [9, 15)" ("": an expert node, or a trunk too old to say).
    placement: Annotated[str, msgspec.Meta(max_length=200)] = ""
    holds: LayerRanges = []  # as register's, now (a slice it fetched meanwhile)


class Refuse(Message, tag="refuse"):
    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    reason: str  # (cut to a line's length where it is kept)


class LinkClaim(Part):
    rtt_ms: RttMs
    bandwidth_mb_s: Bandwidth | None = None


class Reach(Message, tag="reach"):
    """How do I reach this trunk from my swarm socket (this connection's)? ``relay``: hole
    punching failed; give me a relayed link."""

    member: Name
    relay: bool = False
    asking: bool = False  # for an ask (the asker's end of the plan), not a trunk's own link


class Links(Message, tag="links"):
    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    links: Annotated[dict[Name, LinkClaim], msgspec.Meta(max_length=MAX_LINKS)]


class Speed(Message, tag="speed"):
    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    ms_per_layer_token: MsPerLayer
    serving: bool = False  # seen in the batches it serves (the host smooths these), not measured afresh
    prompt_ms_per_layer_row: MsPerLayer | None = None  # measured afresh with it (None: no news)


ByteCount = Annotated[int, msgspec.Meta(ge=0, le=2**52)]
ByteRate = Annotated[float, msgspec.Meta(ge=0, le=1e12)]  # bytes per second


class Cached(Message, tag="cached"):
    """A trunk's kept prefixes (swarmctl/trunk/prefixes.py), all accounts together, when they
    change: the prompt positions its stage keeps for askers' next requests, and their KV bytes
    (status and top show them)."""

    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    tokens: Annotated[int, msgspec.Meta(ge=0, le=2**40)]
    kv_bytes: ByteCount


class Fetching(Message, tag="fetching"):
    """A trunk fetching its layers or experts says how it goes, every few seconds and once at the
    end (swarmctl/model_files/fetch_progress.py): status and top show it, and the planner prices a layer move
    to this member at its rate."""

    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    what: Annotated[str, msgspec.Meta(max_length=200)]
    done: ByteCount
    total: ByteCount
    bytes_per_s: ByteRate | None = None  # this fetch's rate so far (None: too early to say)
    finished: bool = False


# chunk ids ("tensor:index") a fetch asks for in one batch (swarmctl/model_files/distribution.py)
ChunkIds = Annotated[list[Annotated[str, msgspec.Meta(max_length=32)]], msgspec.Meta(max_length=4096)]


class FetchSlice(Message, tag="fetch_slice"):
    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    start: Layer
    stop: Layer
    have: Annotated[list[Annotated[str, msgspec.Meta(max_length=32)]], msgspec.Meta(max_length=1 << 20)] = []
    want: ChunkIds | None = None  # None: manifest and all chunks not in have; []: manifest alone; else those
    # [first, last): an expert node asks for just those experts of the layers' expert tensors
    # (swarmctl/model_files/expert_slices.py); []: the layers whole
    experts: Annotated[list[Layer], msgspec.Meta(max_length=2)] = []


class FetchAskerPart(Message, tag="fetch_asker_part"):
    """An asker with no model file asks for what it runs: the embedding, its head and tail layers,
    the output norm and LM head, the metadata (swarmctl/model_files/distribution.py)."""
    senders: ClassVar[tuple[str, ...]] = ("asker", "trunk", "host")
    head_layers: Layer
    have: Annotated[list[Annotated[str, msgspec.Meta(max_length=32)]], msgspec.Meta(max_length=1 << 20)] = []
    want: ChunkIds | None = None  # as FetchSlice's


class BadSource(Message, tag="bad_source"):
    """A member that fetched a slice got a chunk from ``member`` that failed the host's hash: it
    dropped that source for the fetch and says so (the host counts it, bounded per reporter)."""

    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    member: Name
    reason: Annotated[str, msgspec.Meta(max_length=300)] = ""


class Unanswered(Message, tag="unanswered"):
    """A stage's expert call to ``member`` got no answer, nor did a ping after it: the host judges
    the member by its own link at once, not at its next silence verdict."""

    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    member: Name


class Recovered(Message, tag="recovered"):
    recovery_s: Annotated[float, msgspec.Meta(ge=0, le=86400)]
    replayed_bytes: Memory


class BadResult(Message, tag="bad_result"):
    members: Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(min_length=1, max_length=MAX_ACCUSED)]
    plan_version: Version = -1
    layers: list[int] = []
    rows: int = 0
    bad_rows: int = 0
    rel_error: float | None = None
    cosine: float | None = None
    attributed: bool = False  # members names the one stage a re-check stage by stage found wrong


class WatchPlan(Message, tag="watch_plan"):
    pass


class GetPlan(Message, tag="get_plan"):
    pass


class GetNodes(Message, tag="nodes"):
    pass


class GetStatus(Message, tag="status"):
    pass


class Revoked(Message, tag="revoked"):
    senders: ClassVar[tuple[str, ...]] = ("host",)


class Reconfigure(Message, tag="reconfigure"):
    senders: ClassVar[tuple[str, ...]] = ("host",)


# --- replies ---

class Ok(Message, tag="ok", omit_defaults=True):
    # what some requests report back: closed connections (revoked), counted members (bad_result),
    # the new plan's version, objective and warnings (reconfigure)
    closed: int | None = None
    counted: list[str] | None = None
    plan_version: int | None = None
    objective: str | None = None
    warnings: list[str] | None = None


class Error(Message, tag="error", omit_defaults=True):
    message: str
    missing: bool = False  # a layer check asked about layers the trunk does not hold


class Joined(Message, tag="joined"):
    name: str
    cert: str
    ca: str
    swarm_name: str
    host_name: str
    host_addresses: list[str]
    model_name: str


Nonce = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]
Token = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class Route(Message, tag="route", omit_defaults=True):
    """The host's answer to ``reach``: connect ``direct`` to ``address``; or ``punch`` (send probes
    to ``address`` with ``nonce`` as end ``side`` while the trunk does the same, then connect to
    where its probes came from); or ``relay``: register ``token`` at ``address`` and connect there."""

    kind: Annotated[str, msgspec.Meta(pattern="^(direct|punch|relay)$")]
    address: Text
    nonce: Nonce | None = None
    side: Annotated[int, msgspec.Meta(ge=0, le=1)] = 0
    token: Token | None = None
    via: Name = ""  # the relay's member name


class PunchWith(Message, tag="punch_with"):
    """Host → trunk, on its plan stream: a member is about to connect; send it probes now."""

    senders: ClassVar[tuple[str, ...]] = ("host",)
    peer: Text  # where the member's probes come from
    member: Name
    nonce: Nonce
    side: Annotated[int, msgspec.Meta(ge=0, le=1)]


class RelayEnd(Message, tag="relay_end"):
    """Host → trunk, on its plan stream: a member will reach you through the relay at
    ``address``; register ``token`` there (and keep it registered while the link lives)."""

    senders: ClassVar[tuple[str, ...]] = ("host",)
    address: Text
    member: Name
    token: Token
    via: Name


class AllocateRelay(Message, tag="allocate_relay"):
    """Host → a trunk that offered to relay (on a stream of its own): a relayed link, please."""


class RelayAllocated(Message, tag="relay_allocated"):
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    token_a: Token
    token_b: Token


class PlanPush(Message, tag="plan"):
    plan: dict[str, Any]  # plans.plan.Plan.to_dict(); Plan.from_dict checks it


class LinkInfo(Part):
    rtt_ms: float
    bandwidth_mb_s: float


class NodeInfo(Part):
    """The planner's view of one member (the answer to ``nodes``)."""

    name: str
    memory_bytes: int
    ms_per_layer_token: float
    device: str
    address: str
    links: dict[str, LinkInfo] = {}
    datagram_us: float | None = None  # CPU per datagram of a hop, both ends, as it measured
    ram_bytes: int = 0  # host RAM beside its device for routed experts, and that RAM's rate
    ram_gb_s: float = 0.0
    prompt_ms_per_layer_row: float | None = None  # a prompt row through one layer, as it measured


class Nodes(Message, tag="nodes"):
    nodes: list[NodeInfo]


class FetchStatus(Part, kw_only=True):
    """A member's latest fetch of layers or experts, as it reported it (``fetching``)."""

    what: str
    done: int
    total: int
    bytes_per_s: float | None = None
    eta_s: float | None = None  # at the rate so far (None: not known yet)
    finished: bool = False
    age_s: float = 0.0  # since it reported it


class MemberStatus(Part, kw_only=True):
    name: str
    role: str  # host, trunk or member (what it is doing now)
    may: str = ""  # what its certificate lets it be: host, trunk or asker ("": a host too old to say)
    address: str
    health: str
    layers: list[int] | None = None
    experts: list[int] | None = None
    memory: int | None = None
    ram_bytes: int = 0  # a GPU trunk's host RAM for routed experts (its device's memory is ``memory``)
    ram_gb_s: float = 0.0
    device: str = ""  # where a trunk computes: cpu, cuda:0, vulkan:0, ... ("": not a trunk, or a host too old)
    placement: str = ""  # its stage's layers by device when they are split (partial offload), else ""
    ms_per_layer_token: float | None = None  # its claim
    measured_ms_per_layer: float | None = None  # what the host timed itself
    planned_ms_per_layer: float | None = None  # what it is planned with (never below the timing)
    slice_bytes_sent: int = 0
    bad_results: int = 0  # spot checks that caught it (swarmctl/asker/verify.py)
    bad_result_reporters: int = 0
    last_seen_s: float | None = None  # seconds since its last connection to the host closed (None: connected, or not seen)
    fetch: FetchStatus | None = None  # its latest fetch of layers or experts (None: none since it registered)
    cached_tokens: int = 0  # prompt positions its stage keeps for askers' next requests (``cached``)
    cached_kv_bytes: int = 0


class LinkStatus(Part, kw_only=True):
    """One link the plan uses (asker → first stage, stage → next stage, last stage → asker), as
    measured, or as the planner estimates it where nobody measured it (plans/links.py)."""

    source: str  # a member, or "asker" (the host stands in for the asker's side)
    target: str
    path: str = "direct"  # "direct", or "relayed via X"
    rtt_ms: float | None = None  # measured, or the estimate the planner charges
    bandwidth_mb_s: float | None = None  # likewise (None: nothing to say)
    basis: str = "unknown"  # measured, relayed, site, bound or unknown (plans/links.py)
    measured: bool = False  # the round trip is a measurement of this link (else an estimate)
    bandwidth_measured: bool = False  # a probe measured its throughput (else a default or estimate)


class RecoveryStatus(Part):
    recoveries: int = 0
    replayed_bytes: int = 0
    last_recovery_s: float | None = None
    last_marked_down: str | None = None


class Status(Message, tag="status"):
    swarm: str
    model: str
    n_layer: int
    head_layers: int
    plan_version: int
    complete: bool
    missing_layers: list[list[int]]
    members: list[MemberStatus]
    objective: str
    expected_ms_per_token: float
    expected_tokens_per_s: float
    bottleneck: str
    warnings: list[str]
    recovery: RecoveryStatus
    links: list[LinkStatus] = []  # the plan's links in order (empty from a host too old to say)
    staged: str = ""  # a plan staged to follow this one, loading beside it: "v6: alice[4,10) loading, ..."


class Holder(Part):
    """A member that holds layers [start, stop) and serves them (fetch_chunks), where it is reached."""

    name: Name
    address: Text
    start: Layer
    stop: Layer


class Manifest(Message, tag="manifest"):
    manifest: dict[str, Any]  # swarmctl.model_files.distribution.SliceManifest.to_dict(); from_dict checks it
    # members to fetch chunks from besides the host (each chunk is checked against the manifest's hashes)
    holders: Annotated[list[Holder], msgspec.Meta(max_length=16)] = []


class Done(Message, tag="done"):
    bytes: int


# --- host → trunk: the layer check and speed probe (swarmctl/node/layer_proof.py) ---

class ProbeSpec(Part):
    layer: Layer
    steps: Annotated[int, msgspec.Meta(ge=1, le=64)]


class Prove(Message, tag="prove"):
    senders: ClassVar[tuple[str, ...]] = ("host",)
    nonce: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    windows: list[list[int]]  # [[layer, offset, length], ...]; layer_proof.check_windows bounds them
    probe: ProbeSpec | None = None
    # an expert node's [first, last): the windows are over those experts' slabs of each layer's
    # expert tensors (all it holds of a layer), and there is no probe; []: over whole layers
    experts: Annotated[list[Layer], msgspec.Meta(max_length=2)] = []


class ProbeRun(Message, tag="probe_run"):
    senders: ClassVar[tuple[str, ...]] = ("host",)
    run: Annotated[int, msgspec.Meta(ge=0, lt=16)]
    hidden: str  # base64 f32 [n_embd]


class ProbeReveal(Message, tag="probe_reveal"):
    senders: ClassVar[tuple[str, ...]] = ("host",)
    run: int


class Proof(Message, tag="proof"):
    digest: str


class ProbeDone(Message, tag="probe_done"):
    run: int
    digest: str


class ProbeOutputs(Message, tag="probe_outputs"):
    outputs: str  # base64 f32 [steps, n_embd]


# --- member → trunk ---

class Subscribe(Message, tag="subscribe"):
    session: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{1,64}$")]  # one per asker process


class FetchChunks(Message, tag="fetch_chunks"):
    """Member → trunk: chunks of layer tensors it holds (a slice it fetches from several sources,
    swarmctl/model_files/distribution.py MemberSource). ``want`` names chunks as "k:index", k an index into
    ``tensors``; answered with DATA frames (k:u32 offset:u64 bytes) then ``done``, or ``error``."""

    senders: ClassVar[tuple[str, ...]] = ("trunk",)
    tensors: Annotated[list[Annotated[str, msgspec.Meta(max_length=128)]], msgspec.Meta(min_length=1, max_length=256)]
    want: Annotated[list[Annotated[str, msgspec.Meta(max_length=32)]], msgspec.Meta(min_length=1, max_length=256)]


class Probe(Message, tag="probe"):
    """A peer measuring its link to us: answered at once when ``n_bytes`` is 0, else once that
    many bytes (one DATA frame after it on the same stream) arrived (net/probe.py; the receiver
    refuses more than its cap)."""

    n_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0


class GetStats(Message, tag="stats"):
    pass


class Stats(Message, tag="stats", kw_only=True):
    """What a trunk reports about itself (the answer to ``stats``): for `status`, `top` and tests."""

    name: str
    role: str  # "stage", "experts" or "idle"
    layers: list[int] | None  # [start, stop) of a stage
    expert_range: list[int] | None  # [first, last) of an expert node
    time: float  # unix time of this snapshot
    # [started (unix time), seconds, tokens, [request id prefixes]] of the batches in the window
    recent_batches: list[list[Any]]
    requests_detail: list[dict[str, Any]]  # {"id", "position", "idle_s", "drafted", "accepted"} per request held
    requests: int
    routes: int
    kv_bytes: int
    peak_kv_bytes: int
    queue_depth: int
    batches: int
    steps: int
    tokens: int
    busy_s: float
    largest_batch: int
    tensor_bytes: int
    # (defaults: a trunk of an older version does not send these)
    budget: dict[str, Any] = {}  # requests and KV held per member, the limits, refusals (swarmctl/trunk/budget.py)
    open_streams: int = 0
    request_locks: int = 0
    rss: int
    peak_rss: int
    fetched_bytes: int
    expert_rows_served: int
    expert_call_bytes: int  # expert calls sent and answered (a stage) or served (an expert node)
    activation_bytes_sent: int
    ms_per_layer_token: float | None
    # the host's evidence that an accuser re-checked this stage alone (swarmctl/trunk/one_stage.py):
    one_stage: dict[str, list[int]] = {}  # account → [one-stage steps it computed for it, plan version of the latest]


# --- reading and writing ---

M = TypeVar("M", bound=Message)
Kinds = dict[str, type[Message]]


def kinds(*types: type[Message]) -> Kinds:
    """The messages an endpoint answers, by their ``type``."""
    return {t.__struct_config__.tag: t for t in types}


class UnknownMessage(WireError):
    def __init__(self, kind: str) -> None:
        super().__init__(f"unknown request {kind[:40]!r}")
        self.kind = kind


class MalformedMessage(WireError):
    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"malformed {kind}: {reason}"[:300])
        self.kind = kind


class Refused(Exception):
    """The peer answered with an error message."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.message)
        self.error = error


def parse(message: dict[str, Any], accepted: Kinds) -> Message:
    """The struct of one decoded control message (``net.wire.decode_control``), if ``accepted``
    has its type: else UnknownMessage, or MalformedMessage naming the field that is wrong."""
    kind = message["type"]
    cls = accepted.get(kind)
    if cls is None:
        raise UnknownMessage(kind)
    try:
        return msgspec.convert(message, cls, strict=True)
    except msgspec.ValidationError as e:
        raise MalformedMessage(kind, str(e)) from None
    except RecursionError:  # nesting deeper than the interpreter's stack: hostile, never ours
        raise MalformedMessage(kind, "nested too deeply") from None


def decode(body: bytes, expected: type[M], max_bytes: int = _MAX_CONTROL_BYTES) -> M:
    """A reply of type ``expected``; Refused for an error reply; WireError for anything else."""
    message = decode_control(body, max_bytes)
    if message["type"] == "error":
        raise Refused(parse(message, {"error": Error}))  # type: ignore[arg-type]
    if message["type"] != expected.__struct_config__.tag:
        raise WireError(f"answered {message['type'][:40]!r} instead of {expected.__struct_config__.tag!r}")
    return parse(message, {message["type"]: expected})  # type: ignore[return-value]


def encode(message: Message) -> bytes:
    """One control frame."""
    return encode_frame(FrameType.CONTROL, msgspec.json.encode(message))


def as_dict(message: Message) -> dict[str, Any]:
    """The message as its JSON object (for logs, tests and JSON output)."""
    return msgspec.to_builtins(message)
