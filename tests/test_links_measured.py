"""Every link the plan uses is measured (issue 17): the throughput probe on real loopback QUIC
(net/probe.py), the status rows built from a plan and the trunks' reports (swarmctl/host/status.py),
and how `status` prints them."""

from __future__ import annotations

import asyncio

import pytest

from net import messages as m
from net.endpoint import Address, close, connect_member, serve_member
from net.identity import Credentials, make_ca, new_private_key, sign_member
from net.probe import MAX_PROBE_BYTES, ProbeRefused, ProbeSink, measure_link, rate_mb_s, send_probe
from net.protocol import RequestOnlyHandler, SwarmProtocol
from net.wire import Frame, FrameType, WireError, decode_control, encode_frame
from plans.nodes import ASKER, Link
from plans.plan import Plan, StageAssignment
from swarmctl.commands.status import format_links
from swarmctl.host.status import StatusSources, link_rows
from swarmctl.host.trunks import TrunkInfo


class Answerer(RequestOnlyHandler):
    """Answers probes the way the host and trunks do: ``probe`` to the sink, DATA frames to it first."""

    def __init__(self) -> None:
        self.sink = ProbeSink()
        self.other_frames = 0  # frames the sink did not take

    def frame_received(self, conn: SwarmProtocol, stream_id: int, frame: Frame) -> None:
        if self.sink.take_data(conn, stream_id, frame):
            return
        try:
            message = m.parse(decode_control(frame.body), m.kinds(m.Probe))
        except WireError as e:
            self.other_frames += 1
            conn.reject_stream(stream_id, str(e))
            return
        self.sink.start(conn, stream_id, message)

    def stream_ended(self, conn: SwarmProtocol, stream_id: int) -> None:
        self.sink.stream_ended(conn, stream_id)

    def connection_lost(self, conn: SwarmProtocol) -> None:
        self.sink.connection_lost(conn)


def _member(name, ca_key, ca_cert) -> Credentials:
    key = new_private_key()
    return Credentials(key, sign_member(ca_key, ca_cert, key.public_key(), name), ca_cert)


async def _pair() -> tuple[object, SwarmProtocol, Answerer]:
    ca_key, ca_cert = make_ca("probe")
    answerer = Answerer()
    server = await serve_member(Address("127.0.0.1", 0), _member("b", ca_key, ca_cert), answerer,
                                client_check=lambda cert: None)
    port = server._transport.get_extra_info("sockname")[1]
    conn = await connect_member(Address("127.0.0.1", port), _member("a", ca_key, ca_cert), "b", RequestOnlyHandler())
    return server, conn, answerer


def test_the_probe_measures_round_trip_and_throughput_on_loopback_quic():
    async def scenario():
        server, conn, answerer = await _pair()
        try:
            first = await measure_link(conn, 256 * 1024)
            second = await measure_link(conn)  # the default size, on the same connection
            return first, second, answerer.sink.bytes_taken, conn.is_open
        finally:
            await close(conn)
            server.close()

    first, second, taken, still_open = asyncio.run(scenario())
    for measure in (first, second):
        assert measure.rtt_ms > 0 and measure.bandwidth_mb_s > 0
        assert measure.elapsed_ms > 0
        # the probe's bytes in the time it took: no faster than the bytes over the whole time allows
        # (and the round trip is taken out, so at least that)
        assert measure.bandwidth_mb_s >= measure.probe_bytes / (measure.elapsed_ms * 1e3) * 0.999
        claim = measure.claim()
        assert claim.rtt_ms == measure.rtt_ms and claim.bandwidth_mb_s == measure.bandwidth_mb_s
    assert taken == 256 * 1024 + 512 * 1024
    assert still_open
    print(f"loopback: {first.rtt_ms:.2f} ms, {first.bandwidth_mb_s:.0f} MB/s (256 KiB); "
          f"{second.rtt_ms:.2f} ms, {second.bandwidth_mb_s:.0f} MB/s (512 KiB)")


