"""The joiner's side of ``swarmctl join``: make a key here, prove the invite to the pinned host,
receive a certificate. Nothing secret leaves this machine except the invite's own secret, and
that only after the host has proven it holds the CA the invite names."""

from __future__ import annotations

import base64

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from net.endpoint import NoAddressAnswered, close, connect_first, connect_pinned_host
from net.identity import IdentityError, make_csr, member_name, new_private_key, verify_member
from net.invite import Invite
from net.protocol import RequestOnlyHandler
from net import messages as m
from net.wire import WireError
from swarmctl.node.home import NodeConfig, SwarmHome
from swarmctl.node.membership import JoinRefused


async def join_swarm(home: SwarmHome, invite: Invite, *, name: str, listen: str, model: str | None) -> NodeConfig:
    if home.exists:
        raise JoinRefused(f"{home.path} already holds a swarm node (remove it or set SWARMCTL_HOME)")
    if invite.expired:
        raise JoinRefused("invite has expired")
    key = new_private_key()
    csr = make_csr(key, name).public_bytes(serialization.Encoding.PEM).decode()
    try:
        conn, ca_cert = await connect_first(
            invite.addresses, lambda address: connect_pinned_host(address, invite.ca_fingerprint, RequestOnlyHandler()),
            failures=(ConnectionError, OSError, IdentityError))
    except NoAddressAnswered as e:
        raise JoinRefused("cannot join: " + "; ".join(f"{text}: {error}" for text, error in e.failures)) from None
    try:
        secret = base64.urlsafe_b64encode(invite.secret).decode().rstrip("=")
        reply = m.decode((await conn.request(m.encode(
            m.Join(token_id=invite.token_id, secret=secret, csr=csr, name=name)))).body, m.Joined)
    except (m.Refused, WireError) as e:
        raise JoinRefused(f"the host refused: {e}") from None
    finally:
        await close(conn)
    cert = x509.load_pem_x509_certificate(reply.cert.encode())
    verify_member(cert, ca_cert)
    if member_name(cert) != name or cert.public_key() != key.public_key():
        raise JoinRefused("the host returned a certificate for another name or key")
    home.save_identity(key, cert, ca_cert)
    config = NodeConfig(name=name, role="member", swarm_name=reply.swarm_name,
                        ca_fingerprint=invite.ca_fingerprint, host_name=reply.host_name,
                        host_addresses=list(dict.fromkeys([*invite.addresses, *reply.host_addresses])),
                        listen=listen,
                        model=model)
    home.save_config(config)
    return config
