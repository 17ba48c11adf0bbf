"""A node's state on disk, under ``$SWARMCTL_HOME`` (default: the platform's per-user data folder).

    node.json      what this node is: name, role, addresses, CA fingerprint, model, head layers
    ca.pem         the swarm CA certificate (every member)
    node.key       this node's private key                      (0600)
    node.pem       this node's certificate, signed by the CA
    ca.key         the CA's private key                         (host only, 0600)
    members.json   membership registry: name, serial, revoked   (host only)
    invites.json   invite token ids → SHA-256 of the secret, expiry, uses left (host only, 0600)

Several nodes on one machine = several homes. Host-side registries are changed under an
exclusive file lock, so ``swarmctl invite`` and a running host never lose each other's updates.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography import x509

from kernels.errors import EngineError
from net.identity import (Credentials, load_cert, load_private_key, save_cert, save_private_key, write_public,
                          write_secret)
from plans.proposal import HEAD_LAYERS

DEFAULT_PORT = 7470


class HomeError(EngineError):
    """Missing or inconsistent node state; one line for the user."""


def default_home() -> Path:
    env = os.environ.get("SWARMCTL_HOME")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "swarmctl"
    if os.name == "nt":
        return Path(os.environ.get("APPDATA", Path.home())) / "swarmctl"
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "swarmctl"


@dataclass
class NodeConfig:
    name: str
    role: str  # "host" or "member"
    swarm_name: str
    ca_fingerprint: str
    host_name: str  # the host's member name (its certificate's DNS name)
    host_addresses: list[str]  # where members reach the host
    listen: str  # where this node listens, HOST:PORT
    model: str | None = None  # GGUF path; None = the bundled default
    head_layers: int = HEAD_LAYERS  # host only: layers the asker keeps at each end
    created_at: float = field(default_factory=time.time)
    objective: str = "latency"  # host only: what the planner optimises (latency or throughput)
    plan_context: int = 4096  # host only: KV room per request each stage must hold ...
    plan_concurrent: int = 4  # ... for this many requests at once
    plan_max_stages: int = 0  # host only: 0 = any number; more trunks than this stand by
    expert_nodes: int = 0  # host only, MoE models: trunks that hold experts instead of layers
    wire_dtype: str = "f32"  # host only: how activations travel between machines (plans/options.py)
    kernels: str = "plain"  # host only: the CPU kernels every member computes with (plans/options.py)
    attention: str = "plain"  # host only: plain or flash attention, on every member (plans/options.py)
    model_url: str = ""  # host only: a folder URL serving the model's files with Range requests (a mirror)


@dataclass
class MemberRecord:
    name: str
    serial: int
    fingerprint: str
    joined_at: float
    revoked: bool = False
    role: str = "trunk"  # what its certificate lets it be (net.identity.ROLES)
    invite: str = ""  # the token id of the invite it joined with ("" before this was kept)


@dataclass
class InviteRecord:
    token_id: str
    secret_hash: str
    expires_at: int
    uses_left: int
    created_at: float
    role: str = "trunk"  # the role the host signs into the joiner's certificate


class SwarmHome:
    def __init__(self, path: Path | None = None) -> None:
        self.path = (path or default_home()).expanduser()

    # --- paths ---
    @property
    def config_path(self) -> Path:
        return self.path / "node.json"

    @property
    def exists(self) -> bool:
        return self.config_path.exists()

    def file(self, name: str) -> Path:
        return self.path / name

    # --- node ---
    def load_config(self) -> NodeConfig:
        if not self.exists:
            raise HomeError(f"no swarm state at {self.path} (run 'swarmctl init' on the host or "
                            "'swarmctl join CODE' on a member, or set SWARMCTL_HOME)")
        try:
            return NodeConfig(**json.loads(self.config_path.read_text()))
        except (ValueError, TypeError) as e:
            raise HomeError(f"{self.config_path} is damaged: {e}") from None

    def ensure_private(self) -> None:
        """The home exists and only its owner can enter it: it holds a private key (and on the host
        the CA key and invite hashes). An existing folder with looser bits is tightened, not trusted."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.path.stat().st_mode & 0o077:
            os.chmod(self.path, 0o700)

    def save_config(self, config: NodeConfig) -> None:
        self.ensure_private()
        write_public(self.config_path, json.dumps(asdict(config), indent=2).encode())

    def save_identity(self, key: Ed25519PrivateKey, cert: x509.Certificate, ca_cert: x509.Certificate) -> None:
        self.ensure_private()
        save_private_key(self.file("node.key"), key)
        save_cert(self.file("node.pem"), cert)
        save_cert(self.file("ca.pem"), ca_cert)

    def credentials(self) -> Credentials:
        try:
            return Credentials(load_private_key(self.file("node.key")), load_cert(self.file("node.pem")),
                               load_cert(self.file("ca.pem")))
        except FileNotFoundError as e:
            raise HomeError(f"missing identity file {e.filename}") from None

    # --- host only ---
    def save_ca(self, key: Ed25519PrivateKey) -> None:
        save_private_key(self.file("ca.key"), key)

    def ca_key(self) -> Ed25519PrivateKey:
        path = self.file("ca.key")
        if not path.exists():
            raise HomeError(f"{self.path} is not the host's home (no CA key): run this on the host")
        return load_private_key(path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive lock for read-modify-write of the host registries (across processes)."""
        self.ensure_private()
        fd = os.open(self.file(".lock"), os.O_RDWR | os.O_CREAT, 0o600)  # 0600 whatever the umask says
        with os.fdopen(fd, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def members(self) -> dict[str, MemberRecord]:
        raw = self._read_json("members.json", {})
        return {name: MemberRecord(**rec) for name, rec in raw.items()}

    def save_members(self, members: dict[str, MemberRecord]) -> None:
        write_public(self.file("members.json"), json.dumps({n: asdict(m) for n, m in members.items()},
                                                           indent=2).encode())

    def invites(self) -> dict[str, InviteRecord]:
        raw = self._read_json("invites.json", {})
        return {tid: InviteRecord(**rec) for tid, rec in raw.items()}

    def save_invites(self, invites: dict[str, InviteRecord]) -> None:
        write_secret(self.file("invites.json"), json.dumps({t: asdict(r) for t, r in invites.items()},
                                                           indent=2).encode())

    def revoked_serials(self) -> frozenset[int]:
        return frozenset(m.serial for m in self.members().values() if m.revoked)

    def _read_json(self, name: str, default):
        path = self.file(name)
        if not path.exists():
            return default
        try:
            return json.loads(path.read_text())
        except ValueError as e:
            raise HomeError(f"{path} is damaged: {e}") from None
