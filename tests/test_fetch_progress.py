"""Fetch progress: what `run` logs while a member fetches (a line every so often with the rate and
the time left, not one per chunk), what it tells the host, and how status and top show it, read
through the same code the host and the screens run (the host's record of a ``fetching`` message,
its status row encoded and decoded as on the wire, the status table, the monitor's node view and
the nodes panel). The swarm tests (test_expert_fetch.py) check the same fields from real processes."""

from __future__ import annotations

import asyncio
import time

from rich.console import Console

from net import messages as m
from net.wire import FRAME_HEADER
from swarmctl.commands.status import format_table
from swarmctl.model_files.fetch_progress import LOG_EVERY_S, REPORT_EVERY_S, FetchProgress, format_duration
from swarmctl.host.status import _fetch
from swarmctl.host.trunks import FetchReport, TrunkInfo
from swarmctl.monitor.build import RawPoll, SnapshotBuilder


def wire(message: m.Message, kind: type[m.M]) -> m.M:
    """The message as the other end decodes it off a control frame."""
    return m.decode(m.encode(message)[FRAME_HEADER.size:], kind)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_line_every_so_often_with_the_rate_and_the_time_left():
    clock = Clock()
    p = FetchProgress("layers [4, 10)", clock=clock)
    total = 1_000_000_000
    logged, reported = [], []
    done = 0
    for _ in range(500):  # 2 MB every 0.5 s: what _pull's callback gives at 4 MB/s, 250 s in all
        clock.t += 0.5
        done += 2_000_000
        p.update(done, total)
        if p.log_due():
            logged.append(p.line())
        if p.report_due():
            reported.append((p.done, p.bytes_per_s))
    assert len(logged) == 25 and len(reported) == 50  # every 10 s and 5 s, and the end; not one per chunk
    assert logged[0] == "fetching layers [4, 10): 42.0 / 1000.0 MB (4%), 4.00 MB/s, about 4 min 0 s left"
    assert logged[-2].startswith("fetching layers [4, 10): 962.0 / 1000.0 MB (96%), 4.00 MB/s, about 10 s left")
    assert logged[-1] == "layers [4, 10): all 1000.0 MB fetched in 4 min 10 s (4.00 MB/s)"
    assert reported[-1] == (total, 4_000_000.0)


def test_the_end_is_said_once_and_a_resumed_fetch_is_timed_on_what_it_moved():
    clock = Clock()
    p = FetchProgress("experts [0, 4) of layers [1, 3)", clock=clock)
    p.update(900_000_000, 1_000_000_000)  # resumed: 900 MB were on disk
    clock.t += 20
    p.update(1_000_000_000, 1_000_000_000)
    assert p.log_due() and not p.log_due() and p.report_due() and not p.report_due()
    assert p.bytes_per_s == 5_000_000  # 100 MB in 20 s, not 1 GB
    assert p.line() == "experts [0, 4) of layers [1, 3): all 1000.0 MB fetched in 20 s (5.00 MB/s)"
    assert p.eta_s == 0.0
    assert [format_duration(s) for s in (4.4, 297, 11_520)] == ["4 s", "4 min 57 s", "3 h 12 min"]


def test_no_rate_nor_time_left_before_a_second_and_a_stall_says_so():
    clock = Clock()
    p = FetchProgress("layers [0, 2)", clock=clock)
    p.update(1_000_000, 10_000_000)
    clock.t += 0.5
    assert p.bytes_per_s is None and p.eta_s is None and p.line().endswith("(10%)")
    clock.t += 10
    assert p.line().endswith("0.00 MB/s, stalled")


def _status_with(member: m.MemberStatus) -> m.Status:
    members = [m.MemberStatus(name="host", role="host", may="host", address="127.0.0.1:7470", health="up (host)"),
               member]
    return m.Status(swarm="s", model="m.gguf", n_layer=26, head_layers=4, plan_version=3, complete=False,
                    missing_layers=[[4, 10]], members=members, objective="", expected_ms_per_token=0.0,
                    expected_tokens_per_s=0.0, bottleneck="", warnings=[], recovery=m.RecoveryStatus())


def test_status_and_top_show_a_members_fetch_as_the_host_heard_it():
    # what a trunk sends, decoded as the host's dispatcher decodes it, kept as the host keeps it
    sent = wire(m.Fetching(what="layers [4, 10)", done=312_500_000, total=1_024_000_000, bytes_per_s=2_400_000.0),
                m.Fetching)
    trunk = TrunkInfo(conn=None, plan_stream=0, listen="127.0.0.1:7471", memory=4_000_000_000)
    trunk.took_fetch_report(FetchReport(sent.what, sent.done, sent.total, sent.bytes_per_s, sent.finished))
    assert trunk.fetch_bytes_per_s == 2_400_000.0  # what the planner prices a move to it with
    row = m.MemberStatus(name="amy", role="trunk", may="trunk", address="127.0.0.1:7471", health="loading",
                         layers=[4, 10], memory=4_000_000_000, fetch=_fetch(trunk.fetch))
    status = wire(_status_with(row), m.Status)  # as `status` and `top` receive it
    fetch = status.members[1].fetch
    assert (fetch.done, fetch.total, fetch.bytes_per_s) == (312_500_000, 1_024_000_000, 2_400_000.0)
    assert round(fetch.eta_s) == round((1_024_000_000 - 312_500_000) / 2_400_000)

    shown = "loading: fetching 31% of 1.02 GB, 2.40 MB/s, about 4 min 56 s left"
    table = format_table(status)
    assert shown in table, table

    poll = RawPoll(time.time(), 0.01, status, stats={}, pings_ms={})
    view = next(n for n in SnapshotBuilder().add(poll).nodes if n.name == "amy")
    assert view.fetch == shown.removeprefix("loading: ")

    from swarmctl.tui.widgets import NodeTable  # the nodes panel draws it in the HEALTH column

    table_widget = NodeTable()
    table_widget.snapshot = SnapshotBuilder().add(poll)
    console = Console(width=200, record=True)
    console.print(table_widget.render())
    assert "fetching 31% of 1.02 GB" in console.export_text()

    # a finished fetch, or one the member has not spoken of for a minute, is not shown as under way
    trunk.took_fetch_report(FetchReport("layers [4, 10)", 1_024_000_000, 1_024_000_000, 3_000_000.0, True))
    done = m.MemberStatus(name="amy", role="trunk", may="trunk", address="x", health="ready", fetch=_fetch(trunk.fetch))
    assert format_table(_status_with(done)).splitlines()[-1].endswith("ready")
    assert trunk.fetch_bytes_per_s == 3_000_000.0
    stale = m.MemberStatus(name="amy", role="trunk", may="trunk", address="x", health="loading",
                           fetch=m.FetchStatus(what="layers [4, 10)", done=1, total=2, age_s=61.0))
    assert format_table(_status_with(stale)).splitlines()[-1].endswith("loading")
