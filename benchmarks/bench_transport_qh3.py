"""The compiled aioquic fork (qh3) on bench_transport's trials, to measure rather than assume it.

    pip install qh3        # optional: not a dependency of swarmctl
    python benchmarks/bench_transport_qh3.py [--repeats 15]

One frame of each size on a fresh stream, a one-byte answer, between two processes on loopback,
at 1350 and 1452-byte datagrams; medians over repeats, printed as JSON. Also reports whether the
server, configured to require client certificates, let a client without one finish its handshake
(``client_without_certificate_accepted``): that is what mutual TLS needs it to refuse.
Certificates are ECDSA P-256 made here (the swarm's own are Ed25519, which this fork's handshake
did not complete with).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {"16KB": 16 * 1024, "28KB": 28 * 1024, "1MB": 1024 * 1024}
DATAGRAMS = (1350, 1452)

try:
    from qh3.asyncio import connect, serve
    from qh3.asyncio.protocol import QuicConnectionProtocol
    from qh3.quic import events
    from qh3.quic.configuration import QuicConfiguration
except ImportError:
    sys.exit("bench_transport_qh3: qh3 is not installed (pip install qh3); it is optional")


def make_credentials(folder: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(text: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("ca")).issuer_name(name("ca")).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    for member in ("receiver", "sender"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(member)).issuer_name(name("ca"))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(member)]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        (folder / f"{member}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{member}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


class Answerer(QuicConnectionProtocol):
    """Receiver: a one-byte answer once a stream's frame has fully arrived."""

    def quic_event_received(self, event) -> None:
        if isinstance(event, events.StreamDataReceived) and event.end_stream:
            self._quic.send_stream_data(event.stream_id, b"k", end_stream=True)
            self.transmit()


class Asker(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.answers: dict[int, asyncio.Future] = {}

    def quic_event_received(self, event) -> None:
        if isinstance(event, events.StreamDataReceived) and event.end_stream:
            answer = self.answers.pop(event.stream_id, None)
            if answer is not None:
                answer.set_result(None)

    async def request(self, data: bytes) -> None:
        stream_id = self._quic.get_next_available_stream_id()
        self.answers[stream_id] = self._loop.create_future()
        self._quic.send_stream_data(stream_id, data, end_stream=True)
        self.transmit()
        await self.answers[stream_id]


async def serve_forever(folder: Path, port: int, datagram: int) -> None:
    config = QuicConfiguration(is_client=False, alpn_protocols=["bench"], max_datagram_size=datagram)
    config.load_cert_chain(folder / "receiver.pem", folder / "receiver.key")
    config.load_verify_locations(cafile=str(folder / "ca.pem"))
    config.verify_mode = ssl.CERT_REQUIRED
    await serve("127.0.0.1", port, configuration=config, create_protocol=Answerer)
    print("ready", flush=True)
    await asyncio.Event().wait()


def client_config(folder: Path, datagram: int, with_certificate: bool) -> QuicConfiguration:
    config = QuicConfiguration(is_client=True, alpn_protocols=["bench"], max_datagram_size=datagram,
                               server_name="receiver")
    config.load_verify_locations(cafile=str(folder / "ca.pem"))
    if with_certificate:
        config.load_cert_chain(folder / "sender.pem", folder / "sender.key")
    return config


async def time_sizes(folder: Path, port: int, datagram: int, repeats: int) -> dict:
    row = {}
    async with connect("127.0.0.1", port, configuration=client_config(folder, datagram, True),
                       create_protocol=Asker) as conn:
        for label, size in SIZES.items():
            data, times = os.urandom(size), []
            for _ in range(repeats + 1):  # the first trial warms the congestion window up; dropped
                t0 = time.perf_counter()
                await conn.request(data)
                times.append(time.perf_counter() - t0)
            median = statistics.median(times[1:])
            row[label] = {"median_ms": median * 1e3, "mb_per_s": size / median / 1e6}
    return row


async def accepts_no_certificate(folder: Path, port: int, datagram: int) -> bool:
    try:
        async with connect("127.0.0.1", port, configuration=client_config(folder, datagram, False),
                           create_protocol=Asker) as conn:
            await asyncio.wait_for(conn.request(b"x"), 5)
            return True
    except (ConnectionError, asyncio.TimeoutError):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--serve", nargs=3, metavar=("CREDS", "PORT", "DATAGRAM"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve_forever(Path(args.serve[0]), int(args.serve[1]), int(args.serve[2])))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from swarmctl.node.local_swarm import free_udp_port

    folder = Path(tempfile.mkdtemp(prefix="bench-qh3-"))
    make_credentials(folder)
    results: dict = {"repeats": args.repeats, "qh3": {}}
    for datagram in DATAGRAMS:
        port = free_udp_port()
        receiver = subprocess.Popen([sys.executable, __file__, "--serve", str(folder), str(port), str(datagram)],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "ready"
            results["qh3"][f"datagram_{datagram}"] = asyncio.run(time_sizes(folder, port, datagram, args.repeats))
            results["client_without_certificate_accepted"] = asyncio.run(accepts_no_certificate(folder, port, datagram))
        finally:
            receiver.kill()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
