"""The leakage meter: a real local swarm captures, the attack reads the captures with the GGUF only.

One swarm (host + 2 trunk processes, capture on) serves the module; the inversion table is built
once into a temporary cache that the CLI test reuses.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from kernels.threads import usable_cores
from kernels.tokenizer import Tokenizer
from net.endpoint import Address
from net.relay import ImpairedLink
from net.wire import ActivationPacket, PacketKind, encode_control, encode_packet
from swarmctl.audit.capture import read_capture, received_streams
from swarmctl.audit.meter import AuditSettings, attack_and_score, capture_traffic, load_prompts
from swarmctl.audit.noise import UplinkNoise, calibrate
from swarmctl.audit.traffic import run_prompts
from swarmctl.node.local_swarm import Fronts, LocalSwarm, free_udp_port
from plans.options import PlannerSettings
from harness.swarm import swarmctl

AUDIT_ROOT = Path(__file__).resolve().parents[1] / "swarmctl" / "audit"


@pytest.fixture(scope="module")
def table_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("audit-cache")


@pytest.fixture(scope="module")
def capture_swarm(bundled_model):
    with LocalSwarm(model=str(bundled_model), n_trunks=2, planner=PlannerSettings(head_layers=4),
                    threads=1, capture=True) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def clean_audit(capture_swarm, bundled_model, table_cache):
    # The table's batched build on every core this process has to itself (the swarm is idle by
    # then): 57 s on one thread, 37.5 on two. Under `-n auto` the other workers compute beside it,
    # and two threads then waited at ggml's barriers: the fixture took 145 s on two cores.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    settings = AuditSettings(head_layers=4, max_tokens=8, cache_dir=table_cache,
                             table_threads=max(1, usable_cores() // workers))
    runs, captures = capture_traffic(capture_swarm, bundled_model, load_prompts(), settings, threads=1)
    return runs, captures, attack_and_score(bundled_model, runs, captures, settings)


def test_the_meter_recovers_prompts_from_undefended_traffic(clean_audit):
    runs, _, report = clean_audit
    s = report.summary()
    assert len(report.prompts) == 20 and report.missing == 0
    assert s["prompt_tokens"] == sum(len(r.prompt_tokens) for r in runs) > 400
    assert s["prompt_token_recovery"] >= 0.95, report.table()  # the acceptance bar: the meter works
    assert s["generated_tokens"] > 0 and s["generated_token_recovery"] >= 0.95, report.table()
    assert s["downlink_tokens"] == sum(len(r.generated) for r in runs)
    assert s["downlink_top1_agreement"] >= 0.95, report.table()  # the tail is public: outputs leak too
    assert 1 <= s["candidates_per_token_mean"] <= report.max_candidates
    assert s["candidates_per_token_max"] <= report.max_candidates
    # what the table and the JSON say is what the summary says
    data = json.loads(json.dumps(report.to_dict()))
    assert data["prompt_token_recovery"] == s["prompt_token_recovery"] and len(data["per_prompt"]) == 20
    assert "prompt tokens (first stage, uplink)" in report.table()


def test_the_attack_reads_only_public_weights_and_captured_bytes():
    """The attack modules import nothing from the asker's side (traffic, asker, swarm link, noise)."""
    siblings = {".capture", ".tables", ".invert", ".downlink"}
    for name in ("capture.py", "tables.py", "invert.py", "downlink.py", "attack.py"):
        for node in ast.walk(ast.parse((AUDIT_ROOT / name).read_text())):
            if isinstance(node, ast.ImportFrom):
                modules = ["." * node.level + (node.module or "")]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                assert not module.startswith("swarmctl"), f"{name} imports {module}"
                assert not module.startswith("net") or module == "net.wire", f"{name} imports {module}"
                assert not module.startswith(".") or module in siblings, f"{name} imports {module}"


def test_noise_reaches_the_wire_and_is_measured(capture_swarm, bundled_model, table_cache, clean_audit):
    clean_runs = clean_audit[0][:3]
    settings = AuditSettings(head_layers=4, max_tokens=4, uplink_noise=1.0, noise_seed=0, max_candidates=16,
                             cache_dir=table_cache)
    runs, captures = capture_traffic(capture_swarm, bundled_model, load_prompts()[:3], settings, threads=1)
    report = attack_and_score(bundled_model, runs, captures, settings)
    s = report.summary()
    assert report.uplink_noise == 1.0 and len(report.prompts) == 3
    # the uplink no longer reproduces exactly: what left the asker was perturbed
    assert s["early_exit_share"] < 0.2, report.table()
    assert s["candidates_per_token_max"] == 16
    assert 0.0 <= s["prompt_token_recovery"] <= 1.0
    # the trunk's output is not perturbed on its way back: the last stage still reads the answers
    assert s["downlink_top1_agreement"] >= 0.95, report.table()
    assert [r.prompt_tokens for r in runs] == [r.prompt_tokens for r in clean_runs]


