"""A trunk proves it holds the layers it serves, and the host plans on speeds it timed itself
(swarmctl/node/layer_proof.py). First the pieces on their own (a slice file answers exactly as the full
model; the probe's outputs check out, and echoes or noise do not), then a real swarm into which
members with trunk certificates register, claim what they like and answer the host's checks
wrongly, not at all, or correctly from a real model file: none of the liars ever becomes a ready
stage, and the askers' answers stay exact."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path

import numpy as np
import pytest

from kernels.gguf_file import GGUFFile
from net import messages as m
from net.endpoint import Address, ask_member, close, connect_member
from net.wire import decode_control, encode_control
from swarmctl.node import layer_proof as lp
from swarmctl.model_files.distribution import CHUNK, SliceFile, build_manifest
from swarmctl.node.home import SwarmHome
from harness.swarm import Swarm, swarmctl

PROMPT = "The three primary colours are"
ASK = ("ask", "--raw", "--temperature", "0", "--max-tokens", "16")


def _write_slice(gguf: GGUFFile, folder: Path, start: int, stop: int) -> Path:
    """A slice file exactly as a trunk that fetched layers [start, stop) from the host has it."""
    n_layer = max(int(n.split(".")[1]) for n in gguf.tensors if n.startswith("blk.")) + 1
    manifest = build_manifest(gguf, start, stop, "f" * 64)
    out = SliceFile(folder / "slice.gguf", manifest)
    for i, entry in enumerate(manifest.tensors):
        data = gguf.tensor_bytes(gguf.tensors[entry.name])
        for offset in range(0, entry.n_bytes, CHUNK):
            out.write(i, offset, bytes(data[offset:offset + CHUNK]))
    return out.finish([gguf.layer_hash(i) for i in range(n_layer)])


@pytest.fixture(scope="module")
def model(bundled_model):
    with GGUFFile(bundled_model) as gguf:
        yield gguf


@pytest.fixture(scope="module")
def slice_file(model, tmp_path_factory):
    return _write_slice(model, tmp_path_factory.mktemp("slice"), 10, 13)


# --- the layer check ---

def test_a_fetched_slice_answers_exactly_as_the_full_model(model, slice_file):
    names = model.layer_tensor_names(11)
    first = model.tensors[names[0]].n_bytes
    size = lp.layer_size(model, 11)
    boundary = [[11, first - 100, 256], [11, size - 256, 256], [10, 0, 4096], [12, 12345, 1]]
    with GGUFFile(slice_file) as part:
        for _ in range(5):
            nonce = secrets.token_bytes(16)
            windows = lp.new_windows(model, [10, 11, 12]) + boundary
            assert lp.window_digest(part, nonce, windows) == lp.window_digest(model, nonce, windows)
        # a window across two tensors reads the end of one and the start of the next, in layer_hash's order
        assert lp.read_window(part, 11, first - 3, 6) == \
            bytes(model.tensor_bytes(model.tensors[names[0]])[-3:]) + bytes(model.tensor_bytes(model.tensors[names[1]])[:3])
        assert lp.window_digest(part, b"a" * 16, boundary) != lp.window_digest(part, b"b" * 16, boundary)
        with pytest.raises(lp.ProofError, match="past the layer"):
            lp.read_window(part, 11, size - 10, 11)


def test_one_changed_byte_fails_the_check(model, slice_file, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(slice_file.read_bytes())
    with GGUFFile(slice_file) as part:
        info = part.tensors[part.layer_tensor_names(11)[1]]
        where = info.offset + 1000
        layer_offset = part.tensors[part.layer_tensor_names(11)[0]].n_bytes + 1000
    with open(bad, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0x01]))
    windows = [[11, layer_offset - 100, 256]]
    with GGUFFile(bad) as tampered:
        assert lp.window_digest(tampered, b"n" * 16, windows) != lp.window_digest(model, b"n" * 16, windows)
        assert lp.window_digest(tampered, b"n" * 16, [[12, 0, 256]]) == lp.window_digest(model, b"n" * 16, [[12, 0, 256]])


def answer(prover: lp.Prover, message: dict) -> dict:
    """The prover's answer to a challenge as the trunk gets it: parsed where it arrives, then answered."""
    return m.as_dict(prover.answer(m.parse(message, lp.CHALLENGES)))


