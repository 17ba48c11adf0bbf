"""How long the host takes from `swarmctl run --role host` until it listens, on a ~4 GB model:
the first start (every tensor hashed, on every core) and restarts on the unchanged file (the hashes
kept in the home: swarmctl/host/model_hashes.py), side by side in one run. Issue 44's bar: a restart
within 1 s.

    python benchmarks/bench_host_start.py [--model PATH] [--cache DIR] [--restarts 3] [--out FILE]

Without --model it uses (writing it once into --cache) the Kimi-width deepseek2 file of
bench_plan_vs_measured (harness/tiny_models.KIMI_WIDTH: 4 layers, 16 experts, Q8_0, ~3.7 GB).
The first start is timed with the file's pages dropped from the page cache where this process may
(root: /proc/sys/vm/drop_caches), so it reads the disk as a host's first start does; otherwise it
says it read from the page cache. Each start is a real process; the time is from its launch until
it has written its ready file (it listens then), Python's start-up and imports included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_plan_vs_measured import shaped_model  # noqa: E402
from benchmarks.common import emit_json  # noqa: E402


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def time_to_listen(home: Path, timeout: float = 1800) -> float:
    ready = home / "bench-ready"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "SWARMCTL_HOME": str(home)}
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "swarmctl", "run", "--role", "host", "--ready-file", str(ready)],
                               env=env, stdout=subprocess.DEVNULL, stderr=open(home / "host.log", "ab"))
    try:
        while not ready.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the host exited ({process.returncode}): see {home / 'host.log'}")
            if time.perf_counter() - started > timeout:
                raise RuntimeError("the host did not listen in time")
            time.sleep(0.01)
        return time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "swarmctl-bench-models")
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = args.model or shaped_model(args.cache, "kimi-width")
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "host"
        env = {**os.environ, "SWARMCTL_HOME": str(home)}
        subprocess.run([sys.executable, "-m", "swarmctl", "init", "--model", str(model), "--listen", "127.0.0.1:0"],
                       env=env, check=True, capture_output=True)
        cold = drop_page_cache()
        first = time_to_listen(home)
        restarts = [time_to_listen(home) for _ in range(args.restarts)]
        log_lines = (home / "host.log").read_text(errors="replace").count("hashing ")
    size = sum(p.stat().st_size for p in model.parent.glob(model.name))
    emit_json({
        "benchmark": "bench_host_start",
        "cpu": _cpu_name(), "cores": os.cpu_count(), "model": model.name, "model_bytes": size,
        "first_start_s": round(first, 3), "first_start_read": "disk (page cache dropped)" if cold else "page cache",
        "restart_s": [round(t, 3) for t in restarts], "restart_median_s": round(statistics.median(restarts), 3),
        "first_over_restart": round(first / statistics.median(restarts), 1),
        "hashing_progress_lines": log_lines,
    }, args.out)


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
