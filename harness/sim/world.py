"""The swarm the simulator runs: one host, trunks and askers, each the project's own service
class (``run_host``, ``TrunkService``, ``SwarmLink`` + ``Asker``) started as a task in a context
that names its node, on one virtual-clock loop, over the simulated network.

Homes come from a template made once per process (a tiny model, the CA, every member's key and
certificate, the host's hashes of the model) and are copied per run, so a run starts from the same files every time and what it
changes (a revocation, the host's plan counter) is its own.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import os
import random
import shutil
import socket
import threading
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.sim.clock import VirtualClockLoop
from harness.sim.network import CURRENT_NODE, SimNetwork
from harness.tiny_models import TinyConfig, write_tiny_model
from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from plans.options import PlannerSettings
from swarmctl.host.model_hashes import CACHE_FOLDER as HASH_CACHE_FOLDER, model_hashes
from swarmctl.node.home import NodeConfig, SwarmHome
from swarmctl.node.membership import create_swarm, issue_direct
from swarmctl.model_files.models import default_model_path

TRUNK_MEMORY = 2 * 1024 ** 3  # what each trunk offers (fixed: a run must not depend on this machine's free memory)


@dataclass(frozen=True)
class WorldSpec:
    trunks: int = 3  # started with the swarm
    askers: tuple[str, ...] = ("alice", "mallory")
    n_layer: int = 8
    head_layers: int = 1
    n_embd: int = 64
    vocab: int = 2048  # the tokenizer's first tokens only: every node parses the file's vocabulary
    spare_trunks: int = 0  # members with a home but not started with the swarm (a 'join' fault starts one)
    verify: float = 0.0  # > 0: every asker checks this share of its trunk steps (swarmctl ask --verify)
    n_expert: int = 0  # > 0: a mixture-of-experts model (tiny qwen3moe), of this many experts per layer
    expert_nodes: int = 0  # of the trunks, this many hold experts instead of layers (PlannerSettings)
    # what the host's planner optimises: 'even' spreads layers by memory (every trunk a stage, whatever
    # its speed); 'throughput' places them by speed, so a trunk's speed reports move layers
    objective: str = "even"
    ms_per_layer: float = 0.033  # the decode figure every trunk reports (FixedFigures)
    # > 0: the host's deadlines for a staged plan and for a stage to get ready, this short (the
    # product's 600 s and 60 s are longer than a run), so that a 'stall' fault can make them pass
    deadlines_s: float = 0.0

    @property
    def trunk_names(self) -> list[str]:
        return [f"trunk-{i + 1}" for i in range(self.trunks)]

    @property
    def spare_names(self) -> list[str]:
        return [f"trunk-{self.trunks + i + 1}" for i in range(self.spare_trunks)]

    @property
    def stages(self) -> int:
        """How many trunks the plan runs layers on once the swarm serves."""
        return self.trunks - self.expert_nodes


# The worlds a sweep can run (python -m harness.sim --world NAME): which faults each can draw is
# harness/sim/schedule.py's kinds_for.
WORLDS = {
    "plain": WorldSpec(),
    "late": WorldSpec(spare_trunks=1),  # one trunk more, not started with the swarm
    "verified": WorldSpec(spare_trunks=1, verify=1.0),  # askers check every step: a lying trunk can be drawn
    "moe": WorldSpec(n_expert=8, expert_nodes=1),  # tiny qwen3moe; one of the three trunks an expert node
    # layers placed by speed, every trunk a stage (a layer's 5 ms outweighs a hop's cost): a 'churn'
    # fault can move them
    "churn": WorldSpec(objective="throughput", ms_per_layer=5.0, deadlines_s=10.0),
}


def scratch_dir() -> str | None:
    """Where the template and each run's homes live: in memory (/dev/shm) where there is one. The
    product writes its files with an fsync each (a plan version, a revocation, a config): some 6 ms
    each on this machine's disk, 8 or more a run, wall time the run waits for; in memory, 10 µs."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


