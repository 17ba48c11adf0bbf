"""QUIC + TLS configuration for the swarm, and mutual authentication on top of aioquic.

aioquic's server neither requests nor verifies client certificates by itself. ``require_client_
certificates`` makes it do both for one connection, by hooking its TLS state machine (private
methods of ``aioquic.tls.Context``; aioquic is pinned to 1.7.2 for this):

* the server sends a CertificateRequest in every full handshake;
* a client that answers with no certificate fails the handshake (certificate_required), unless
  the negotiated ALPN is the join protocol, whose whole purpose is to obtain a certificate;
* a presented certificate must chain to the swarm CA, be valid now and not revoked, checked after
  aioquic has verified the CertificateVerify signature (the peer holds the key).

A failed check raises a TLS alert inside the handshake, so the peer never reaches 1-RTT and no
stream data from it is ever processed. Session resumption is never configured (no session ticket
fetcher or handler): a resumed handshake carries no client certificate.
"""

from __future__ import annotations

import ipaddress
import os
import ssl
from typing import Callable

from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from cryptography import x509

from .identity import Credentials, IdentityError, cert_pem, fingerprint
from .liveness import IDLE_TIMEOUT  # read at call time: tests lower it on this module

ALPN_SWARM = "swarmctl/1"
ALPN_JOIN = "swarmctl-join/1"
DEFAULT_DATAGRAM_SIZE = 1350  # fits typical Internet paths (1500-byte MTU with tunnel headroom)
# Loopback has a 64 KiB MTU. aioquic 1.7.2 writes packet lengths in 2 bytes (at most 16383), and
# larger datagrams fail to parse at the peer ("Failed to parse frame", measured), so stay below.
LOOPBACK_DATAGRAM_SIZE = 16000
MAX_STREAM_DATA = 16 * 1024 * 1024
MAX_STREAMS = 1024  # streams a peer may hold open at once (raise_stream_limits)
MAX_DATA = 64 * 1024 * 1024

CertificateCheck = Callable[[x509.Certificate], None]  # raises IdentityError


def datagram_size_for(host: str) -> int:
    """Raise the datagram size where the path allows: loopback always does; other paths take
    $SWARMCTL_MAX_DATAGRAM (e.g. a LAN with jumbo frames) or the Internet-safe default."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return LOOPBACK_DATAGRAM_SIZE
    except ValueError:
        if host == "localhost":
            return LOOPBACK_DATAGRAM_SIZE
    override = os.environ.get("SWARMCTL_MAX_DATAGRAM", "")
    return max(1200, min(int(override), LOOPBACK_DATAGRAM_SIZE)) if override.isdigit() else DEFAULT_DATAGRAM_SIZE


def server_configuration(creds: Credentials, *, alpns: list[str],
                         max_datagram_size: int = DEFAULT_DATAGRAM_SIZE) -> QuicConfiguration:
    config = QuicConfiguration(is_client=False, alpn_protocols=alpns, idle_timeout=IDLE_TIMEOUT,
                               max_datagram_size=max_datagram_size, max_stream_data=MAX_STREAM_DATA,
                               max_data=MAX_DATA)
    config.certificate = creds.cert
    config.private_key = creds.key
    config.certificate_chain = [creds.ca_cert]  # lets a joiner check the CA it pinned
    return config


def client_configuration(creds: Credentials, *, peer_name: str,
                         max_datagram_size: int = DEFAULT_DATAGRAM_SIZE) -> QuicConfiguration:
    """A member connecting to a member: presents its certificate, verifies the peer's against the
    swarm CA, and expects the peer's DNS name to be its member name."""
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN_SWARM], idle_timeout=IDLE_TIMEOUT,
                               max_datagram_size=max_datagram_size, max_stream_data=MAX_STREAM_DATA,
                               max_data=MAX_DATA, server_name=peer_name, verify_mode=ssl.CERT_REQUIRED)
    config.cadata = cert_pem(creds.ca_cert)
    config.certificate = creds.cert
    config.private_key = creds.key
    return config


def join_configuration(max_datagram_size: int = DEFAULT_DATAGRAM_SIZE) -> QuicConfiguration:
    """A joiner has no certificate and no CA yet, only the CA fingerprint from the invite. The
    handshake does not verify the host; ``check_pinned_host`` must pass before anything is sent."""
    return QuicConfiguration(is_client=True, alpn_protocols=[ALPN_JOIN], idle_timeout=IDLE_TIMEOUT,
                             max_datagram_size=max_datagram_size, verify_mode=ssl.CERT_NONE)


def raise_stream_limits(connection: QuicConnection) -> None:
    """Let the peer open MAX_STREAMS streams at once, not aioquic's 128 (it has no setting for it;
    pinned aioquic, set before the handshake sends the transport parameters). Between two stages
    every member's requests ride one connection, a stream per request, so 128 let one asker's
    held requests take the whole path; each member's share at a stage is bounded
    far below this (swarmctl/trunk/budget.py)."""
    for limit in (connection._local_max_streams_bidi, connection._local_max_streams_uni):
        limit.value = limit.sent = MAX_STREAMS


def require_client_certificates(connection: QuicConnection, check: CertificateCheck,
                                anonymous_alpns: frozenset[str] = frozenset()) -> None:
    """Make this server-side connection request and verify the client's certificate."""
    original_initialize = connection._initialize

    def initialize(peer_cid: bytes) -> None:
        original_initialize(peer_cid)
        _hook_tls(connection.tls, check, anonymous_alpns)

    connection._initialize = initialize  # type: ignore[method-assign]


def _hook_tls(context: tls.Context, check: CertificateCheck, anonymous_alpns: frozenset[str]) -> None:
    context._request_client_certificate = True
    handle_certificate = context._server_handle_certificate
    handle_verify = context._server_handle_certificate_verify

    def server_handle_certificate(input_buf) -> None:
        handle_certificate(input_buf)
        if context._peer_certificate is None and context.alpn_negotiated not in anonymous_alpns:
            raise _CertificateRequired("a client certificate is required")

    def server_handle_certificate_verify(input_buf) -> None:
        handle_verify(input_buf)  # the signature: the client holds the certificate's key
        try:
            check(context._peer_certificate)
        except IdentityError as e:
            raise tls.AlertBadCertificate(str(e)) from None

    context._server_handle_certificate = server_handle_certificate  # type: ignore[method-assign]
    context._server_handle_certificate_verify = server_handle_certificate_verify  # type: ignore[method-assign]


class _CertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


def peer_certificate(connection: QuicConnection) -> x509.Certificate | None:
    return getattr(connection.tls, "_peer_certificate", None) if hasattr(connection, "tls") else None


def peer_chain(connection: QuicConnection) -> list[x509.Certificate]:
    return list(getattr(connection.tls, "_peer_certificate_chain", []) or [])


def check_pinned_host(connection: QuicConnection, ca_fingerprint: str) -> x509.Certificate:
    """For a joiner: the host's chain must contain the pinned CA, which must have signed the host's
    certificate. Returns the CA certificate; raises IdentityError otherwise."""
    from .identity import verify_member

    leaf = peer_certificate(connection)
    ca = next((c for c in peer_chain(connection) if fingerprint(c) == ca_fingerprint.lower()), None)
    if leaf is None or ca is None:
        raise IdentityError("the host did not present the swarm CA named in the invite (fingerprint mismatch)")
    verify_member(leaf, ca)
    return ca