def test_uplink_noise_is_scaled_per_dimension(bundled_model):
    std = calibrate(bundled_model, 4, n_threads=1)
    assert std.shape == (576,) and (std > 0).all()
    noise = UplinkNoise(std, 0.5, np.random.default_rng(1))
    x = np.zeros((4000, 576), np.float32)
    measured = noise(x).std(axis=0)
    assert np.allclose(measured, 0.5 * std, rtol=0.1)
    assert AuditSettings().uplink_noise == 0.0  # off by default


def test_capture_reader_skips_what_is_not_an_activation(tmp_path):
    good = ActivationPacket(PacketKind.PREFILL, b"r" * 16, 1, 4, 0, np.ones((3, 8), np.float32))
    (tmp_path / "000001-recv-activation.bin").write_bytes(encode_packet(good)[5:])
    (tmp_path / "000002-recv-activation.bin").write_bytes(b"\x01\x02garbage")
    (tmp_path / "000003-recv-control.bin").write_bytes(encode_control({"type": "subscribe"})[5:])
    rewind = ActivationPacket(PacketKind.DECODE, b"r" * 16, 1, 4, 2, np.full((1, 8), 7, np.float32))
    (tmp_path / "000004-recv-activation.bin").write_bytes(encode_packet(rewind)[5:])
    packets = read_capture(sorted(tmp_path.iterdir()))
    assert [p.seq for p in packets] == [1, 4]
    (stream,) = received_streams(packets)
    assert stream.layer_index == 4 and stream.n_prefill == 3 and stream.complete
    assert stream.states()[2, 0] == 7  # a later packet at a position overwrites it, as a rewind does


def test_no_plaintext_on_the_wire(bundled_model):
    """Relays that record every UDP datagram sit in front of the host and both trunks: neither the
    prompt's text nor its token ids, nor even the activations, cross the wire in the clear."""
    text = "Zanzibar Quokka-7731 wired 4471 euros to Priya Raghunathan"

    async def scenario():
        host_port, trunk_ports = free_udp_port(), [free_udp_port(), free_udp_port()]
        relays = [ImpairedLink(Address("127.0.0.1", p), record=True) for p in (host_port, *trunk_ports)]
        for relay in relays:
            await relay.start()
        try:
            fronts = Fronts.behind([host_port, *trunk_ports], [str(r.address) for r in relays])
            with LocalSwarm(model=str(bundled_model), n_trunks=2, planner=PlannerSettings(head_layers=4),
                            threads=1, capture=True,
                            fronts=fronts) as swarm:
                runs = await run_prompts(swarm, bundled_model, [text], max_tokens=4, n_threads=1)
                packets = read_capture(f for d in swarm.capture_dirs for f in sorted(d.iterdir()))
            return runs[0], packets, [r.recorded for r in relays]
        finally:
            for relay in relays:
                relay.close()

    run, packets, recorded = asyncio.run(scenario())
    wire = b"".join(d for datagrams in recorded for d in datagrams)
    activations = [p.packet for p in packets if p.packet.kind == PacketKind.PREFILL and p.direction == "recv"]
    assert activations and len(wire) > activations[0].data.nbytes  # the relays carried the traffic
    ids = Tokenizer(bundled_model).encode_prompt(text)
    assert ids == run.prompt_tokens
    needles = [text.encode(), b"Zanzibar", b"Quokka", b"Raghunathan", "Zanzibar".encode("utf-16-le")]
    for fmt in ("<i", "<q", "<I", ">i", "<H"):
        needles.append(b"".join(struct.pack(fmt, t) for t in ids[:3]))
    needles.append(json.dumps(ids[:3])[1:-1].encode())
    payload = activations[0].data.tobytes()  # the first stage's plaintext view, as it captured it
    needles += [payload[i:i + 32] for i in range(0, len(payload), len(payload) // 8)]
    for needle in needles:
        assert needle not in wire, f"{needle[:40]!r} crossed the wire in the clear"


def test_cli_audit_prints_json(tmp_path, table_cache, clean_audit):  # clean_audit: the table is cached by now
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# two prompts\nMy PIN is 4471.\ndef f(x):\\n    return x * 2\n")
    r = swarmctl(None, "audit", "--prompts", str(prompts), "--max-tokens", "2", "--cache", str(table_cache),
                 "--json", "-", timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["prompts"] == 2 and data["head_layers"] == 4 and data["uplink_noise"] == 0
    assert data["prompt_token_recovery"] >= 0.9
    assert data["per_prompt"][1]["text"] == "def f(x):\n    return x * 2"


@pytest.mark.parametrize("args, message", [
    (["--prompts", "no-such-file.txt"], "no-such-file.txt"),
    (["--head-layers", "15"], "too few"),
    (["--uplink-noise", "-1"], "must be 0 or more"),
])
def test_cli_audit_bad_input_gets_one_line(tmp_path, args, message):
    r = swarmctl(None, "audit", *args, "--cache", str(tmp_path))
    assert r.returncode != 0 and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
