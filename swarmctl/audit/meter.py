"""The audit end to end: traffic through a local swarm whose trunks capture, the attack on the
captures, the score against what the asker kept.

    report = run_audit(model, load_prompts(), AuditSettings())
    print(report.table())
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from kernels.threads import default_threads
from plans.proposal import HEAD_LAYERS
from swarmctl.batching import compute_thread
from swarmctl.node.local_swarm import LocalSwarm
from plans.options import PlannerSettings

from .attack import attack
from .capture import capture_files
from .invert import DEFAULT_MAX_CANDIDATES
from .noise import UplinkNoise, calibrate
from .report import AuditReport, score
from .texts import PROMPTS
from .traffic import PromptRun, run_prompts


@dataclass
class AuditSettings:
    head_layers: int = HEAD_LAYERS
    max_tokens: int = 8  # generated per prompt (greedy)
    uplink_noise: float = 0.0  # sigma scale of the mitigation; 0 = off
    noise_seed: int | None = None  # for reproducible curves; None draws fresh randomness
    max_candidates: int = DEFAULT_MAX_CANDIDATES  # per position; 0 = the whole vocabulary
    n_trunks: int = 2
    # One-token steps barely gain from a second thread, and lose ten-fold when the cores are shared
    # with other work (measured: 13 ms instead of 1 ms per step with two threads on a busy machine).
    attack_threads: int = 1
    # Building the inversion table (once per model, then cached) runs its steps 64 at a time, which
    # a second thread does speed up (1.5x measured); None: every usable core (kernels/threads.py).
    table_threads: int | None = None
    swarm_threads: int | None = None  # per node of the local swarm and the asker
    cache_dir: Path | None = None  # where the inversion table is kept between runs
    # With noise on, the attacker weighs distances by the mitigation's per-dimension scale (public
    # code, calibrated on a public text); False measures a naive attacker instead.
    attacker_knows_noise: bool = True


def load_prompts(path: Path | None = None) -> list[str]:
    """The bundled 20 prompts, or a file's: one prompt per line, blank lines and lines starting
    with '#' skipped, a literal backslash-n standing for a newline (code prompts)."""
    if path is None:
        return list(PROMPTS)
    text = path.read_text(encoding="utf-8")
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip() and not line.startswith("#")]


def run_audit(model: Path, prompts: Sequence[str], settings: AuditSettings) -> AuditReport:
    threads = settings.swarm_threads or max(1, (os.cpu_count() or 1) // (settings.n_trunks + 1))
    with LocalSwarm(model=str(model), n_trunks=settings.n_trunks,
                    planner=PlannerSettings(head_layers=settings.head_layers),
                    threads=threads, capture=True) as swarm:
        runs, captures = capture_traffic(swarm, model, prompts, settings, threads)
        return attack_and_score(model, runs, captures, settings)  # the captures go with the swarm's folder


def capture_traffic(swarm: LocalSwarm, model: Path, prompts: Sequence[str], settings: AuditSettings,
                    threads: int | None = None) -> tuple[list[PromptRun], dict[str, list[Path]]]:
    """Run the prompts through ``swarm`` (started with capture=True); returns the asker's truth and,
    per trunk, the capture files this run added."""
    before = {d: capture_files(d) for d in swarm.capture_dirs}
    transform = None
    if settings.uplink_noise:
        transform = UplinkNoise.calibrated(model, settings.head_layers, settings.uplink_noise,
                                           seed=settings.noise_seed, n_threads=threads)
    runs = asyncio.run(run_prompts(swarm, model, prompts, max_tokens=settings.max_tokens,
                                   uplink_transform=transform, n_threads=threads))
    return runs, {d.name: sorted(capture_files(d) - before[d]) for d in swarm.capture_dirs}


def attack_and_score(model: Path, runs: list[PromptRun], captures: dict[str, list[Path]],
                     settings: AuditSettings) -> AuditReport:
    """The attack on what was captured, scored against what was asked. It computes on the
    process's compute thread, where the capture's asker computed: a second thread computing on
    several threads would keep a second OpenMP team, and once this process's teams hold more
    threads than there are cores every barrier sleeps (the table's build on two threads took
    2.31 s instead of 1.29 for the same batches beside a two-thread team of another thread)."""
    return compute_thread().submit(_attack_and_score, model, runs, captures, settings).result()


def _attack_and_score(model: Path, runs: list[PromptRun], captures: dict[str, list[Path]],
                      settings: AuditSettings) -> AuditReport:
    from kernels.tokenizer import Tokenizer

    weights = None
    if settings.uplink_noise and settings.attacker_knows_noise:
        # The mitigation is public code calibrated on a public text: the attacker recomputes its
        # per-dimension scale and weighs distances by it (the likeliest token under that noise).
        std = calibrate(model, settings.head_layers, n_threads=settings.attack_threads)
        weights = 1.0 / np.maximum(std, 1e-6 * float(std.max()))
    result = attack(model, captures, cache_dir=settings.cache_dir, max_candidates=settings.max_candidates,
                    n_threads=settings.attack_threads, weights=weights,
                    table_threads=settings.table_threads or default_threads())
    return score(runs, result, Tokenizer(model).decode, model=model.name, head_layers=settings.head_layers,
                 uplink_noise=settings.uplink_noise, max_candidates=settings.max_candidates)