def test_the_cap_refuses_an_oversized_probe_and_the_connection_carries_on():
    async def scenario():
        server, conn, answerer = await _pair()
        try:
            with pytest.raises(ProbeRefused, match="over the cap"):
                await send_probe(conn, MAX_PROBE_BYTES + 1, timeout=10)
            # a probe that sends more than it announced: its stream is reset, nothing more taken
            stream = conn.open_stream()
            with pytest.raises(ConnectionError):
                await conn.request(m.encode(m.Probe(n_bytes=1000)) + encode_frame(FrameType.DATA, bytes(2000)),
                                   timeout=10, stream_id=stream)
            # a stream that ends before its announced bytes is answered with an error
            with pytest.raises(m.Refused, match="ended before"):
                m.decode((await conn.request(m.encode(m.Probe(n_bytes=1000)), timeout=10)).body, m.Ok)
            after = await measure_link(conn, 64 * 1024)  # the same connection still measures
            bare = m.decode((await conn.request(m.encode(m.Probe()), timeout=10)).body, m.Ok)  # round trip only
            return after, bare, answerer.sink.bytes_taken, answerer.other_frames, conn.is_open
        finally:
            await close(conn)
            server.close()

    after, bare, taken, others, still_open = asyncio.run(scenario())
    assert still_open and after.rtt_ms > 0 and after.bandwidth_mb_s > 0
    assert isinstance(bare, m.Ok)
    assert taken == 64 * 1024  # neither the refused payload nor the overlong one counted
    assert others == 0  # the refused probe's payload was dropped by the sink, not handled as a request


def test_one_probe_per_connection_is_in_flight_at_a_time():
    async def scenario():
        server, conn, _ = await _pair()
        try:
            # the first announces its bytes and holds them back; the second is refused meanwhile
            held = conn.open_stream()
            conn.send(held, m.encode(m.Probe(n_bytes=4096)))
            with pytest.raises(ProbeRefused, match="in flight"):
                await send_probe(conn, 1024, timeout=10)
            conn.send(held, encode_frame(FrameType.DATA, bytes(4096)), end=True)
            return await send_probe(conn, 1024, timeout=10)
        finally:
            await close(conn)
            server.close()

    assert asyncio.run(scenario()) > 0


def test_rate_takes_the_round_trip_out_and_never_divides_by_zero():
    assert rate_mb_s(1_000_000, elapsed_ms=11.0, rtt_ms=1.0) == pytest.approx(100.0)  # 1 MB in 10 ms
    assert rate_mb_s(1_000_000, elapsed_ms=5.0, rtt_ms=9.0) == pytest.approx(2000.0)  # at least a tenth
    assert rate_mb_s(10**9, elapsed_ms=0.0, rtt_ms=0.0) == m.MAX_BANDWIDTH_MB_S


# --- status rows ---

def _trunk(listen: str, rtt_ms: float | None, links: dict[str, Link]) -> TrunkInfo:
    return TrunkInfo(conn=None, plan_stream=0, listen=listen, memory=8 * 10**9, rtt_ms=rtt_ms,  # type: ignore[arg-type]
                     links=links)


def _sources(trunks, measured_bw=frozenset()) -> StatusSources:
    plan = Plan(version=3, model_name="m", n_layer=30, head_layers=4,
                stages=[StageAssignment("a", "10.0.0.1:7471", 4, 14), StageAssignment("b", "10.0.0.2:7471", 14, 20),
                        StageAssignment("c", "10.0.0.3:7471", 20, 26)])
    return StatusSources(home=None, host_name="host", host_address="10.0.0.9:7470", swarm_name="s",  # type: ignore[arg-type]
                         plan=plan, trunks=trunks, online=set(), reports=None,  # type: ignore[arg-type]
                         bandwidth_measured=set(measured_bw))


