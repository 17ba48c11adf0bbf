"""Rough edges a new user met in the first hour (issue 13, item 6): a bad model file said at once,
a used invite called used, a silent address called silent, memory shown as typed, and the
planner's settings changeable after init."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

import net.tls
from net.endpoint import Address, connect_member, no_answer
from net.identity import make_csr, new_private_key
from net.messages import MemberStatus, RecoveryStatus, Status
from net.protocol import RequestOnlyHandler
from swarmctl.commands.run import parse_size
from swarmctl.commands.status import format_table
from swarmctl.node.home import SwarmHome
from swarmctl.node.local_swarm import free_udp_port
from swarmctl.node.membership import JoinRefused, admit, create_swarm, issue_invite
from harness.swarm import Swarm, swarmctl
from harness.tiny_models import write_unsupported_model


def _one_line_error(r) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def _bad_models(tmp: Path) -> dict[str, tuple[Path, str]]:
    notes = tmp / "notes.txt"
    notes.write_text("these are my notes, not a model\n")
    return {
        "missing file": (tmp / "nope.gguf", "model file not found"),
        "not GGUF": (notes, "is not a GGUF file"),
        "unsupported architecture": (write_unsupported_model(tmp / "bert.gguf"),
                                     "architecture 'bert' is not supported"),
    }


# --- a bad model: one line at once, before any swarm starts or any connection opens ---

@pytest.mark.parametrize("case", ["missing file", "not GGUF", "unsupported architecture"])
def test_ask_with_a_bad_model_and_no_swarm_says_so_at_once(tmp_path, case):
    model, expected = _bad_models(tmp_path)[case]
    t0 = time.monotonic()
    r = swarmctl(tmp_path / "no-swarm-here", "ask", "--model", str(model), "hello", timeout=60)
    line = _one_line_error(r)
    assert expected in line and "cannot reach" not in line, line
    assert r.stdout == ""
    assert time.monotonic() - t0 < 8  # no local swarm was started and waited for (that took ~9 s and more)


@pytest.mark.parametrize("k, rc, expected", [
    ("-2", 2, "argument --head-layers: head-layers must be a whole number of at least 0, not '-2'"),
    ("15", 1, "--head-layers 15 leaves 0 of the model's 30 layers for 1 local trunk: use at most 14"),
])
def test_ask_with_head_layers_out_of_bounds_says_so_before_a_local_swarm_starts(tmp_path, k, rc, expected):
    """A bound at parsing, and one against the model once it is known: a local swarm whose trunk
    had no layer used to wait for a plan until its 600 s bound."""
    r = swarmctl(tmp_path / "no-swarm-here", "ask", "--trunk-nodes", "1", "--head-layers", k, "hello", timeout=60)
    assert r.returncode == rc and expected in _one_line_error(r), r.stderr


def test_ask_with_a_joined_home_checks_the_model_before_connecting(tmp_path):
    home = tmp_path / "host"  # a swarm whose host is not running: only the model check can answer quickly
    swarmctl(home, "init", "--listen", f"127.0.0.1:{free_udp_port()}", check=True)
    model, expected = _bad_models(tmp_path)["not GGUF"]
    t0 = time.monotonic()
    line = _one_line_error(swarmctl(home, "ask", "--model", str(model), "hello", timeout=60))
    assert expected in line, line
    assert time.monotonic() - t0 < 8


@pytest.mark.parametrize("case", ["missing file", "not GGUF", "unsupported architecture"])
def test_init_with_a_bad_model_fails_and_leaves_nothing(tmp_path, case):
    model, expected = _bad_models(tmp_path)[case]
    home = tmp_path / "host"
    line = _one_line_error(swarmctl(home, "init", "--model", str(model), "--listen", "127.0.0.1:7999", timeout=60))
    assert expected in line, line
    assert not (home / "node.json").exists()


# --- invites: used and expired codes called so, and nothing for a guesser ---

def _joiner_csr(name: str) -> bytes:
    return make_csr(new_private_key(), name).public_bytes(serialization.Encoding.PEM)


@pytest.fixture
def host_home(tmp_path) -> SwarmHome:
    home = SwarmHome(tmp_path / "host")
    create_swarm(home, swarm_name="s", host_name="host", listen="127.0.0.1:7470", advertise=["127.0.0.1:7470"],
                 model=None)
    return home


def test_a_used_invite_is_called_used_even_after_newer_invites(host_home):
    invite = issue_invite(host_home, ttl_seconds=3600, uses=1)
    admit(host_home, token_id=invite.token_id, secret=invite.secret, csr_pem=_joiner_csr("alice"), name="alice")
    issue_invite(host_home, ttl_seconds=3600, uses=1)  # the next friend's code: the host tidies its records
    with pytest.raises(JoinRefused, match="this invite has already been used; ask the host for a new one"):
        admit(host_home, token_id=invite.token_id, secret=invite.secret, csr_pem=_joiner_csr("bob"), name="bob")
    # a wrong secret for that same (known, used) token learns nothing more than an unknown token does
    with pytest.raises(JoinRefused, match=r"^invite not recognised \(unknown token or wrong secret\)$"):
        admit(host_home, token_id=invite.token_id, secret=b"x" * 16, csr_pem=_joiner_csr("eve"), name="eve")
    with pytest.raises(JoinRefused, match=r"^invite not recognised \(unknown token or wrong secret\)$"):
        admit(host_home, token_id="0123456789abcdef", secret=invite.secret, csr_pem=_joiner_csr("eve"), name="eve")
    assert "bob" not in host_home.members() and "eve" not in host_home.members()
    assert all(len(r.secret_hash) == 64 for r in host_home.invites().values())  # still only hashes on disk
    assert invite.secret.hex() not in (host_home.path / "invites.json").read_text()


def test_an_expired_invite_is_called_expired(host_home):
    invite = issue_invite(host_home, ttl_seconds=3600, uses=1)
    with host_home.locked():
        invites = host_home.invites()
        invites[invite.token_id].expires_at = int(time.time()) - 60
        host_home.save_invites(invites)
    issue_invite(host_home, ttl_seconds=3600, uses=1)
    with pytest.raises(JoinRefused, match="this invite expired at .*; ask the host for a new one"):
        admit(host_home, token_id=invite.token_id, secret=invite.secret, csr_pem=_joiner_csr("bob"), name="bob")
    with pytest.raises(JoinRefused, match=r"^invite not recognised"):
        admit(host_home, token_id=invite.token_id, secret=bytes(16), csr_pem=_joiner_csr("bob"), name="bob")


# --- a silent address: no QUIC jargon ---

def test_no_answer_names_the_address_and_the_udp_port(tmp_path, monkeypatch, host_home):
    monkeypatch.setattr(net.tls, "IDLE_TIMEOUT", 1.0)  # the handshake gives up after 1 s instead of 8
    address = Address("127.0.0.1", free_udp_port())  # nothing listens there

    async def attempt() -> str:
        try:
            await connect_member(address, host_home.credentials(), "host", RequestOnlyHandler())
        except ConnectionError as e:
            return str(e)
        raise AssertionError("connected to nothing")

    message = asyncio.run(attempt())
    assert message == no_answer(address)
    port = address.port
    assert message == f"no answer from 127.0.0.1:{port} (is it running, and is UDP port {port} reachable?)"
    assert "Idle timeout" not in message


# --- memory: shown as typed ---

@pytest.mark.parametrize("text, expected", [("12G", 12_000_000_000), ("12GB", 12_000_000_000),
                                            ("12gb", 12_000_000_000), ("512M", 512_000_000),
                                            ("1.5T", 1_500_000_000_000), ("16GiB", 16 * 2**30),
                                            ("16Gi", 16 * 2**30), ("2000000", 2_000_000)])
def test_memory_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "12", "0G", "-1G", "12X", "G", "1e9"])
def test_bad_memory_sizes(text):
    from swarmctl.errors import UsageError

    with pytest.raises(UsageError, match="invalid size"):
        parse_size(text)


def test_a_bare_number_for_memory_asks_for_a_unit(tmp_path):
    line = _one_line_error(swarmctl(tmp_path / "no-swarm-here", "run", "--role", "trunk", "--memory", "12"))
    assert line == ("swarmctl run: argument --memory: invalid size '12': that is 12 bytes; give a unit "
                    "(examples: 512M, 12G)"), line


def test_status_shows_the_memory_as_typed_and_a_split_stage():
    members = [MemberStatus(name="alice", role="trunk", may="trunk", address="198.51.100.7:7471", layers=[4, 15],
                            memory=parse_size("12G"), health="ready"),
               MemberStatus(name="bob", role="trunk", may="trunk", address="198.51.100.9:7471", layers=[15, 26],
                            memory=parse_size("24GB"), health="ready", device="cuda:0",
                            placement="cuda:0 for layers [15, 20), cpu for [20, 26)")]
    status = Status(swarm="s", model="m.gguf", n_layer=30, head_layers=4, plan_version=2, complete=True,
                    missing_layers=[], members=members, objective="latency", expected_ms_per_token=0.0,
                    expected_tokens_per_s=0.0, bottleneck="", warnings=[], recovery=RecoveryStatus())
    table = format_table(status)
    assert " 12.0 GB " in table and " 24.0 GB " in table, table
    # partial offload: which of bob's layers are on its GPU; alice (all on one device) gets no line
    assert " cuda:0 " in table and "\nbob: cuda:0 for layers [15, 20), cpu for [20, 26)" in table, table
    assert "alice:" not in table


# --- the planner's settings after init ---

def test_config_shows_and_changes_settings_of_a_stopped_host(tmp_path):
    home = tmp_path / "host"
    swarmctl(home, "init", "--listen", f"127.0.0.1:{free_udp_port()}", check=True)
    shown = swarmctl(home, "config", check=True).stdout
    assert "objective     latency" in shown and "context       4096 tokens" in shown
    r = swarmctl(home, "config", "objective", "throughput", "context", "8192", check=True)
    assert "objective: throughput, was latency" in r.stdout and "context: 8192 tokens, was 4096 tokens" in r.stdout
    assert "the host is not running" in r.stdout
    saved = json.loads((home / "node.json").read_text())
    assert saved["objective"] == "throughput" and saved["plan_context"] == 8192


@pytest.mark.parametrize("args, expected", [
    (["objective", "fastest"], "objective must be one of latency, throughput, even, not 'fastest'"),
    (["context", "0"], "context must be a whole number of at least 1"),
    (["max-stages", "two"], "max-stages must be a whole number of at least 0"),
    (["speed", "11"], "unknown setting 'speed'"),
    (["objective"], "objective needs a value"),
])
def test_config_bad_input(tmp_path, args, expected):
    home = tmp_path / "host"
    swarmctl(home, "init", "--listen", f"127.0.0.1:{free_udp_port()}", check=True)
    before = (home / "node.json").read_text()
    line = _one_line_error(swarmctl(home, "config", *args))
    assert expected in line, line
    assert (home / "node.json").read_text() == before


def test_config_without_a_swarm_or_on_a_member(tmp_path):
    assert "no swarm state" in _one_line_error(swarmctl(tmp_path / "nothing", "config"))
    host = tmp_path / "host"
    swarmctl(host, "init", "--listen", f"127.0.0.1:{free_udp_port()}", check=True)
    member = tmp_path / "alice"  # a member's home as 'join' leaves it, as far as 'config' looks
    member.mkdir()
    config = json.loads((host / "node.json").read_text())
    (member / "node.json").write_text(json.dumps({**config, "name": "alice", "role": "member"}))
    line = _one_line_error(swarmctl(member, "config", "objective", "even"))
    assert "belongs to member alice" in line and "on the host" in line, line


def test_config_tells_a_running_host_which_replans(tmp_path):
    swarm = Swarm(tmp_path)
    swarm.init("--objective", "latency")
    try:
        swarm.start_host()
        swarm.wait_host()
        assert swarm.status()["objective"] == "latency"
        r = swarmctl(swarm.host_home, "config", "objective", "throughput", "max-stages", "2", timeout=60)
        assert r.returncode == 0, r.stderr
        assert "the running host re-planned under them: plan v" in r.stdout, r.stdout
        assert swarm.status()["objective"] == "throughput"
        assert "settings changed: objective throughput" in swarm.nodes[0].log()
    finally:
        swarm.close()


@pytest.mark.parametrize("value", ["two", "0"])
def test_a_bad_threads_variable_is_one_line_before_any_node_starts(value):
    """`ask` with no swarm starts a local one, whose nodes would each fail on $SWARMCTL_THREADS;
    it waited on them until its deadline. The CLI reads the variable first."""
    r = swarmctl(None, "ask", "--max-tokens", "2", "hi", timeout=60, env_extra={"SWARMCTL_THREADS": value})
    assert r.returncode == 1
    assert _one_line_error(r) == f"swarmctl: error: SWARMCTL_THREADS='{value}': give a whole number of threads, 1 or more"