class Template:
    """Model file and homes for a spec, made once per process."""

    _made: dict[WorldSpec, "Template"] = {}

    def __init__(self, spec: WorldSpec) -> None:
        # Imported here, not by the first run's asker: the import draws random bytes (multiprocessing's
        # authkey), which would shift that run's seeded draws from every later run's.
        import llama_cpp  # noqa: F401

        self.spec = spec
        self.root = Path(tempfile.mkdtemp(prefix="swarmctl-sim-", dir=scratch_dir()))
        atexit.register(shutil.rmtree, self.root, True)
        moe = {"arch": "qwen3moe", "n_expert": spec.n_expert, "n_expert_used": 2} if spec.n_expert else {}
        self.model = write_tiny_model(self.root / "tiny.gguf", TinyConfig(n_layer=spec.n_layer, n_embd=spec.n_embd,
                                                                                   vocab_limit=spec.vocab, **moe),
                                      default_model_path())
        host_address = self.host_address = f"127.0.0.2:{free_udp_port('127.0.0.2')}"
        self.pid = os.getpid()  # (a process forked after it shares its host port with its siblings)
        host = SwarmHome(self.root / "homes" / "host")
        create_swarm(host, swarm_name="sim", host_name="host", listen=host_address, advertise=[host_address],
                     model=str(self.model), planner=PlannerSettings(objective=spec.objective, head_layers=spec.head_layers,
                                                             expert_nodes=spec.expert_nodes))
        with GGUFFile(self.model) as gguf:  # the host's hashes of the model, in its home: no run's host reads it all
            model_hashes(gguf, ModelSpec.from_gguf(gguf).n_layer, host.file(HASH_CACHE_FOLDER))
        config = host.load_config()
        for i, name in enumerate([*spec.trunk_names, *spec.askers, *spec.spare_names]):
            role = "trunk" if name.startswith("trunk-") else "asker"
            key, cert, ca_cert = issue_direct(host, name, role=role)
            home = SwarmHome(self.root / "homes" / name)
            home.path.mkdir(mode=0o700)
            home.save_identity(key, cert, ca_cert)
            home.save_config(NodeConfig(name=name, role="member", swarm_name=config.swarm_name,
                                        ca_fingerprint=config.ca_fingerprint, host_name=config.host_name,
                                        host_addresses=config.host_addresses, listen=f"127.0.0.{3 + i}:0",
                                        model=str(self.model)))

    @classmethod
    def of(cls, spec: WorldSpec) -> "Template":
        if spec not in cls._made:
            cls._made[spec] = cls(spec)
        return cls._made[spec]

    def copy_homes(self) -> Path:
        dest = Path(tempfile.mkdtemp(prefix="run-", dir=self.root))
        shutil.copytree(self.root / "homes", dest / "homes")
        return dest