def test_status_rows_follow_the_plan_and_say_what_is_measured():
    trunks = {
        "a": _trunk("10.0.0.1:7471", 4.0, {"b": Link(10.0, 80.0), ASKER: Link(4.2, 120.0)}),
        "b": _trunk("10.0.0.2:7471", 6.0, {}),  # measured nothing but the host at join
        "c": _trunk("10.0.0.3:7471", 30.0, {}),
    }
    rows = link_rows(_sources(trunks, {("a", "b"), ("a", ASKER)}))
    assert [(r.source, r.target) for r in rows] == [(ASKER, "a"), ("a", "b"), ("b", "c"), ("c", ASKER)]
    asker_a, a_b, b_c, c_asker = rows
    # the asker's side as the planner takes it: the trunk's own later report (round trip and probe)
    # wins over the round trip it measured at join
    assert (asker_a.rtt_ms, asker_a.bandwidth_mb_s, asker_a.measured, asker_a.bandwidth_measured) == \
        (4.2, 120.0, True, True)
    assert trunks["a"].planned_links()[ASKER] == Link(4.2, 120.0)
    assert trunks["b"].planned_links()[ASKER] == Link(trunks["b"].rtt_ms)  # no report yet: the join's
    assert (a_b.rtt_ms, a_b.bandwidth_mb_s, a_b.basis, a_b.measured, a_b.bandwidth_measured) == \
        (10.0, 80.0, "measured", True, True)
    assert all(r.path == "direct" for r in rows)
    # b → c: nobody measured it; bounded through the host (the asker's side): |6 − 30| ≤ rtt ≤ 6 + 30
    assert (b_c.basis, b_c.measured, b_c.bandwidth_measured) == ("bound", False, False)
    assert b_c.rtt_ms == pytest.approx(36.0)
    # c → asker: the round trip is measured, the bandwidth is the planner's default, and said so
    assert (c_asker.rtt_ms, c_asker.measured, c_asker.bandwidth_measured) == (30.0, True, False)


def test_status_rows_are_empty_without_a_plan_and_decode_from_an_older_host():
    src = _sources({})
    src.plan.stages = []
    assert link_rows(src) == []
    old = {"type": "status", "swarm": "s", "model": "m", "n_layer": 30, "head_layers": 4, "plan_version": 1,
           "complete": True, "missing_layers": [], "members": [], "objective": "latency",
           "expected_ms_per_token": 1.0, "expected_tokens_per_s": 1.0, "bottleneck": "", "warnings": [],
           "recovery": {}}
    assert m.parse(old, m.kinds(m.Status)).links == []
    row = m.parse({"type": "status", **{k: v for k, v in old.items() if k != "type"},
                   "links": [{"source": "asker", "target": "a"}]}, m.kinds(m.Status)).links[0]
    assert (row.path, row.rtt_ms, row.measured) == ("direct", None, False)  # an older row's defaults


def test_the_links_table_under_the_members():
    trunks = {"a": _trunk("10.0.0.1:7471", 4.0, {"b": Link(10.0, 80.0)}), "b": _trunk("10.0.0.2:7471", 6.0, {}),
              "c": _trunk("10.0.0.3:7471", 30.0, {})}
    lines = format_links(link_rows(_sources(trunks, {("a", "b")})))
    assert lines[0].split() == ["HOP", "LINK", "PATH", "RTT", "THROUGHPUT", "BASIS"]
    body = [line.split() for line in lines[1:]]
    assert body[0] == ["1", "asker", "→", "a", "direct", "4.0", "ms", "50.0", "MB/s", "(default)", "measured"]
    assert body[1] == ["2", "a", "→", "b", "direct", "10.0", "ms", "80.0", "MB/s", "measured"]
    assert body[2][:4] == ["3", "b", "→", "c"] and body[2][-2:] == ["estimated", "(bound)"]
    assert len(body) == 4
    assert format_links([]) == []


def test_top_says_the_path_of_a_relayed_hop_and_nothing_extra_for_a_direct_one():
    from swarmctl.tui.format import next_hop

    assert next_hop("b", None, "direct") == next_hop("b", None) == "b ?"
    assert next_hop("b", None, "relayed via host").startswith("b (relayed via host)")
    assert next_hop("", 3.0, "relayed via host") == "-"
