"""`swarmctl top`: the arithmetic of snapshots, the screen drawn from a recorded feed (compared
with committed golden files, so a layout change is a visible diff), the app on a live local swarm
under load (rows, occupancy, keys), and an unreachable swarm (a banner, retries, no crash).

Regenerate the golden files after an intended change of the picture:
    SWARMCTL_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_top.py -k golden
The recorded feed (tests/snapshots/top/feed.jsonl) is what `swarmctl top --record` wrote in the
tmux session of `python docs/make_top_screenshot.py`, which also draws docs/top-screenshot.svg
from it: that SVG is the colour golden file. (Since typed messages it has been read and written
again by the recorder, which spells out every field of the message types; the polls are the same.)
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
from pathlib import Path

import pytest
from rich.console import Console

from kernels.sampling import SamplingParams
from net.messages import MemberStatus, RecoveryStatus, Stats, Status
from swarmctl.asker.head_tail import Asker, generate_all
from swarmctl.cli import main as cli_main
from swarmctl.node.home import SwarmHome
from swarmctl.node.local_swarm import LocalSwarm, free_udp_port
from plans.options import PlannerSettings
from swarmctl.node.membership import create_swarm
from swarmctl.monitor.build import RawPoll, SnapshotBuilder
from swarmctl.monitor.poller import Monitor, MonitorConfig
from swarmctl.monitor.recording import Recorder, RecordingError, ReplayFeed, read_recording
from swarmctl.asker.link import SwarmLink
from swarmctl.tui.app import TopApp
from swarmctl.tui.chart import IDLE, lane_cells
from swarmctl.tui.help import HelpScreen

SNAPSHOTS = Path(__file__).parent / "snapshots" / "top"
FEED = SNAPSHOTS / "feed.jsonl"
README_SVG = Path(__file__).parents[1] / "docs" / "top-screenshot.svg"  # the README's picture is a golden file too
SIZE = (120, 40)
UPDATE = bool(os.environ.get("SWARMCTL_UPDATE_SNAPSHOTS"))


# --- the arithmetic, on small hand-made polls ---

def _member(name: str, role: str, address: str, layers: list[int] | None, memory: int | None,
            health: str) -> MemberStatus:
    return MemberStatus(name=name, role=role, may=role, address=address, health=health, layers=layers, memory=memory)


def _status(*trunks: tuple[str, int, int], down: tuple[str, ...] = ()) -> Status:
    """Stages ``trunks`` (name, first layer, end), then trunks the host calls down (no layers)."""
    members = [_member("host", "host", "127.0.0.1:7470", None, None, "up (host)")]
    members += [_member(n, "trunk", f"127.0.0.1:{7471 + i}", [a, b], 4_000_000_000, "ready")
                for i, (n, a, b) in enumerate(trunks)]
    members += [_member(n, "trunk", f"127.0.0.1:{7490 + i}", None, 4_000_000_000, "down") for i, n in enumerate(down)]
    return Status(swarm="s", model="m.gguf", n_layer=26, head_layers=4, plan_version=3, complete=True,
                  missing_layers=[], members=members, objective="", expected_ms_per_token=0.0,
                  expected_tokens_per_s=0.0, bottleneck="", warnings=[], recovery=RecoveryStatus())


def _stats(clock: float, batches: list, steps: int, requests: tuple = ()) -> Stats:
    return Stats(name="", role="stage", layers=None, expert_range=None, time=clock, recent_batches=batches,
                 requests_detail=list(requests), requests=0, routes=0, kv_bytes=0, peak_kv_bytes=0, queue_depth=2,
                 batches=0, steps=steps, tokens=0, busy_s=0.0, largest_batch=0, tensor_bytes=0, budget={},
                 open_streams=0, request_locks=0, rss=90_000_000, peak_rss=0, fetched_bytes=0, expert_rows_served=0,
                 expert_call_bytes=0, activation_bytes_sent=0, ms_per_layer_token=None)


def test_occupancy_rates_and_letters_from_polls():
    clock = 1000.0
    # trunk-a: busy 1 s of the last 5 (two batches), request r1 in both, r2 in one
    a = _stats(clock, [[clock - 4.0, 0.5, 1, ["r1"]], [clock - 1.0, 0.5, 2, ["r1", "r2"]]], steps=3,
               requests=({"id": "r1", "position": 30, "idle_s": 0.5}, {"id": "r2", "position": 12, "idle_s": 0.9}))
    b = _stats(clock, [[clock - 0.5, 0.25, 1, ["r2"]]], steps=1,
               requests=({"id": "r1", "position": 29, "idle_s": 2.0}, {"id": "r2", "position": 12, "idle_s": 0.2}))
    builder = SnapshotBuilder(window_s=5.0)
    snap = builder.add(RawPoll(1.0, 0.01, _status(("a", 4, 10), ("b", 10, 26)), stats={"a": a, "b": b},
                               pings_ms={"a": 0.5}))
    nodes = {n.name: n for n in snap.nodes}
    assert [n.name for n in snap.nodes] == ["a", "b", "host"]  # stages by layer, then the rest
    assert nodes["a"].occupancy == pytest.approx(1.0 / 5)
    assert nodes["b"].occupancy == pytest.approx(0.25 / 5)
    assert nodes["a"].tok_s == pytest.approx(3 / 5)  # steps: r1, r1, r2
    assert nodes["a"].next_hop == "b" and nodes["b"].next_hop == "asker"
    assert nodes["a"].ping_ms == 0.5 and nodes["b"].ping_ms is None
    assert nodes["host"].occupancy is None
    requests = {r.request_id: r for r in snap.requests}
    assert requests["r1"].tokens == 30 and requests["r1"].stage == "a" and requests["r1"].idle_s == 0.5
    assert requests["r2"].stage == "b"
    assert requests["r1"].letter == "a" and requests["r2"].letter == "b"  # by first appearance
    assert [b.letters for b in snap.lanes[0].batches] == [("a",), ("a", "b")]

    # next poll: 1 s later, 40 more steps at the first stage; r1 gone, r3 new takes r1's letter
    later = _stats(clock + 1, [[clock + 0.5, 0.1, 1, ["r3"]]], steps=43)
    snap2 = builder.add(RawPoll(2.0, 0.01, _status(("a", 4, 10), ("b", 10, 26)), stats={"a": later}))
    assert snap2.tok_s == pytest.approx(40.0)
    assert snap2.lanes[0].batches[0].letters == ("a",)  # r3 has the free letter
    assert not snap2.lanes[1].reachable and {n.name: n.stats_error for n in snap2.nodes}["b"] == ""


def test_an_unreachable_host_keeps_the_last_picture_with_a_banner():
    builder = SnapshotBuilder()
    first = builder.add(RawPoll(1.0, 0.5, None, host_error="cannot connect to 127.0.0.1:7470: no answer",
                                retry_in_s=1.0))
    assert first.banner == "swarm unreachable: cannot connect to 127.0.0.1:7470: no answer, retrying in 1 s"
    assert first.nodes == () and first.stale
    good = builder.add(RawPoll(2.0, 0.01, _status(("a", 4, 26)), stats={"a": _stats(5.0, [], 0)}))
    assert not good.banner and not good.stale
    lost = builder.add(RawPoll(3.0, 2.0, None, host_error="no answer in time", retry_in_s=4.0))
    assert lost.stale and lost.nodes is good.nodes and "retrying in 4 s" in lost.banner
    assert lost.seq > good.seq


def test_chart_cells_show_requests_batches_and_idle():
    from swarmctl.monitor.snapshot import Batch, Lane

    lane = Lane("a", (4, 10), (Batch(0.95, 0.1, ("a",)), Batch(0.45, 0.1, ("a", "b"))), reachable=True)
    cells = lane_cells(lane, span_s=1.0, n_cells=10)  # 0.1 s per cell
    marks = ["".join(sorted(c.letters)) or IDLE for c in cells]
    assert marks == ["a", "a", IDLE, IDLE, IDLE, "ab", "ab", IDLE, IDLE, IDLE]
    assert sum(c.busy_s for c in cells) == pytest.approx(0.2)


def test_recording_round_trip(tmp_path):
    polls = read_recording(FEED)
    path = tmp_path / "again.jsonl"
    recorder = Recorder(path)
    for poll in polls:
        recorder.write(poll)
    recorder.close()
    again = read_recording(path)
    assert len(again) == len(polls) > 10
    assert again[-1].stats == polls[-1].stats and again[-1].status == polls[-1].status
    # only new batches (the same again would double it); the recorder spells out every field, and
    # members gained some since the feed was recorded (their fetch, their kept prefixes): 5.5% more
    assert path.stat().st_size <= FEED.stat().st_size * 1.10


def test_a_recording_from_before_may_and_budget_replays(tmp_path):
    """Recordings made before members reported ``may`` and trunks ``budget``, ``open_streams`` and
    ``request_locks`` still replay (the committed feed was such a recording, rewritten since)."""
    polls = read_recording(FEED)
    path = tmp_path / "older.jsonl"
    with open(path, "w") as f:
        f.write(FEED.read_text().splitlines()[0] + "\n")
        for poll in polls[:3]:
            d = poll.to_dict()
            for member in d["status"]["members"]:
                del member["may"]
            for stats in d["stats"].values():
                for key in ("budget", "open_streams", "request_locks"):
                    del stats[key]
            f.write(json.dumps(d) + "\n")
    assert read_recording(path) == polls[:3]


def test_a_recorded_poll_of_the_wrong_shape_is_one_line(tmp_path):
    lines = FEED.read_text().splitlines()
    poll = json.loads(lines[1])
    poll["status"]["members"][0]["layers"] = "all of them"
    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n" + json.dumps(poll) + "\n")
    with pytest.raises(RecordingError, match=r"line 2: not a recorded poll \(Expected `array \| null`, got `str`"):
        read_recording(tmp_path / "bad.jsonl")


# --- the screen from the recorded feed, against golden files ---

def screen_text(app: TopApp) -> str:
    """The screen as plain text (what a terminal shows, without colours), as Textual's own
    export_screenshot renders it."""
    console = Console(width=app.size.width, height=app.size.height, file=io.StringIO(), force_terminal=True,
                      color_system="truecolor", record=True, legacy_windows=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def node_rows(text: str) -> list[str]:
    """The names in the nodes panel, top to bottom."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "NAME" in line and "ADDRESS" in line) + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
    return [line.strip("│ ").split()[0] for line in lines[start:end] if line.strip("│ ")]


