"""The host's membership rules: creating the swarm, issuing and redeeming invites, admitting and
revoking members. Pure state changes on a ``SwarmHome``; no networking."""

from __future__ import annotations

import time

from cryptography import x509

from kernels.errors import EngineError
from net.identity import (IdentityError, check_name, fingerprint, make_ca, new_private_key, public_key_from_csr,
                          sign_member)
from net.invite import Invite, hash_secret, secret_matches
from plans.options import PlannerSettings
from swarmctl.node.home import InviteRecord, MemberRecord, NodeConfig, SwarmHome


SPENT_INVITE_MEMORY_S = 30 * 86400  # how long past its expiry the host still recognises an invite


class JoinRefused(EngineError):
    """An invite or join request the host turns down. The message goes back to the joiner."""


def create_swarm(home: SwarmHome, *, swarm_name: str, host_name: str, listen: str, advertise: list[str],
                 model: str | None, planner: PlannerSettings = PlannerSettings()) -> NodeConfig:
    """A new swarm in ``home``, this node its host and CA, planning with ``planner``."""
    if home.exists:
        raise JoinRefused(f"{home.path} already holds a swarm node (remove it or set SWARMCTL_HOME)")
    check_name(host_name)
    ca_key, ca_cert = make_ca(swarm_name)
    key = new_private_key()
    cert = sign_member(ca_key, ca_cert, key.public_key(), host_name, role="host")
    home.ensure_private()
    home.save_ca(ca_key)
    home.save_identity(key, cert, ca_cert)
    config = NodeConfig(name=host_name, role="host", swarm_name=swarm_name, ca_fingerprint=fingerprint(ca_cert),
                        host_name=host_name, host_addresses=advertise, listen=listen, model=model)
    planner.into_config(config)
    with home.locked():
        home.save_members({host_name: MemberRecord(host_name, cert.serial_number, fingerprint(cert), time.time(),
                                                   role="host")})
        home.save_invites({})
    home.save_config(config)
    return config


def issue_invite(home: SwarmHome, *, ttl_seconds: int, uses: int, role: str = "trunk") -> Invite:
    config = home.load_config()
    home.ca_key()  # only the host can invite
    if ttl_seconds <= 0 or uses <= 0:
        raise JoinRefused("--ttl and --uses must be positive")
    if role not in ("trunk", "asker"):
        raise JoinRefused(f"an invite's role is trunk or asker, not {role!r}")
    invite = Invite.new(tuple(config.host_addresses), config.ca_fingerprint, ttl_seconds, role)
    with home.locked():
        # Spent and expired invites are kept a while (their secrets hashed, as always), so a code
        # used twice is told "already used" rather than "not recognised".
        invites = {t: r for t, r in home.invites().items() if r.expires_at + SPENT_INVITE_MEMORY_S > time.time()}
        invites[invite.token_id] = InviteRecord(invite.token_id, hash_secret(invite.secret), invite.expires_at,
                                                uses, time.time(), role)
        home.save_invites(invites)
    return invite


def admit(home: SwarmHome, *, token_id: str, secret: bytes, csr_pem: bytes, name: str) -> x509.Certificate:
    """Redeem an invite and sign the joiner's key. All checks happen before any state changes, and
    the invite's use is counted in the same locked transaction as the new member's record, so a
    failed join leaves the swarm as it was and a single-use invite admits exactly one member."""
    ca_key = home.ca_key()
    ca_cert = home.credentials().ca_cert
    try:
        check_name(name)
        public_key = public_key_from_csr(csr_pem)
    except IdentityError as e:
        raise JoinRefused(str(e)) from None
    with home.locked():
        invites = home.invites()
        record = invites.get(token_id)
        # Only the holder of the right secret learns more than this: a guesser cannot tell an
        # unknown token from a known one.
        if record is None or not secret_matches(secret, record.secret_hash):
            raise JoinRefused("invite not recognised (unknown token or wrong secret)")
        if record.uses_left <= 0:
            raise JoinRefused("this invite has already been used; ask the host for a new one ('swarmctl invite')")
        if record.expires_at < time.time():
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.expires_at))
            raise JoinRefused(f"this invite expired at {when} (host time); ask the host for a new one "
                              "('swarmctl invite')")
        members = home.members()
        if name in members:
            raise JoinRefused(f"a member named {name!r} already exists; choose another with --name")
        # (the host's record decides the role; the invite named in the certificate makes every
        # name joined with it share one budget wherever the node cannot ask the host: net/protocol.py)
        cert = sign_member(ca_key, ca_cert, public_key, name, role=record.role, invite=token_id)
        record.uses_left -= 1
        members[name] = MemberRecord(name, cert.serial_number, fingerprint(cert), time.time(), role=record.role,
                                     invite=token_id)
        home.save_invites(invites)
        home.save_members(members)
    return cert


def accounts(members: dict[str, MemberRecord]) -> dict[str, str]:
    """Whose budget each member spends: one invite is one person, however many
    names they joined with, so every name of an invite is charged to the first that joined with it.
    Only the names that are charged to another are listed (the rest spend their own)."""
    first: dict[str, str] = {}
    for record in sorted(members.values(), key=lambda r: (r.joined_at, r.name)):
        if record.invite:
            first.setdefault(record.invite, record.name)
    return {r.name: first[r.invite] for r in members.values() if r.invite and first[r.invite] != r.name}


def revoke(home: SwarmHome, name: str) -> MemberRecord:
    config = home.load_config()
    home.ca_key()
    if name == config.name:
        raise JoinRefused("the host cannot revoke itself")
    with home.locked():
        members = home.members()
        if name not in members:
            raise JoinRefused(f"no member named {name!r}")
        members[name].revoked = True
        home.save_members(members)
    return members[name]


def issue_direct(home: SwarmHome, name: str, role: str = "trunk"):
    """For a local swarm that one process sets up entirely: a key and certificate for ``name``,
    recorded as a member, without the invite round trip."""
    ca_key, ca_cert = home.ca_key(), home.credentials().ca_cert
    key = new_private_key()
    cert = sign_member(ca_key, ca_cert, key.public_key(), name, role=role)
    with home.locked():
        members = home.members()
        members[name] = MemberRecord(name, cert.serial_number, fingerprint(cert), time.time(), role=role)
        home.save_members(members)
    return key, cert, ca_cert
