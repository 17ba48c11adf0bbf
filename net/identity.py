"""Swarm identities: the swarm CA, member keys and certificates, and how they are checked.

Keys are Ed25519 (small, fast, supported by aioquic's TLS 1.3). The host's CA signs member
certificates; it takes only the public key from a member's CSR and decides subject, validity and
key usage itself. Private keys are written with mode 0600, atomically.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
INVITE_PATTERN = re.compile(r"^[0-9a-f]{1,64}$")  # an invite's token id (hex: net/invite.py)
MEMBER_VALIDITY = dt.timedelta(days=365)
CA_VALIDITY = dt.timedelta(days=3650)
CLOCK_SKEW = dt.timedelta(minutes=5)


# What a certificate lets its holder be. The host signs the role the invite named; a node's
# claims never widen it. A trunk may also ask (a friend who serves and asks); an asker only asks.
ROLES = ("host", "trunk", "asker")
LEGACY_ROLE = "trunk"  # certificates issued before roles existed could do what a trunk does


class IdentityError(Exception):
    """A certificate, key or CSR that does not pass. One line, safe to show and log."""


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):  # (match's $ would accept a trailing newline)
        raise IdentityError(f"invalid member name {name!r}: use 1-32 of a-z, 0-9 and '-', starting alphanumeric")
    return name


def new_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER bytes, hex."""
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def make_ca(swarm_name: str) -> tuple[Ed25519PrivateKey, x509.Certificate]:
    key = new_private_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"swarmctl CA {swarm_name}")])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, None)
    )
    return key, cert


def make_csr(key: Ed25519PrivateKey, name: str) -> x509.CertificateSigningRequest:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, check_name(name))])
    return x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, None)


def public_key_from_csr(csr_pem: bytes) -> Ed25519PublicKey:
    """The CSR's public key, after checking the CSR is signed by its key (proof of possession)."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError:
        raise IdentityError("the certificate request is not a PEM CSR") from None
    if not csr.is_signature_valid:
        raise IdentityError("the certificate request's signature does not verify")
    key = csr.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise IdentityError("the certificate request must carry an Ed25519 key")
    return key


def sign_member(ca_key: Ed25519PrivateKey, ca_cert: x509.Certificate, public_key: Ed25519PublicKey,
                name: str, validity: dt.timedelta = MEMBER_VALIDITY, role: str = "trunk",
                invite: str = "") -> x509.Certificate:
    """A member certificate: CN and DNS name = member name, OU = its role, UID = the token id of
    the invite it joined with (if any: see member_account), usable as TLS client and server."""
    if role not in ROLES:
        raise IdentityError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    if invite and not INVITE_PATTERN.fullmatch(invite):
        raise IdentityError(f"invalid invite token id {invite!r}")
    now = _now()
    subject = [x509.NameAttribute(NameOID.COMMON_NAME, check_name(name)),
               x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role)]
    if invite:
        subject.append(x509.NameAttribute(NameOID.USER_ID, invite))
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, None)
    )


REVOKED_REASON = "membership revoked"  # why a revoked member's connections close, and its handshakes fail


def revoked_reason(name: str) -> str:
    """What a revoked member is told, wherever it is refused (a handshake, a connection closed)."""
    return f"{REVOKED_REASON}: member {name!r} was revoked by the host"


def is_revocation(reason: str) -> bool:
    """Whether a connection's close reason says this member was revoked (it should stop retrying)."""
    return REVOKED_REASON in reason


def member_role(cert: x509.Certificate) -> str:
    """The role the CA signed into a certificate (see ROLES)."""
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    role = str(roles[0].value) if roles else LEGACY_ROLE
    return role if role in ROLES else "asker"  # an unknown role gets the least


def member_account(cert: x509.Certificate) -> str:
    """Whose budgets the holder of a certificate spends on a node (what it may make the node
    buffer): every name joined with one invite is one person (swarmctl/node/membership.py accounts()),
    so a certificate that names its invite spends the invite's ("invite:<token id>"; no member
    name has a colon), and one that names none (the host's, a local swarm's, one issued before
    certificates named their invite) its own name's."""
    invites = cert.subject.get_attributes_for_oid(NameOID.USER_ID)
    invite = str(invites[0].value) if invites else ""
    return f"invite:{invite}" if invite else member_name(cert)


def member_name(cert: x509.Certificate) -> str:
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def verify_member(cert: x509.Certificate, ca_cert: x509.Certificate, revoked_serials: frozenset[int] = frozenset(),
                  now: dt.datetime | None = None) -> str:
    """Check a presented member certificate: signed by our CA, valid now, not revoked, a leaf.
    Returns the member name; raises IdentityError saying why not."""
    now = now or _now()
    if cert.issuer != ca_cert.subject:
        raise IdentityError("certificate was not issued by this swarm's CA")
    ca_key = ca_cert.public_key()
    try:
        assert isinstance(ca_key, Ed25519PublicKey)
        ca_key.verify(cert.signature, cert.tbs_certificate_bytes)
    except (InvalidSignature, AssertionError):
        raise IdentityError("certificate signature does not verify against this swarm's CA") from None
    if now < cert.not_valid_before_utc or now > cert.not_valid_after_utc:
        raise IdentityError("certificate is outside its validity period")
    if cert.serial_number in revoked_serials:
        raise IdentityError(revoked_reason(member_name(cert)))
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise IdentityError("a CA certificate cannot act as a member")
    except x509.ExtensionNotFound:
        raise IdentityError("certificate lacks basic constraints") from None
    name = member_name(cert)
    check_name(name)
    return name


# --- files ---

def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_secret(path: Path, data: bytes) -> None:
    """Secrets (private keys, token hashes) are written 0600, never world- or group-readable."""
    _write_atomic(path, data, 0o600)


def write_public(path: Path, data: bytes) -> None:
    _write_atomic(path, data, 0o644)


def save_private_key(path: Path, key: Ed25519PrivateKey) -> None:
    write_secret(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))


def load_private_key(path: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path} does not hold an Ed25519 private key")
    return key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def save_cert(path: Path, cert: x509.Certificate) -> None:
    write_public(path, cert_pem(cert))


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@dataclass(frozen=True)
class Credentials:
    """What a member presents and trusts: its key and certificate, and the swarm CA."""

    key: Ed25519PrivateKey
    cert: x509.Certificate
    ca_cert: x509.Certificate

    @property
    def name(self) -> str:
        return member_name(self.cert)