def test_the_trunk_answers_only_bounded_challenges_about_layers_it_holds(slice_file):
    prover = lp.Prover(lambda: [slice_file], n_threads=1)
    nonce = secrets.token_hex(16)
    for bad in ({"type": "prove", "nonce": nonce, "windows": [[11, 0, 1 << 20]]},
                {"type": "prove", "nonce": nonce, "windows": [[11, 0, 16]] * 65},
                {"type": "prove", "nonce": "zz" * 16, "windows": [[11, 0, 16]]},
                {"type": "prove", "nonce": nonce, "windows": [[11, -1, 16]]},
                {"type": "prove", "nonce": nonce, "windows": [[11, 0, 16]], "probe": {"layer": 11, "steps": 10**6}},
                {"type": "probe_run", "run": 0, "hidden": ""}):
        with pytest.raises((lp.ProofError, m.MalformedMessage)) as e:
            answer(prover, bad)
        assert not getattr(e.value, "missing", False) or bad["type"] == "probe_run", bad
    with pytest.raises(lp.ProofError) as e:  # a layer outside its slice: "missing", not a lie
        answer(prover, {"type": "prove", "nonce": nonce, "windows": [[3, 0, 16]]})
    assert e.value.missing
    prover.close(files=True)


# --- the speed probe ---

def _probe(prover: lp.Prover, layer: int, steps: int, n_embd: int, rng) -> tuple[np.ndarray, np.ndarray, str]:
    answer(prover, {"type": "prove", "nonce": secrets.token_hex(16), "windows": [[layer, 0, 64]],
                    "probe": {"layer": layer, "steps": steps}})
    first = rng.standard_normal((1, n_embd), dtype=np.float32)
    done = answer(prover, {"type": "probe_run", "run": 0, "hidden": lp.encode_array(first)})
    outputs = lp.decode_array(answer(prover, {"type": "probe_reveal", "run": 0})["outputs"], n_embd, steps)
    return first, outputs, done["digest"]


def test_honest_probe_outputs_check_out_and_echoes_or_noise_do_not(model, slice_file):
    rng = np.random.default_rng(0)
    prover = lp.Prover(lambda: [slice_file], n_threads=1)
    first, outputs, digest = _probe(prover, 11, 16, 576, rng)
    assert lp.outputs_digest(outputs) == digest and outputs.shape == (16, 576)
    expected = lp.expected_outputs(model, 11, lp.chain_inputs(first, outputs), n_threads=1)
    assert lp.check_outputs(first, outputs, expected) == ""
    other_layer = lp.expected_outputs(model, 12, lp.chain_inputs(first, outputs), n_threads=1)
    liars = {"echo": lp.chain_inputs(first, outputs), "noise": rng.standard_normal(outputs.shape).astype(np.float32),
             "another layer": other_layer, "nan": np.where(np.arange(16)[:, None] == 3, np.nan, outputs)}
    for name, lie in liars.items():
        assert "off by" in lp.check_outputs(first, lie, expected) or "not finite" in lp.check_outputs(
            first, lie, expected), name
    prover.close(files=True)


def test_the_probe_runs_an_moe_layer_too(tiny_model):
    path = tiny_model("llama-moe-q8_0")
    rng = np.random.default_rng(1)
    with GGUFFile(path) as gguf:
        n_embd = lp.ModelSpec.from_gguf(gguf).n_embd
        prover = lp.Prover(lambda: [path], n_threads=1)
        first, outputs, _ = _probe(prover, 1, 8, n_embd, rng)
        assert lp.check_outputs(first, outputs, lp.expected_outputs(gguf, 1, lp.chain_inputs(first, outputs),
                                                                     n_threads=1)) == ""
        prover.close(files=True)


def test_steps_fit_the_claim_within_bounds():
    assert lp.steps_for(None, 576) == lp.MAX_STEPS
    assert lp.steps_for(0.001, 576) == lp.MAX_STEPS  # a tiny claim gets the most work
    assert lp.steps_for(25.0, 8192) == lp.MIN_STEPS  # a 70B layer: a few steps
    assert lp.steps_for(0.001, 8192) * 8192 * 4 <= lp.MAX_REVEAL_BYTES


def test_the_host_plans_with_the_slower_of_claim_and_timing():
    from swarmctl.host import TrunkInfo

    trunk = TrunkInfo(conn=None, plan_stream=0, listen="127.0.0.1:1", memory=2**30, ms_per_layer_token=0.001)
    trunk.unchecked = True
    assert trunk.planning_speed is None  # a bare claim: the others' figure, not 0.001
    trunk.measured_ms_per_layer = 0.3
    assert trunk.planning_speed == 0.3
    trunk.ms_per_layer_token = 0.9  # slower than timed: its own (pessimistic) figure
    assert trunk.planning_speed == 0.9
    assert trunk.planning_speed_with(0.0001) == 0.3


