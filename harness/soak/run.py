"""The soak run: build the swarm through the CLI, drive the load and the faults, report.

`python benchmarks/soak.py` runs it from the command line (its docstring says what is measured);
tests/test_soak.py runs a short one."""


from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness.soak.config import IDLE_STREAMS, PROMPTS, Config, Prompt  # noqa: E402
from harness.soak.faults import FaultInjector  # noqa: E402
from harness.soak.load import LoadGenerator  # noqa: E402
from harness.soak.monitor import SwarmMonitor  # noqa: E402
from harness.soak.records import Clock  # noqa: E402
from harness.soak.references import reference_answers  # noqa: E402
from harness.soak.report import SoakRecord, SoakReport  # noqa: E402
from harness.soak.swarm import SoakSwarm  # noqa: E402

FAULTS_END_S = 120.0  # after the load, the faults have this long to end (a recovery waits up to 90 s)


class Soak:
    """One soak: the swarm (soak_swarm), its load (soak_load), its faults (soak_faults) and the
    monitor that samples it (soak_monitor), run together; then the report (soak_report)."""

    def __init__(self, config: Config, root: Path, prompts: Sequence[Prompt] = PROMPTS) -> None:
        self.config = config
        self.prompts = prompts
        self.clock = Clock()
        self.errors: list[str] = []  # the run's own errors (a fault not run, a process that exited)
        self.swarm = SoakSwarm(root, config.threads)
        self.load = LoadGenerator(config, prompts, self.swarm, self.clock)
        self.monitor = SwarmMonitor(self.swarm, self.clock, self.errors, config.poll_s, self.load.in_flight)
        self.faults = FaultInjector(config, self.swarm, self.monitor, self.clock, self.errors)
        self.prompt_tokens: list[int] = []
        self.setup_s = 0.0
        self.setup_phases: dict[str, float] = {}
        self.load_at_start: list[float] = []
        self.tasks: list[asyncio.Future] = []  # the clients and the faults, cancelled on an interrupt

    def setup(self) -> None:
        started = time.monotonic()

        def phase(name: str) -> None:
            self.setup_phases[name] = round(time.monotonic() - started - sum(self.setup_phases.values()), 1)

        # the reference answers are computed while the swarm comes up (its nodes are mostly waiting)
        references = ThreadPoolExecutor(1)
        try:
            future = references.submit(reference_answers, self.prompts, self.config.threads)
            self.swarm.start(phase)
            self.load.references, self.prompt_tokens = future.result()
            phase("references (what was left of them)")
        finally:
            references.shutdown(wait=True)
        self.setup_s = time.monotonic() - started

    def interrupt(self) -> None:
        """Ctrl-C or SIGTERM: start no more requests and cancel what is under way (a request's own
        cleanup kills its `ask` process or closes its connection)."""
        self.load.interrupted = True
        for task in self.tasks:
            task.cancel()

    async def run(self, handle_signals: bool = False) -> None:
        await self.load.read_model_id()
        self.load_at_start = [round(x, 2) for x in os.getloadavg()]
        self.clock.start()
        stop_polling = asyncio.Event()
        poller = asyncio.ensure_future(self.monitor.poll(stop_polling))
        faults = asyncio.ensure_future(self.faults.run())
        clients = self.load.start_clients()
        self.tasks = [*clients, faults]
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
        previous = {sig: signal.getsignal(sig) for sig in signals}
        for sig in signals:
            loop.add_signal_handler(sig, self.interrupt)
        try:
            # every client stops starting requests at the end of the load; each request is bounded
            # by its deadline, and a fault's recovery wait by 90 s
            await asyncio.gather(*clients)
            await asyncio.wait_for(faults, max(1.0, self.config.load_s + FAULTS_END_S - self.clock.now()))
            await self.monitor.settle_streams()
        except asyncio.CancelledError:
            if not self.load.interrupted:
                raise
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
                signal.signal(sig, previous[sig])
            faults.cancel()
            stop_polling.set()
            if self.load.interrupted:  # a client that missed its cancellation stops at its next request
                await asyncio.wait(clients, timeout=15)
                for task in clients:
                    task.cancel()
                await asyncio.gather(*clients, return_exceptions=True)
            await asyncio.gather(poller, faults, return_exceptions=True)
            await self.monitor.end_stats_queries(wait=not self.load.interrupted)
        if self.load.interrupted:
            raise KeyboardInterrupt

    def report(self) -> dict:
        return SoakReport(SoakRecord(
            config=self.config, prompts=self.prompts, prompt_tokens=self.prompt_tokens,
            references=self.load.references, max_requests=self.load.max_requests, setup_s=self.setup_s,
            setup_phases=self.setup_phases, load_at_start=self.load_at_start, requests=self.load.requests,
            events=self.faults.events, samples=self.monitor.samples, idle_streams=self.monitor.idle_streams,
            idle_wait_s=self.monitor.idle_wait_s, errors=self.errors, clock=self.clock)).to_dict()

    def log_tails(self, n: int = 16) -> dict[str, list[str]]:
        return self.swarm.log_tails(n)

    def close(self) -> None:
        """Stop everything the soak started: resume a frozen trunk (a stopped process ignores
        SIGTERM), kill the `ask` processes, then stop `serve` and the nodes."""
        self.faults.resume_frozen()
        self.load.kill_children()
        self.swarm.close()


def run_soak(config: Config, keep: Path | None = None, prompts: Sequence[Prompt] = PROMPTS,
             handle_signals: bool = False) -> dict:
    """Build the swarm, run the load and the faults, tear everything down; returns the report.
    ``handle_signals``: SIGINT and SIGTERM during the load stop it cleanly (KeyboardInterrupt)."""
    root = Path(tempfile.mkdtemp(prefix="swarmctl-soak-"))
    soak = Soak(config, root, prompts)
    try:
        soak.setup()
        asyncio.run(soak.run(handle_signals))
        result = soak.report()
        if not result["verdict"]["pass"]:  # what the nodes said last, for whoever reads the failures
            result["node_log_tails"] = soak.log_tails()
        return result
    finally:
        soak.close()
        if keep is not None:
            shutil.copytree(root, keep, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)
