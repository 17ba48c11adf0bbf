"""Make the README's picture of `swarmctl top`, in a real terminal: a 120×40 tmux pane.

    python docs/make_top_screenshot.py [--seconds 12]

Starts a local swarm (host + 2 trunks), keeps 4 requests in flight through it, runs
`swarmctl top --record FILE` in a detached 120×40 tmux session, captures the pane as text
(docs/top-screenshot.txt) after --seconds, then quits top with its own `q` key. The recording
top made becomes the view tests' recorded feed (tests/snapshots/top/feed.jsonl), and is replayed
into the same app under Textual's headless pilot for the SVG (docs/top-screenshot.svg, which the
tests compare too). Afterwards, regenerate the text golden files:
SWARMCTL_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_top.py -k golden
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_top import keep_busy  # noqa: E402
from swarmctl.asker.head_tail import Asker  # noqa: E402
from swarmctl.node.local_swarm import LocalSwarm  # noqa: E402
from plans.options import PlannerSettings  # noqa: E402
from swarmctl.model_files.models import default_model_path  # noqa: E402
from swarmctl.asker.link import SwarmLink  # noqa: E402

SESSION = "swarmctl-top-screenshot"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


async def capture(swarm: LocalSwarm, seconds: float, recording: Path) -> str:
    link = await SwarmLink.open(swarm.asker_home, alive_check=swarm.check_alive, min_stages=2)
    asker = Asker(default_model_path(), link.head_layers, n_threads=1)
    stop = asyncio.Event()
    load = asyncio.ensure_future(keep_busy(asker, link, stop))
    command = (f"cd {REPO} && SWARMCTL_HOME={swarm.asker_home.path} {sys.executable} -m swarmctl top "
               f"--record {recording}")
    try:
        tmux("new-session", "-d", "-s", SESSION, "-x", "120", "-y", "40", command)
        await asyncio.sleep(seconds)
        text = tmux("capture-pane", "-p", "-t", SESSION)
        tmux("send-keys", "-t", SESSION, "q")
        for _ in range(50):  # top quits on q; the session ends with it
            await asyncio.sleep(0.1)
            if subprocess.run(["tmux", "has-session", "-t", SESSION], capture_output=True).returncode != 0:
                break
        else:
            raise RuntimeError("top did not quit on q")
        return text
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        stop.set()
        await load
        await link.close()
        asker.close()


async def svg_of(recording: Path) -> str:
    from swarmctl.monitor.recording import ReplayFeed, read_recording
    from swarmctl.tui.app import TopApp

    app = TopApp(ReplayFeed(read_recording(recording), realtime=False))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.5)
        return app.export_screenshot(title="swarmctl top", simplify=True)  # as tests/test_top.py draws it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0)
    args = parser.parse_args()
    if shutil.which("tmux") is None:
        sys.exit("tmux is needed (apt-get install tmux)")
    with tempfile.TemporaryDirectory() as tmp, \
            LocalSwarm(model=str(default_model_path()), n_trunks=2, planner=PlannerSettings(head_layers=4),
                       threads=1) as swarm:
        recording = Path(tmp) / "top.jsonl"
        started = time.time()
        text = asyncio.run(capture(swarm, args.seconds, recording))
        (REPO / "docs" / "top-screenshot.txt").write_text(text.rstrip("\n") + "\n")
        (REPO / "docs" / "top-screenshot.svg").write_text(asyncio.run(svg_of(recording)))
        shutil.copyfile(recording, REPO / "tests" / "snapshots" / "top" / "feed.jsonl")
        print(text)
        print(f"({time.time() - started:.0f} s; {recording.stat().st_size} bytes recorded)", file=sys.stderr)


if __name__ == "__main__":
    main()