# --- a real swarm with liars in it ---

@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    s = Swarm(tmp_path_factory.mktemp("proof"))
    os.environ["SWARMCTL_PROOF_TIMEOUT_S"] = "5"  # for the host: a silent trunk is refused after 5 s (30 by default)
    os.environ["SWARMCTL_STAGED_DEADLINE_S"] = "8"  # and one that does not load a staged plan after 8 s
    try:
        s.init()
        s.start_host()
        s.wait_host()
        for name in ("trunk-a", "trunk-b", "asker", "wrong", "silent", "echo", "fast", "lazy", "idle", "gpu-ram",
                     "cpu-ram"):
            s.join(name)
        s.start_trunk("trunk-a", capture=False)
        s.start_trunk("trunk-b", capture=False)
        s.wait_complete(2)
        yield s
    finally:
        os.environ.pop("SWARMCTL_PROOF_TIMEOUT_S", None)
        os.environ.pop("SWARMCTL_STAGED_DEADLINE_S", None)
        s.close()


@pytest.fixture(scope="module")
def inproc_answer():
    return swarmctl(None, *ASK, "--transport", "inproc", PROMPT, check=True).stdout


class FakeTrunk:
    """A member with a trunk certificate, driven by the test: it registers with what it claims,
    says ready when the plan gives it layers (``says_ready``), and answers the host's checks as
    ``answer`` decides (None: not at all)."""

    def __init__(self, swarm: Swarm, name: str, *, memory: int, claim: float | None, answer, says_ready: bool,
                 **register: object):
        self.swarm, self.name = swarm, name
        self.register = {"device": "cpu", **register}  # more of what it registers with (device, a RAM offer)
        self.creds = SwarmHome(swarm.homes[name]).credentials()
        self.memory, self.claim, self.answer, self.says_ready = memory, claim, answer, says_ready
        self.conn = None
        self.plan_stream = None
        self.challenges: list[str] = []
        self.plans: list[dict] = []  # every plan the host pushed to it
        self._tasks: set = set()

    async def start(self) -> dict:
        self.conn = await connect_member(Address("127.0.0.1", self.swarm.host_port), self.creds, "host", self)
        self.plan_stream = self.conn.open_stream()
        reply = await self.conn.request(encode_control({
            "type": "register", "listen": "127.0.0.1:9", "memory": self.memory, "ms_per_layer_token": self.claim,
            "rtt_ms": 0.5, **self.register}), stream_id=self.plan_stream)
        self._spawn(self._keep_alive())
        message = decode_control(reply.body)
        if message["type"] == "plan":  # the answer to registering is a plan, as later pushes are
            self._plan(message["plan"])
        return message

    async def _keep_alive(self) -> None:  # the host marks a trunk down after a few silent seconds
        while self.conn.is_open:
            try:
                await asyncio.wait_for(self.conn.ping(), 1)
            except (ConnectionError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.5)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.conn is not None:
            await close(self.conn)

    # ConnectionHandler
    def connection_made(self, conn) -> None:
        pass

    def stream_ended(self, conn, stream_id) -> None:
        pass

    def connection_lost(self, conn) -> None:
        pass

    def frame_received(self, conn, stream_id, frame) -> None:
        message = decode_control(frame.body)
        if stream_id == self.plan_stream:
            self._plan(message["plan"])
            return
        self.challenges.append(message["type"])
        self._spawn(self._reply(conn, stream_id, message))

    def _plan(self, plan: dict) -> None:
        self.plans.append(plan)
        stage = next((s for s in plan["stages"] if s["member"] == self.name), None)
        if stage is not None and self.says_ready:
            self._spawn(self.conn.request(encode_control({"type": "ready", "plan_version": plan["version"]})))

    async def _reply(self, conn, stream_id, message) -> None:
        reply = await asyncio.to_thread(self.answer, message)
        if reply is not None and conn.is_open:
            conn.send(stream_id, encode_control(reply), end=True)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: (self._tasks.discard(t), t.cancelled() or t.exception()))