class FixedFigures:
    """A trunk measures this machine as it starts (its speed on the model: a third of a second of
    compute per trunk; what a datagram costs it: hundreds of datagrams, over the network it is
    on) and its speed again from the batches it serves (their wall time): figures that vary from
    run to run and process to process, and the plan follows them. In the simulator every trunk
    reports the same fixed figures at start (of the tiny model on this 2-core machine, measured
    once) and none from its batches (whose compute runs inline, in no virtual time): runs are
    cheaper, a run's plan does not depend on how busy the machine is, and a replay in a fresh
    process sends the same datagrams as the run in a sweep (measured in the run, the datagram
    cost took 1.3 virtual seconds and its datagrams' draws from the network's seed, in the first
    run of each process only).

    A 'churn' fault makes one node's figures ``slower[node]`` times the usual while it lasts:
    what it measures, and what its stage reports from its batches, at most once every
    ``CHURN_REPORT_S`` virtual seconds (the host plans with the best of the last few), then the
    usual figure once when it is over. A run with such a fault has an idle trunk's re-measuring
    at ``CHURN_IDLE_REMEASURE_S`` (the product's 60 s is most of a run), and the host's re-plan
    gate at HostBounds'."""

    MS_PER_LAYER = WorldSpec.ms_per_layer  # a decode token through one layer (a world may say otherwise)
    PROMPT_MS_PER_ROW = 0.004  # a prompt row through one layer
    US_PER_DATAGRAM = 500.0  # a 1350-byte datagram, both ends of a hop
    CHURN_REPORT_S = 3.0
    CHURN_IDLE_REMEASURE_S = 5.0  # a trunk given no layers measures again (kernels/speed.py)

    def __init__(self) -> None:
        import swarmctl.trunk.service as trunk_service
        import swarmctl.trunk.speed_report as speed_report

        self.module, self.service = speed_report, trunk_service
        self.real = (speed_report.measure_speed, speed_report.measure_prompt_rate)
        self.real_cost = trunk_service.measure_datagram_cost
        self.real_tracker = speed_report.SpeedTracker

        self.ms_per_layer = self.MS_PER_LAYER  # this run's (``of``)
        self.churn = False  # this run has a 'churn' fault
        self.slower: dict[str, float] = {}  # node → its figures' factor, while a 'churn' fault lasts
        figures = self

        class FixedTracker(speed_report.SpeedTracker):
            def __init__(self, **kwargs) -> None:
                super().__init__(**kwargs)
                if figures.churn:
                    self.idle_remeasure_s = figures.CHURN_IDLE_REMEASURE_S

            def observe(self, batches, n_layers, **kwargs) -> None:
                pass  # (a batch's wall time says nothing under the virtual clock)

            def serving_report(self, reported: float | None, now: float | None = None) -> float | None:
                figure, usual = figures.node_ms_per_layer(), figures.ms_per_layer
                now = asyncio.get_running_loop().time()
                if figure == usual and reported == figure or now - self.last_report < figures.CHURN_REPORT_S:
                    return None
                self.last_report = now
                return figure

        self.tracker = FixedTracker

    def node_ms_per_layer(self) -> float:
        """The figure of the node whose code runs now."""
        return self.ms_per_layer * self.slower.get(CURRENT_NODE.get(), 1.0)

    def _measure_speed(self, gguf, **kwargs):
        return self._measurement(self.node_ms_per_layer(), kwargs.get("n_threads"))

    def _measure_prompt_rate(self, gguf, **kwargs):
        return self._measurement(self.PROMPT_MS_PER_ROW, kwargs.get("n_threads"))

    @staticmethod
    def _measurement(ms: float, n_threads: int | None):
        from kernels.speed import SpeedMeasurement

        return SpeedMeasurement(ms, repeats=(), starved=(), contended=False, seconds=0.0, n_threads=n_threads or 1)

    async def _datagram_cost(self, *args, **kwargs):
        from net.packet_cost import DEFAULT_DATAGRAM_SIZE, DatagramCost

        return DatagramCost(self.US_PER_DATAGRAM, DEFAULT_DATAGRAM_SIZE, ())

    def of(self, spec: "WorldSpec", churn: bool = False) -> "FixedFigures":
        """The figures of a run in ``spec``'s world, with a 'churn' fault or not (entered next)."""
        self.ms_per_layer, self.churn, self.slower = spec.ms_per_layer, churn, {}
        return self

    def __enter__(self) -> "FixedFigures":
        self.module.measure_speed = self._measure_speed
        self.module.measure_prompt_rate = self._measure_prompt_rate
        self.service.measure_datagram_cost = self._datagram_cost
        self.module.SpeedTracker = self.tracker
        return self

    def __exit__(self, *exc) -> None:
        self.module.measure_speed, self.module.measure_prompt_rate = self.real
        self.service.measure_datagram_cost = self.real_cost
        self.module.SpeedTracker = self.real_tracker


FIGURES = FixedFigures()