def check_golden(name: str | Path, actual: str) -> None:
    path = SNAPSHOTS / name
    if UPDATE or not path.exists():
        path.write_text(actual)
        if not UPDATE:
            pytest.fail(f"{path} did not exist: written now, check it and commit it")
        return
    expected = path.read_text()
    assert actual == expected, (f"the screen differs from {path} (an intended change? regenerate with "
                                "SWARMCTL_UPDATE_SNAPSHOTS=1 and commit the diff)")


async def _render(feed, keys: list[str]) -> tuple[str, TopApp]:
    app = TopApp(feed)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        for key in keys:
            await pilot.press(key)
        await pilot.pause(0.3)  # past a refresh tick
        return screen_text(app), app


SCENES = {
    "main": [],
    "sorted-by-busy-paused": ["s", "s", "p"],
    "zoomed-out-5s": ["minus", "minus"],
    "help": ["question_mark"],
}


@pytest.mark.parametrize("scene", SCENES)
def test_golden_screen_from_recorded_feed(scene):
    text, app = asyncio.run(_render(ReplayFeed(read_recording(FEED), realtime=False), SCENES[scene]))
    check_golden(f"{scene}.txt", text)
    if scene == "main":
        assert "trunk-1" in text and "trunk-2" in text and "pipeline occupancy" in text


