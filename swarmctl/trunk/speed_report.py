"""The speed this trunk tells the host, kept current.

Measured at start (or once a stage's layers arrive, when the model file was missing), then
refreshed from the single-token batches a stage serves that had the CPU to themselves, or measured
again while idle when the first measurement had to share the CPU (kernels/speed.py): never
measured beside the stage's own work. The host smooths served figures and re-plans only on a
sustained gain worth the move (plans/hysteresis.py), so only a figure ``worth_reporting`` is sent,
marked ``serving`` when it comes from the batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from kernels.gguf_file import GGUFFile
from kernels.speed import (REPORT_FACTOR, SERVED_REPORT_FACTOR, SpeedTracker, measure_prompt_rate, measure_ram_rate,
                           measure_speed, worth_reporting)
from net import clock
from net import messages as m
from swarmctl.trunk.context import TrunkContext

log = logging.getLogger("swarmctl.trunk")


class SpeedReport:
    def __init__(self, ctx: TrunkContext, tell_host: Callable[[m.Message], Awaitable[None]]) -> None:
        self.model_path = ctx.model_path
        self.n_threads = ctx.n_threads
        self.device = ctx.device  # measured where the slices will run
        self.ms_per_layer_token: float | None = None  # the figure the host has
        self.prompt_ms_per_layer_row: float | None = None  # a prompt row's, measured with it (plans/prefill.py)
        self.tracker = SpeedTracker()
        self._executor = ctx.executor
        self._tell_host = tell_host
        self._spawn = ctx.spawn

    def measure(self, model: Path | None = None, layer: int | None = None) -> float:
        """On the compute thread: repeats, after a warm-up, with the repeats that other processes
        starved left out (kernels/speed.py)."""
        with GGUFFile(model or self.model_path) as gguf:
            measurement = measure_speed(gguf, n_threads=self.n_threads, layer=layer, device=self.device)
            prompt = measure_prompt_rate(gguf, n_threads=self.n_threads, layer=layer, device=self.device,
                                         one_row_ms=measurement.ms_per_layer_token)
        self.tracker.measured(measurement)
        # (a prompt figure from a starved probe is left out: it only ever feeds a prediction)
        if not prompt.contended or self.prompt_ms_per_layer_row is None:
            self.prompt_ms_per_layer_row = prompt.ms_per_layer_token
        log.info("measured %s; a prompt row %.3f ms per layer", measurement.describe(), prompt.ms_per_layer_token)
        return measurement.ms_per_layer_token

    async def measure_at_start(self) -> None:
        loop = asyncio.get_running_loop()
        self.ms_per_layer_token = await loop.run_in_executor(self._executor, self.measure)
        log.info("this machine runs one layer of %s in %.2f ms per token", self.model_path.name,
                 self.ms_per_layer_token)

    async def measure_ram_rate(self) -> float | None:
        """GB/s at which this machine's CPU gets through routed experts kept in host RAM (a GPU
        trunk offering RAM beside its device: kernels/speed.py RamRate); None for a dense model,
        whose layers have no routed experts to keep there."""
        def measure() -> float | None:
            with GGUFFile(self.model_path) as gguf:
                rate = measure_ram_rate(gguf, n_threads=self.n_threads)
            if rate is not None:
                log.info("routed experts in host RAM: %s", rate.describe())
            return rate.gb_s if rate is not None else None

        return await asyncio.get_running_loop().run_in_executor(self._executor, measure)

    async def measure_slice(self, model: Path, first_layer: int) -> None:
        """A trunk that started without the model file measures on the layers it was sent."""
        loop = asyncio.get_running_loop()
        self.ms_per_layer_token = await loop.run_in_executor(self._executor, self.measure, model, first_layer)
        await self._tell_host(m.Speed(ms_per_layer_token=self.ms_per_layer_token,
                                      prompt_ms_per_layer_row=self.prompt_figure))

    def refresh(self, serving: tuple[object, int] | None, idle: bool) -> None:
        """Keep the host's figure current. ``serving``: (the batch runner, the stage's layer count)
        of a stage serving its own layers; ``idle``: nothing loaded, so measuring again disturbs nobody.
        An idle trunk measures again now and then: a slow spell (at its start, or in the batches it
        served) may have planned it out, and a trunk that serves nothing has no batch to say it is
        fast again."""
        if serving is not None:
            runner, n_layers = serving
            engine = getattr(runner, "engine", None)
            threads = engine.backend.n_threads if engine is not None else None
            self.tracker.observe(runner.stats.recent, n_layers, n_threads=threads, one_row_ms=self.ms_per_layer_token)
            self._report(self.tracker.serving_report(self.ms_per_layer_token), "while serving", serving=True)
        can_measure = idle and self.model_path.exists()
        contended_again = can_measure and self.tracker.take_remeasure()
        idle_again = self.tracker.take_idle_remeasure(can_measure, clock.now())
        if contended_again or idle_again:
            self._spawn(self._remeasure())

    async def _remeasure(self) -> None:
        figure = await asyncio.get_running_loop().run_in_executor(self._executor, self.measure)
        if not self.tracker.contended or self.ms_per_layer_token is None or figure < self.ms_per_layer_token:
            self._report(figure, "measured again")  # (a contended figure only bounds the speed from above)

    def _report(self, figure: float | None, how: str, serving: bool = False) -> None:
        # (a served figure comes only when the tracker says the host should hear it, the same again included)
        if serving and figure is not None or worth_reporting(figure, self.ms_per_layer_token, REPORT_FACTOR):
            news = worth_reporting(figure, self.ms_per_layer_token, SERVED_REPORT_FACTOR)
            (log.info if news else log.debug)("%s: %.3f ms per layer (the host had %s)", how, figure,
                                              f"{self.ms_per_layer_token:.3f}" if self.ms_per_layer_token else "none")
            self.ms_per_layer_token = figure
            if serving:  # the prompt batches it served since, if any, ride along (plans/prefill.py)
                self.prompt_ms_per_layer_row = self.tracker.prompt_estimate() or self.prompt_ms_per_layer_row
            self._spawn(self._tell_host(m.Speed(ms_per_layer_token=figure, serving=serving,
                                                prompt_ms_per_layer_row=self.prompt_figure)))

    @property
    def prompt_figure(self) -> float | None:
        """The prompt row figure as the wire bounds it (a GPU's can be below the bound's floor)."""
        figure = self.prompt_ms_per_layer_row
        return None if figure is None else min(max(figure, m.MS_PER_LAYER[0]), m.MS_PER_LAYER[1])