class HostBounds:
    """The host's bounds that are longer than a run's minute, shortened where a run needs them to
    pass: with a 'churn' fault, the re-plan gate (plans/hysteresis.py: a gain sustained 90 s, the
    plan in use standing 60 s); in a world with ``deadlines_s``, the staged plan's and a stage's
    ready deadlines (600 s and 60 s). Nothing changes otherwise."""

    CHURN_SUSTAIN_S = 5.0
    CHURN_SETTLE_S = 10.0

    def __init__(self) -> None:
        import swarmctl.host.planning as planning

        self.planning = planning
        self.real = (planning.ReplanGate, planning.STAGED_DEADLINE_S, planning.READY_DEADLINE_S)
        self.churn, self.deadlines_s = False, 0.0

    def of(self, spec: "WorldSpec", churn: bool) -> "HostBounds":
        self.churn, self.deadlines_s = churn, spec.deadlines_s
        return self

    def __enter__(self) -> "HostBounds":
        if self.churn:
            self.planning.ReplanGate = functools.partial(self.real[0], sustain_s=self.CHURN_SUSTAIN_S,
                                                         settle_s=self.CHURN_SETTLE_S)
        if self.deadlines_s:
            self.planning.STAGED_DEADLINE_S = self.planning.READY_DEADLINE_S = self.deadlines_s
        return self

    def __exit__(self, *exc) -> None:
        self.planning.ReplanGate, self.planning.STAGED_DEADLINE_S, self.planning.READY_DEADLINE_S = self.real


HOST_BOUNDS = HostBounds()


@contextlib.contextmanager
def seeded_randomness(seed: int):
    """The random bytes a run draws (request ids, QUIC connection IDs, TLS randoms: os.urandom and
    the secrets module on top of it) and the random module's draws (jitter), from the run's seed:
    a replay draws the same ones. Restored after the run."""
    rng = random.Random(f"urandom-{seed}")
    real, real_system, state = os.urandom, random._urandom, random.getstate()
    os.urandom = random._urandom = rng.randbytes  # (random's SystemRandom, under secrets, reads its own copy)
    random.seed(f"random-{seed}")
    try:
        yield
    finally:
        os.urandom, random._urandom = real, real_system
        random.setstate(state)


def free_udp_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def udp_free(address: str) -> bool:
    """Whether nothing on this machine holds UDP ``ip:port`` now."""
    ip, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, int(port)))
        except OSError:
            return False
    return True


def move_host(homes: dict[str, SwarmHome], address: str) -> None:
    """Every home's idea of where the host listens, changed to ``address`` (a run's copy)."""
    for name, home in homes.items():
        config = home.load_config()
        if name == config.host_name:
            config = dataclasses.replace(config, listen=address)
        home.save_config(dataclasses.replace(config, host_addresses=[address]))


class NodeComputeThreads:
    """One compute thread per node, as each node is a process of its own (swarmctl/batching.py
    compute_thread: "all engines of a process compute on one thread"). Only with real threads
    (``VirtualClockLoop.inline_threads = False``): shared by every node of the simulator's one
    process, a stage's compute thread waiting for its expert calls held the thread the expert
    node's answer had to be computed on, until the call's wall-clock timeout."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}

    def _compute_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        # (called on a compute thread, where the node's context is not: a stage loading its runner)
        thread = threading.current_thread().name
        node = thread[len("ggml-"):].rpartition("_")[0] if thread.startswith("ggml-") else CURRENT_NODE.get() or "-"
        if node not in self.executors:
            self.executors[node] = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                         thread_name_prefix=f"ggml-{node}")
        return self.executors[node]

    def __enter__(self) -> "NodeComputeThreads":
        import swarmctl.batching as batching
        import swarmctl.trunk.service as trunk_service

        self.modules = (batching, trunk_service)
        self.real = batching.compute_thread
        if self.on:
            for module in self.modules:
                module.compute_thread = self._compute_thread
        return self

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            module.compute_thread = self.real

    def close(self) -> None:
        """After the run's teardown (its nodes' last calls)."""
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)


def run_as(node: str, coro) -> asyncio.Task:
    """Start ``coro`` as node ``node``: its tasks, sockets and timers are that node's."""
    context = contextvars.copy_context()
    context.run(CURRENT_NODE.set, node)
    return asyncio.get_running_loop().create_task(coro, context=context)


def kill_node(loop: VirtualClockLoop, network: SimNetwork, node: str) -> None:
    """kill -9: its sockets vanish without a word, and none of its code runs again."""
    for transport in network.endpoints_of(node):
        transport.kill()
    for task in list(loop.node_tasks.get(node, {}).values()):
        task.cancel()