def test_golden_svg_from_recorded_feed():
    """In colour: the README's SVG, drawn from the same feed."""
    async def svg() -> str:
        app = TopApp(ReplayFeed(read_recording(FEED), realtime=False))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.3)
            return app.export_screenshot(title="swarmctl top", simplify=True)

    check_golden(README_SVG, asyncio.run(svg()))


def test_one_stage_and_a_node_the_host_calls_down_that_answers_our_ping():
    """One stage is "1 stage"; a node the host counts down while it answers this screen's ping is
    not shown as plain "down" (one that does not answer is)."""
    status = _status(("amy", 4, 26), down=("bob", "carol"))
    poll = RawPoll(time.time(), 0.01, status, stats={"amy": _stats(5.0, [], 0)}, pings_ms={"amy": 1.0, "bob": 2.5})
    text, _ = asyncio.run(_render(ReplayFeed([poll], realtime=False), []))
    assert " · 1 stage · " in text and "1 stages" not in text
    rows: dict[str, str] = {}  # the nodes panel's rows (it comes before the chart's lanes)
    for row in (line.strip("│ ") for line in text.splitlines()):
        if row and row.split()[0] in ("amy", "bob", "carol"):
            rows.setdefault(row.split()[0], row)
    assert rows["bob"].rstrip().endswith("2.50     host: down"), rows["bob"]
    assert rows["carol"].rstrip().endswith("-        down"), rows["carol"]
    assert rows["amy"].rstrip().endswith("ready"), rows["amy"]


