"""Invite codes: one line a friend pastes into ``swarmctl join``.

    swarm1.<base64url(JSON payload)>.<checksum>

The payload names the host's address(es), the SHA-256 fingerprint of the swarm CA (the joiner pins
it: it talks to no other host), a token id, a 128-bit secret and an expiry. The checksum (first
8 hex digits of SHA-256 over the payload) catches a damaged or edited code before anything is
sent. The host stores only a hash of the secret and compares in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

PREFIX = "swarm1"
SECRET_BYTES = 16  # 128 bits


class InviteError(Exception):
    """A code that cannot be used. One line, never containing the secret."""


@dataclass(frozen=True)
class Invite:
    addresses: tuple[str, ...]  # "host:port" of the swarm host
    ca_fingerprint: str  # hex SHA-256 of the CA certificate's DER
    token_id: str  # hex, names the invite in the host's store
    secret: bytes  # SECRET_BYTES random bytes; only its hash is stored by the host
    expires_at: int  # unix seconds
    role: str = "trunk"  # what the joiner will be; shown to it (the host signs from its own record)

    @classmethod
    def new(cls, addresses: tuple[str, ...], ca_fingerprint: str, ttl_seconds: int, role: str = "trunk") -> "Invite":
        return cls(addresses, ca_fingerprint, secrets.token_hex(8), secrets.token_bytes(SECRET_BYTES),
                   int(time.time()) + ttl_seconds, role)

    @property
    def expired(self) -> bool:
        return time.time() > self.expires_at

    def encode(self) -> str:
        payload = json.dumps({"v": 1, "a": list(self.addresses), "f": self.ca_fingerprint, "t": self.token_id,
                              "s": _b64(self.secret), "e": self.expires_at, "r": self.role},
                             separators=(",", ":")).encode()
        return f"{PREFIX}.{_b64(payload)}.{_checksum(payload)}"

    @classmethod
    def decode(cls, code: str) -> "Invite":
        parts = code.strip().split(".")
        if len(parts) != 3 or parts[0] != PREFIX:
            raise InviteError("not a swarmctl invite code (expected swarm1.<payload>.<checksum>)")
        try:
            payload = _unb64(parts[1])
        except (binascii.Error, ValueError):
            raise InviteError("invite code is damaged (payload is not base64)") from None
        if not hmac.compare_digest(_checksum(payload), parts[2]):
            raise InviteError("invite code is damaged or was edited (checksum mismatch)")
        try:
            fields = json.loads(payload)
            invite = cls(tuple(str(a) for a in fields["a"]), str(fields["f"]), str(fields["t"]),
                         _unb64(fields["s"]), int(fields["e"]), str(fields.get("r", "trunk")))
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise InviteError("invite code payload is malformed") from None
        if fields.get("v") != 1 or len(invite.secret) != SECRET_BYTES or not invite.addresses:
            raise InviteError("invite code payload is malformed")
        return invite


def hash_secret(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


def secret_matches(secret: bytes, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _checksum(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:8]