async def _status(swarm: Swarm) -> dict:
    creds = SwarmHome(swarm.homes["asker"]).credentials()
    return await ask_member(Address("127.0.0.1", swarm.host_port), creds, "host", {"type": "status"})


async def _row(swarm: Swarm, name: str, until, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        row = next((m for m in (await _status(swarm))["members"] if m["name"] == name), {})
        if until(row):
            return row
        assert time.monotonic() < deadline, (row, [l for l in swarm.nodes[0].log().splitlines() if name in l][-12:])
        await asyncio.sleep(0.3)


def test_liars_never_become_ready_stages_and_askers_get_exact_answers(swarm, inproc_answer, bundled_model):
    honest = lp.Prover(lambda: [bundled_model], n_threads=1)  # what a member holding the model can answer

    def wrong(message: dict) -> dict:  # no model: makes up a digest
        return {"type": "proof", "digest": "00" * 32}

    def echo(message: dict) -> dict:  # holds the model file, but echoes instead of computing
        if message["type"] == "prove":
            return answer(honest, message)
        if message["type"] == "probe_run":  # at once, and what it commits to is what it shows later
            first = lp.decode_array(message["hidden"], 576, 1)
            outputs[message["run"]] = np.repeat(lp.unit_rms(first), honest._probe.steps, axis=0)
            return {"type": "probe_done", "run": message["run"], "digest": lp.outputs_digest(outputs[message["run"]])}
        return {"type": "probe_outputs", "outputs": lp.encode_array(outputs[message["run"]])}

    outputs: dict[int, np.ndarray] = {}

    async def scenario() -> tuple[list[dict], dict[str, dict]]:
        plans: list[dict] = []
        watcher = asyncio.ensure_future(swarm.watch_plans(plans))
        rows = {}
        fakes = {
            # claims to be fast and huge, as in the issue; answers the check with a made-up digest
            "wrong": FakeTrunk(swarm, "wrong", memory=10**12, claim=0.001, answer=wrong, says_ready=True),
            # holds the model file, but its timed steps echo their input
            "echo": FakeTrunk(swarm, "echo", memory=10**12, claim=0.001, answer=echo, says_ready=True),
            # claims no speed (as a trunk that fetches slices does), so it gets a trial; says ready; never answers
            "silent": FakeTrunk(swarm, "silent", memory=10**12, claim=None, answer=lambda m: None, says_ready=True),
        }
        try:
            for name, fake in fakes.items():
                await fake.start()
                rows[name] = await _row(swarm, name, lambda r: r.get("health", "").startswith("refused"))
            await fakes["wrong"].stop()  # and once more: refused at once, without a check
            again = FakeTrunk(swarm, "wrong", memory=10**12, claim=0.001, answer=wrong, says_ready=True)
            await again.start()
            rows["again"] = await _row(swarm, "wrong", lambda r: r.get("health", "").startswith("refused"))
            assert again.challenges == []
            await again.stop()
        finally:
            for fake in fakes.values():
                await fake.stop()
            watcher.cancel()
        return plans, rows

    plans, rows = asyncio.run(scenario())
    honest.close(files=True)
    assert "failed the layer check" in rows["wrong"]["health"] and "bytes at random offsets" in rows["wrong"]["health"]
    assert "failed the speed probe on layer" in rows["echo"]["health"] and "off by" in rows["echo"]["health"]
    assert "failed the layer check: no answer within 5 s" in rows["silent"]["health"], rows["silent"]
    assert "failed a layer check" in rows["again"]["health"]
    ready = {s["member"] for p in plans for s in p["stages"] if s["ready"]}
    assert ready <= {"trunk-a", "trunk-b"}, ready  # no liar was ever a ready stage
    # claims never planned on; the silent one said ready to its trial, failed it, and was never planned
    assert not any(s["member"] in ("wrong", "echo", "silent") for p in plans for s in p["stages"])
    status = swarm.wait_complete(2)
    assert {m["name"] for m in status["members"] if m["layers"]} == {"trunk-a", "trunk-b"}
    r = swarmctl(swarm.homes["asker"], *ASK, PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout == inproc_answer


def test_a_fast_claim_is_planned_at_the_speed_the_host_timed(swarm, inproc_answer, bundled_model):
    """A member that really holds the model and computes its probe honestly, but claims 0.001 ms
    per layer: the host plans it with the figure it timed (at least what one layer costs here)."""
    honest = lp.Prover(lambda: [bundled_model], n_threads=1)

    async def scenario() -> tuple[dict, dict, list[str]]:
        fake = FakeTrunk(swarm, "fast", memory=2**30, claim=0.001, answer=lambda message: answer(honest, message),
                         says_ready=False)
        await fake.start()
        try:
            row = await _row(swarm, "fast", lambda r: r.get("measured_ms_per_layer") is not None)
            nodes = await ask_member(Address("127.0.0.1", swarm.host_port),
                                     SwarmHome(swarm.homes["asker"]).credentials(), "host", {"type": "nodes"})
        finally:
            await fake.stop()
        return row, next(n for n in nodes["nodes"] if n["name"] == "fast"), fake.challenges

    row, node, challenges = asyncio.run(scenario())
    honest.close(files=True)
    assert challenges[:2] == ["prove", "probe_run"] and "probe_reveal" in challenges
    assert row["ms_per_layer_token"] == 0.001  # what it claims...
    assert row["planned_ms_per_layer"] == row["measured_ms_per_layer"] > 0.001  # ...is not what it is planned with
    assert node["ms_per_layer_token"] == pytest.approx(row["planned_ms_per_layer"])
    swarm.wait_complete(2)
    r = swarmctl(swarm.homes["asker"], *ASK, PROMPT)
    assert r.returncode == 0 and r.stdout == inproc_answer, r.stderr


def test_honest_trunks_were_checked_and_timed(swarm):
    log = swarm.nodes[0].log()
    for name in ("trunk-a", "trunk-b"):
        assert f"trunk {name} timed by the host" in log and f"trunk {name} ready with layers" in log
    rows = {m["name"]: m for m in swarm.status()["members"]}
    for name in ("trunk-a", "trunk-b"):
        assert rows[name]["measured_ms_per_layer"] > 0
        assert rows[name]["planned_ms_per_layer"] >= rows[name]["measured_ms_per_layer"]


def test_a_trunk_that_proves_nothing_leaves_the_plan_in_use_alone(swarm, inproc_answer):
    """Issue 30 item 2: a trunk-role member registers with no speed claim ("no model yet") and never
    fetches, loads or proves anything. It used to be planned at once, breaking the working plan
    until it was dropped 61 s later. Now it is sent a trial plan of its own; the plan in use stays,
    and asks answer exactly as before while it is connected."""
    swarm.wait_complete(2)

    async def scenario():
        plans: list[dict] = []
        watcher = asyncio.ensure_future(swarm.watch_plans(plans))
        lazy = FakeTrunk(swarm, "lazy", memory=10**12, claim=None, answer=lambda m: None, says_ready=False)
        try:
            while not plans:
                await asyncio.sleep(0.1)
            await lazy.start()
            row = await _row(swarm, "lazy", lambda r: r.get("health", "").startswith("on trial"), timeout=30)
            answer = await asyncio.to_thread(swarmctl, swarm.homes["asker"], *ASK, PROMPT)
            status = await _status(swarm)
        finally:
            await lazy.stop()
            watcher.cancel()
        return plans, row, answer, status, lazy.plans

    plans, row, answer, status, pushed = asyncio.run(scenario())
    assert len({p["version"] for p in plans}) == 1, [p["version"] for p in plans]  # no new public plan
    assert not any(s["member"] == "lazy" for p in plans for s in p["stages"])
    assert status["complete"] and {m["name"] for m in status["members"] if m["layers"]} == {"trunk-a", "trunk-b"}
    trial = next(p for p in pushed if any(s["member"] == "lazy" for s in p["stages"]))
    assert trial["version"] > plans[0]["version"] and [s["member"] for s in trial["stages"]] == ["lazy"]
    assert row["health"].startswith("on trial: proving layers")
    assert answer.returncode == 0 and answer.stdout == inproc_answer, answer.stderr


@pytest.mark.heavy  # the simulator's 'stall' (tests/test_sim.py: a staged plan whose member never loads)
def test_a_proven_member_that_never_loads_its_layers_leaves_the_plan_in_use_serving(swarm, inproc_answer,
                                                                                   bundled_model):
    """Issue 30 item 2b, make-before-break: a member that holds the model and passes every check,
    so the host plans it, but never loads the layers it is given. The new plan is only staged: it
    goes to the trunks, not to askers, whose plan stays complete and whose asks answer exactly;
    past the deadline (8 s here) the member is left out and the staged plan is given up. Before,
    the new plan was published at once and the swarm was incomplete until the member was dropped."""
    swarm.wait_complete(2)
    honest = lp.Prover(lambda: [bundled_model], n_threads=1)

    async def scenario():
        plans: list[dict] = []
        watcher = asyncio.ensure_future(swarm.watch_plans(plans))
        idle = FakeTrunk(swarm, "idle", memory=10**12, claim=None, answer=lambda message: answer(honest, message),
                         says_ready=False)
        idle.claim = (await _row(swarm, "trunk-a", lambda r: r.get("planned_ms_per_layer")))["planned_ms_per_layer"]
        try:
            while not plans:
                await asyncio.sleep(0.1)
            await idle.start()
            deadline = time.monotonic() + 60
            while not any(p.get("staged") for p in idle.plans):
                assert time.monotonic() < deadline, idle.plans[-1:]
                await asyncio.sleep(0.2)
            answer_while_staged = await asyncio.to_thread(swarmctl, swarm.homes["asker"], *ASK, PROMPT)
            row = await _row(swarm, "idle", lambda r: r.get("health", "").startswith("refused"), timeout=30)
        finally:
            await idle.stop()
            watcher.cancel()
        return plans, idle.plans, answer_while_staged, row

    plans, pushed, answer_while_staged, row = asyncio.run(scenario())
    honest.close(files=True)
    staged = next(p for p in pushed if p.get("staged"))
    assert any(s["member"] == "idle" for s in staged["stages"])
    for p in plans:  # the askers' plan: complete throughout, never the staged one
        assert all(s["ready"] for s in p["stages"]) and not any(s["member"] == "idle" for s in p["stages"]), p
    assert staged["version"] not in {p["version"] for p in plans}
    assert answer_while_staged.returncode == 0 and answer_while_staged.stdout == inproc_answer, \
        answer_while_staged.stderr
    assert f"did not load layers" in row["health"] and f"of plan v{staged['version']} within 8 s" in row["health"]
    status = swarm.wait_complete(2)
    assert {m["name"] for m in status["members"] if m["layers"]} == {"trunk-a", "trunk-b"}


def test_a_gpu_member_offers_host_ram_for_experts_and_the_host_keeps_it_only_beside_a_device(swarm):
    """Issue 33 item 1: a trunk on a GPU may offer host RAM for the routed experts its card cannot
    hold, with the rate it measured (run --device ... --memory); the host keeps both for the planner
    and shows them in status. A trunk on the CPU offers its RAM as its memory already: a RAM offer
    beside it is ignored. A rate no machine has is refused in one line, and the host serves on."""
    swarm.wait_complete(2)

    async def scenario():
        gpu = FakeTrunk(swarm, "gpu-ram", memory=8 * 10**9, claim=1.0, answer=None, says_ready=False,
                        device="vulkan:0", ram_bytes=96 * 10**9, ram_gb_s=41.5)
        cpu = FakeTrunk(swarm, "cpu-ram", memory=8 * 10**9, claim=1.0, answer=None, says_ready=False,
                        ram_bytes=96 * 10**9, ram_gb_s=41.5)
        try:
            registered = [await gpu.start(), await cpu.start()]
            rows = {m["name"]: m for m in swarm.status()["members"]}
        finally:
            await gpu.stop()
            await cpu.stop()
        liar = FakeTrunk(swarm, "cpu-ram", memory=8 * 10**9, claim=1.0, answer=None, says_ready=False,
                         device="vulkan:0", ram_bytes=96 * 10**9, ram_gb_s=5000.0)
        try:
            refused = await liar.start()
        finally:
            await liar.stop()
        return registered, rows, refused

    registered, rows, refused = asyncio.run(scenario())
    assert [r["type"] for r in registered] != ["error", "error"], registered
    assert rows["gpu-ram"]["device"] == "vulkan:0" and rows["gpu-ram"]["memory"] == 8 * 10**9
    assert rows["gpu-ram"]["ram_bytes"] == 96 * 10**9 and rows["gpu-ram"]["ram_gb_s"] == 41.5
    assert rows["cpu-ram"]["ram_bytes"] == 0 and rows["cpu-ram"]["ram_gb_s"] == 0.0
    assert refused["type"] == "error" and "ram_gb_s" in refused["message"] and "\n" not in refused["message"]
    status = swarm.wait_complete(2)  # the two trunks serve on
    assert {m["name"] for m in status["members"] if m["layers"]} == {"trunk-a", "trunk-b"}