def test_members_behind_a_nat_show_how_this_screen_reaches_them():
    """A trunk behind a NAT answers this screen through a punched hole or a relay: its row shows
    its stats as the others' do, and the path beside its ping (a direct one says nothing more)."""
    status = _status(("amy", 4, 10), ("bob", 10, 20), ("carol", 20, 26))
    stats = {name: _stats(5.0, [], 0) for name in ("amy", "bob", "carol")}
    poll = RawPoll(time.time(), 0.01, status, stats=stats, pings_ms={"amy": 1.0, "bob": 41.0, "carol": 45.0},
                   paths={"amy": "direct", "bob": "punched", "carol": "relayed via erin"})
    assert RawPoll.from_dict(poll.to_dict()) == poll  # recorded and replayed with the paths
    assert RawPoll.from_dict({k: v for k, v in poll.to_dict().items() if k != "paths"}).paths == {}  # older files
    assert {n.name: n.path for n in SnapshotBuilder().add(poll).nodes if n.role == "trunk"} == poll.paths
    text, _ = asyncio.run(_render(ReplayFeed([poll], realtime=False), []))
    rows: dict[str, str] = {}
    for row in (line.strip("│ ") for line in text.splitlines()):
        if row and row.split()[0] in stats:
            rows.setdefault(row.split()[0], row)
    assert rows["bob"].endswith("41 punched  ready") and rows["carol"].endswith("45 relayed  ready"), rows
    assert rows["amy"].endswith("1.00        ready"), rows


def test_the_monitor_reaches_trunks_the_way_the_host_says(tmp_path):
    """Trunks are dialled through the member's dialer (swarmctl/reaching/reach.py: the host says direct,
    punch or relay), not at the address they registered, which behind a NAT answers nobody; the
    path it took is kept for the row, and a trunk that cannot be reached is tried again less and
    less often (each try may cost a relayed link from the member's share)."""
    from swarmctl.monitor.poller import _Peer

    home = SwarmHome(tmp_path / "host")
    create_swarm(home, swarm_name="s", host_name="host", listen="127.0.0.1:7470", advertise=["127.0.0.1:7470"],
                 model=None)

    class Dialer:
        def __init__(self) -> None:
            self.asked: list[tuple[str, str]] = []
            self.paths: dict[str, str] = {}

        async def connect(self, member, address, handler):
            self.asked.append((member, address))
            if member == "carol":
                raise ConnectionError("cannot reach carol: punching failed, and the host has no relay")
            self.paths[member] = "punched"
            return object()

        def close(self) -> None:
            pass

    async def scenario() -> tuple[_Peer, _Peer, Dialer, bool]:
        monitor = Monitor(home, MonitorConfig(max_backoff_s=8.0, max_trunk_backoff_s=60.0))
        monitor._dialer = dialer = Dialer()
        bob, carol = _Peer("bob", "198.51.100.2:7471"), _Peer("carol", "198.51.100.3:7471")
        for peer in (bob, carol):
            monitor._start_connecting(peer)
            await peer.connecting
        monitor._start_connecting(carol)  # too soon: no new attempt
        waits = carol.next_attempt > asyncio.get_running_loop().time() and carol.connecting.done()
        carol.next_attempt = 0.0
        monitor._start_connecting(carol)
        await carol.connecting
        return bob, carol, dialer, waits

    bob, carol, dialer, waits = asyncio.run(scenario())
    assert dialer.asked == [("bob", "198.51.100.2:7471"), ("carol", "198.51.100.3:7471"),
                            ("carol", "198.51.100.3:7471")]
    assert bob.path == "punched" and not bob.error
    assert carol.conn is None and "no relay" in carol.error and carol.failures == 2 and waits
    pauses = []
    for failures in (1, 2, 3, 5, 9):
        carol.failures = failures
        pauses.append(carol.retry_pause(4.0, 60.0))
    assert pauses == [4.0, 8.0, 16.0, 60.0, 60.0]


