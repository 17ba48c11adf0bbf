"""The planner's options, written once: `swarmctl init` takes them, `swarmctl plan` overrides them,
`swarmctl config` changes them on the host, the host keeps them in its node.json (NodeConfig) and
plans with them (Constraints). Each option's flag, default, bounds and meaning live here, and each
of those places derives what it needs (they were written out in each).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Callable

from .proposal import HEAD_LAYERS, Constraints
from .wire import SETTINGS as WIRE_DTYPES

from kernels.backend import KERNELS  # the CPU kernels every member computes with
from kernels.kv_cache import ATTENTION  # how every member computes attention

OBJECTIVES = ("latency", "throughput", "even")


@dataclass(frozen=True)
class PlannerOption:
    key: str  # the flag without its dashes, and the setting's name in `swarmctl config`
    field: str  # PlannerSettings' attribute
    config_field: str  # NodeConfig's attribute (node.json)
    default: object
    metavar: str
    help: str
    minimum: int | None = None  # a whole number of at least this; None: one of ``choices``
    choices: tuple[str, ...] = OBJECTIVES
    configurable: bool = True  # `swarmctl config` may change it on a running host
    describe: Callable[[object], str] = str  # how `swarmctl config` shows a value

    def parse(self, text: str, who: str) -> object:
        """A value as typed (``who``: the command, for the one-line error)."""
        if self.minimum is None:
            if text not in self.choices:
                raise ValueError(f"{who}: {self.key} must be one of {', '.join(self.choices)}, not {text!r}")
            return text
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < self.minimum:
            raise ValueError(f"{who}: {self.key} must be a whole number of at least {self.minimum}, not {text!r}")
        return value


OPTIONS: tuple[PlannerOption, ...] = (
    PlannerOption("objective", "objective", "objective", "latency", "",
                  "what the planner optimises: one stream's latency, the pipeline's throughput, or every trunk "
                  "used in proportion to its memory (even)"),
    PlannerOption("head-layers", "head_layers", "head_layers", HEAD_LAYERS, "K",
                  "layers each asker keeps at each end of the model", minimum=0, configurable=False),
    PlannerOption("context", "context", "plan_context", 4096, "TOKENS",
                  "KV room per request each stage must hold", minimum=1, describe=lambda v: f"{v} tokens"),
    PlannerOption("concurrent", "concurrent", "plan_concurrent", 4, "N",
                  "requests whose KV each stage must hold at once", minimum=1, describe=lambda v: f"{v} requests"),
    PlannerOption("max-stages", "max_stages", "plan_max_stages", 0, "N",
                  "use at most N trunks at once; the others stand by to take over (0: no limit)", minimum=0,
                  describe=lambda v: f"{v}" if v else "0 (no limit)"),
    PlannerOption("expert-nodes", "expert_nodes", "expert_nodes", 0, "N",
                  "mixture-of-experts models: N trunks hold the experts (split between them) and the others run "
                  "attention and the routers (expert parallelism; 0: none)", minimum=0,
                  describe=lambda v: f"{v}" if v else "0 (none)"),
    PlannerOption("wire-dtype", "wire_dtype", "wire_dtype", "f32", "",
                  "how activations travel between machines: f32 as computed (answers identical to one machine's), "
                  "f16 or q8_0 (half or about a quarter of the bytes and datagrams), or auto: f32 within a site "
                  "and f16 between sites", choices=WIRE_DTYPES),
    PlannerOption("kernels", "kernels", "kernels", "plain", "",
                  "the CPU kernels every member computes with: plain weights from the model file (llama.cpp with "
                  "use_extra_bufts off), repack: weights copied into the CPU's repacked buffer types where ggml "
                  "takes them (faster matmuls on AVX2/AVX-512/NEON for Q4_0, Q4_K, IQ4_NL, ...; llama.cpp's "
                  "default, AMX left out), or amx: AMX too where the CPU has it (it has crashed on some Xeons); "
                  "answers are identical across members either way", choices=KERNELS),
    PlannerOption("attention", "attention", "attention", "plain", "",
                  "how every member computes attention: plain (llama.cpp without flash attention) or flash "
                  "(ggml's flash attention, llama.cpp's -fa 1: faster decode; other bits, so the whole swarm "
                  "switches; latent attention stays plain)", choices=ATTENTION),
)
BY_KEY = {option.key: option for option in OPTIONS}


@dataclass(frozen=True)
class PlannerSettings:
    objective: str = "latency"
    head_layers: int = HEAD_LAYERS
    context: int = 4096
    concurrent: int = 4
    max_stages: int = 0
    expert_nodes: int = 0
    wire_dtype: str = "f32"
    kernels: str = "plain"
    attention: str = "plain"

    def constraints(self) -> Constraints:
        return Constraints(self.head_layers, self.context, self.concurrent, self.objective,
                           max_stages=self.max_stages, wire_dtype=self.wire_dtype, kernels=self.kernels,
                           attention=self.attention)

    @classmethod
    def from_config(cls, config) -> "PlannerSettings":
        """The host's settings as its node.json keeps them (an option a config object lacks, as
        stand-ins written before the option existed: its default)."""
        return cls(**{o.field: getattr(config, o.config_field, o.default) for o in OPTIONS})

    def into_config(self, config) -> None:
        """Written into a host's NodeConfig (node.json): `init` and the local swarm."""
        for o in OPTIONS:
            setattr(config, o.config_field, getattr(self, o.field))


assert [f.name for f in fields(PlannerSettings)] == [o.field for o in OPTIONS]
assert PlannerSettings() == PlannerSettings(**{o.field: o.default for o in OPTIONS})


def add_arguments(parser: argparse.ArgumentParser, *, inherit: str = "") -> None:
    """The options as flags. ``inherit``: they default to None (taken from elsewhere, which this
    names in the help); else to their defaults."""
    for o in OPTIONS:
        default = f"default: {inherit}; on paper, {o.default}" if inherit else f"default {o.default}"
        kind = {"choices": o.choices} if o.minimum is None else {"type": _whole(o), "metavar": o.metavar}
        parser.add_argument(f"--{o.key}", default=None if inherit else o.default, help=f"{o.help} ({default})",
                            **kind)


def given(args: argparse.Namespace) -> dict[str, object]:
    """The options a command line gave (those not left at None)."""
    return {o.field: getattr(args, o.field) for o in OPTIONS if getattr(args, o.field, None) is not None}


def _whole(option: PlannerOption) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return option.parse(text, f"--{option.key}")  # type: ignore[return-value]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None
    parse.__name__ = "whole number"
    return parse


# ``--head-layers`` wherever a command takes it (ask, serve, audit, plans.whatif), bounded as `init`
# bounds it; whether the model keeps layers for the trunk is checked once the model is known.
head_layers_arg = _whole(BY_KEY["head-layers"])