def test_requests_show_the_drafts_their_asker_kept():
    """A request whose trunks counted drafts shows kept/drafted and the share; one without (not
    speculating, or a trunk from before drafts were counted: no fields at all) shows none."""
    clock = 1000.0
    a = _stats(clock, [[clock - 0.5, 0.1, 2, ["spec0001", "plain002"]]], steps=2,
               requests=({"id": "spec0001", "position": 60, "idle_s": 0.1, "drafted": 15, "accepted": 12},
                         {"id": "plain002", "position": 30, "idle_s": 0.1}))
    b = _stats(clock, [], steps=2,  # downstream: the last VERIFY step not counted yet
               requests=({"id": "spec0001", "position": 60, "idle_s": 0.05, "drafted": 11, "accepted": 9},
                         {"id": "plain002", "position": 30, "idle_s": 0.3, "drafted": 0, "accepted": 0}))
    poll = RawPoll(time.time(), 0.01, _status(("a", 4, 10), ("b", 10, 26)), stats={"a": a, "b": b})
    requests = {r.request_id: r for r in SnapshotBuilder().add(poll).requests}
    assert (requests["spec0001"].drafted, requests["spec0001"].accepted) == (15, 12)  # the furthest count
    assert (requests["plain002"].drafted, requests["plain002"].accepted) == (0, 0)

    text, _ = asyncio.run(_render(ReplayFeed([poll], realtime=False), []))
    rows = {cells[1]: cells for cells in (line.split("│")[1].split() for line in text.splitlines()
                                          if "spec0001" in line or "plain002" in line)}
    assert rows["spec0001"][4:7] == ["12/15", "80%", "b"], rows["spec0001"]  # DRAFT, then LAST AT
    assert rows["plain002"][4:6] == ["-", "a"], rows["plain002"]


def test_golden_screen_when_the_host_stops_answering():
    polls = read_recording(FEED)
    polls.append(RawPoll(polls[-1].taken_at + 2, 2.0, None, host_error="no answer in time", retry_in_s=2.0))
    text, _ = asyncio.run(_render(ReplayFeed(polls, realtime=False), []))
    assert "swarm unreachable: no answer in time, retrying in 2 s" in text
    check_golden("unreachable.txt", text)


# --- a live local swarm under load ---

@pytest.fixture(scope="module")
def live_swarm(bundled_model):
    with LocalSwarm(model=str(bundled_model), n_trunks=2, planner=PlannerSettings(head_layers=4), threads=1) as swarm:
        yield swarm


async def _keep_busy(asker: Asker, link: SwarmLink, stop: asyncio.Event, concurrency: int = 3) -> None:
    async def worker(i: int) -> None:
        k = 0
        while not stop.is_set():
            prompt = [300 + (i * 97 + k * 13 + j * 7) % 20000 for j in range(16)]
            await generate_all(asker, prompt, link, max_tokens=24, sampling=SamplingParams(temperature=0),
                               ignore_eos=True)
            k += 1

    await asyncio.gather(*[worker(i) for i in range(concurrency)])


async def _until(pilot, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; screen:\n{screen_text(pilot.app)}")
        await pilot.pause(0.2)


def test_live_swarm_under_load_rows_occupancy_and_keys(live_swarm, bundled_model):
    async def scenario() -> None:
        link = await SwarmLink.open(live_swarm.asker_home, alive_check=live_swarm.check_alive, min_stages=2)
        asker = Asker(bundled_model, link.head_layers, n_threads=1)
        stop = asyncio.Event()
        load = asyncio.ensure_future(_keep_busy(asker, link, stop))
        app = TopApp(Monitor(live_swarm.asker_home, MonitorConfig(interval_s=0.25)))
        try:
            async with app.run_test(size=SIZE) as pilot:
                def busy_trunks() -> set[str]:
                    return {n.name for n in app.snapshot.nodes if n.role == "trunk" and (n.occupancy or 0) > 0}

                await _until(pilot, lambda: busy_trunks() == {"trunk-1", "trunk-2"}, 60, "both trunks busy")
                await pilot.pause(0.3)
                text = screen_text(app)
                assert sorted(node_rows(text)) == ["asker", "host", "trunk-1", "trunk-2"]
                # a lane per trunk (the planner orders stages by measured speed, so either may hold layer 4)
                assert "trunk-1 [" in text and "trunk-2 [" in text and "% " in text
                await _until(pilot, lambda: app.snapshot.requests and app.snapshot.tok_s > 0, 10, "requests")

                await pilot.press("p")  # pause: the picture stops changing, polling does not
                frozen = app.snapshot
                await pilot.pause(1.0)
                assert app.paused and app.snapshot is frozen and "PAUSED" in screen_text(app)
                assert app.feed.latest() is not frozen
                await pilot.press("p")
                await pilot.pause(0.5)
                assert not app.paused and app.snapshot is not frozen

                await pilot.press("s")  # sort by name
                await pilot.pause(0.3)
                assert app.sort_key == "name"
                assert node_rows(screen_text(app)) == ["asker", "host", "trunk-1", "trunk-2"]
                assert "sorted by name" in screen_text(app)

                await pilot.press("question_mark")
                await pilot.pause(0.2)
                assert isinstance(app.screen, HelpScreen) and "NEXT HOP" in screen_text(app)
                await pilot.press("question_mark")
                await pilot.pause(0.2)
                assert not isinstance(app.screen, HelpScreen)

                await pilot.press("q")
                await pilot.pause(0.2)
            assert app.return_code == 0
        finally:
            stop.set()
            await asyncio.wait_for(load, 60)
            await link.close()
            asker.close()

    asyncio.run(scenario())


def test_monitor_keeps_its_connections_past_128_requests(live_swarm):
    """QUIC grants a peer only so many streams at once (128 in aioquic): every poll opens new
    request streams on the same long-lived connections, and none may stall."""
    async def scenario() -> tuple[int, bool]:
        monitor = Monitor(live_swarm.asker_home, MonitorConfig(timeout_s=5))
        try:
            for _ in range(300):  # until the trunk connections (opened in the background) are up (30 s: a loaded box)
                if len((await monitor.poll_once()).stats) == 2:
                    break
                await asyncio.sleep(0.1)
            connections = [monitor._host, *(peer.conn for peer in monitor._peers.values())]
            polls = [await monitor.poll_once() for _ in range(140)]  # 280 requests to the host, 140 to each trunk
            answered = sum(p.status is not None and len(p.stats) == 2 for p in polls)
            return answered, connections == [monitor._host, *(peer.conn for peer in monitor._peers.values())]
        finally:
            monitor.close()

    answered, same_connections = asyncio.run(scenario())
    assert answered == 140 and same_connections


@pytest.mark.slow  # waits out a connect timeout and the screen's retries
def test_unreachable_swarm_shows_a_banner_and_keeps_retrying(tmp_path, monkeypatch):
    """A host that never answers (nothing listens at its address): connecting, then
    "unreachable ... retrying", and the app stays up until q. (The handshake's timeout is 2 s
    here instead of 10: the banner comes once it has passed.)"""
    monkeypatch.setattr("net.endpoint.CONNECT_TIMEOUT", 2.0)
    home = SwarmHome(tmp_path / "lonely-host")
    address = f"127.0.0.1:{free_udp_port()}"
    create_swarm(home, swarm_name="gone", host_name="host", listen=address, advertise=[address], model=None)

    async def scenario() -> None:
        app = TopApp(Monitor(home, MonitorConfig(interval_s=0.25, max_backoff_s=1.0)))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause(0.3)
            assert f"connecting to the swarm host at {address}" in screen_text(app)
            await _until(pilot, lambda: app.snapshot.banner.startswith("swarm unreachable"), 20, "the banner")
            banner = app.snapshot.banner
            assert banner.startswith(f"swarm unreachable: no answer from {address} (") and "retrying" in banner
            assert banner in screen_text(app)
            await _until(pilot, lambda: app.snapshot.banner.endswith("retrying now"), 5, "a retry")
            await pilot.press("q")
            await pilot.pause(0.2)
        assert app.return_code == 0

    asyncio.run(scenario())


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli_main(["top", "--window", "30"]) == 2
    assert cli_main(["top", "--replay", str(tmp_path / "missing.jsonl")]) == 2
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert cli_main(["top", "--replay", str(tmp_path / "bad.jsonl")]) == 1
    assert cli_main(["top"]) == 1  # no swarm joined in this test's SWARMCTL_HOME
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and "Traceback" not in "".join(lines)
    assert "must be between 0.5 and 10" in lines[0] and "no recording" in lines[1]
    assert "not a swarmctl top recording" in lines[2] or "cannot read recording" in lines[2]
    assert "no swarm state" in lines[3]
