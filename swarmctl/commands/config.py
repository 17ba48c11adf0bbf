"""Show or change the host's planner settings (run on the host). A running host re-plans at once;
otherwise the next 'swarmctl run --role host' plans with them.

settings:
  objective     latency (one stream's time per token), throughput (the pipeline's slowest stage)
                or even (every trunk, layers by memory)
  context       KV room per request, in tokens, each stage must hold
  concurrent    requests whose KV each stage must hold at once
  max-stages    use at most N trunks at once, the others stand by (0: no limit)
  expert-nodes  mixture-of-experts models: trunks that hold the experts (0: none)
  wire-dtype    how activations travel between machines: f32 (answers identical to one
                machine's), f16, q8_0, or auto (f32 within a site, f16 between sites)
  kernels       the CPU kernels every member computes with: plain (weights from the model
                file), repack (the CPU's repacked buffer types where ggml takes a weight:
                faster Q4_0/Q4_K/IQ4_NL matmuls; AMX left out) or amx (AMX too, where the CPU
                has it; it has crashed on some Xeons). Every member reloads under the new one
  attention     how every member computes attention: plain, or flash (ggml's flash attention,
                llama.cpp's -fa 1: faster decode, other bits; latent attention stays plain).
                Every stage loads again under the new one

examples:
  swarmctl config                          # show them
  swarmctl config objective throughput
  swarmctl config context 8192 concurrent 2
  swarmctl config wire-dtype f16
  swarmctl config kernels repack
  swarmctl config attention flash
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import socket
from dataclasses import dataclass
from typing import Callable

from kernels.errors import EngineError
from net import messages as m
from net.endpoint import Address, close, connect_member
from net.protocol import RequestOnlyHandler
from net.wire import WireError
from swarmctl.errors import UsageError
from plans.options import OPTIONS, PlannerOption
from swarmctl.node.home import NodeConfig, SwarmHome

@dataclass(frozen=True)
class Setting:
    field: str  # NodeConfig's attribute
    parse: Callable[[str, str], object]
    describe: Callable[[object], str] = str


def _parse(option: PlannerOption) -> Callable[[str, str], object]:
    def parse(key: str, text: str) -> object:
        try:
            return option.parse(text, "swarmctl config")
        except ValueError as e:
            raise UsageError(str(e)) from None
    return parse


# The planner's options a running host may change (plans/options.py; head layers are fixed at init).
SETTINGS: dict[str, Setting] = {o.key: Setting(o.config_field, _parse(o), o.describe) for o in OPTIONS if o.configurable}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pairs", nargs="*", metavar="KEY VALUE",
                        help=f"settings to change ({', '.join(SETTINGS)}); none: show them all")


def parse_pairs(pairs: list[str]) -> dict[str, object]:
    if len(pairs) % 2:
        key = pairs[-1]
        if key not in SETTINGS:
            raise UsageError(f"swarmctl config: unknown setting {key!r} (settings: {', '.join(SETTINGS)})")
        raise UsageError(f"swarmctl config: {key} needs a value (e.g. swarmctl config {key} "
                         f"{_example(key)})")
    changes: dict[str, object] = {}
    for key, text in zip(pairs[::2], pairs[1::2]):
        if key not in SETTINGS:
            raise UsageError(f"swarmctl config: unknown setting {key!r} (settings: {', '.join(SETTINGS)})")
        changes[key] = SETTINGS[key].parse(key, text)
    return changes


def _example(key: str) -> str:
    option = next(o for o in OPTIONS if o.key == key)
    if option.minimum is None:  # one of its choices: the first that is not the default
        return next(str(c) for c in option.choices if c != option.default)
    return "8192" if key == "context" else "2"


def show(config: NodeConfig) -> str:
    return "\n".join(f"{key:<13} {setting.describe(getattr(config, setting.field))}"
                     for key, setting in SETTINGS.items())


def _host_is_listening(listen: Address) -> bool:
    """Whether something holds the host's UDP port on this machine: a running host does. Binding
    the port ourselves answers at once, where a connection attempt to a host that is not there
    would wait for its handshake to time out."""
    if listen.port == 0:
        return False
    family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((listen.host, listen.port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


async def tell_running_host(config: NodeConfig, home: SwarmHome) -> m.Ok:
    """Ask the running host to take its settings from node.json again and re-plan; its reply."""
    listen = Address.parse(config.listen)
    local = Address("127.0.0.1" if listen.host in ("0.0.0.0", "") else "::1" if listen.host == "::" else listen.host,
                    listen.port)
    conn = await connect_member(local, home.credentials(), config.name, RequestOnlyHandler())
    try:
        return m.decode((await conn.request(m.encode(m.Reconfigure()), timeout=10)).body, m.Ok)
    finally:
        await close(conn)


def run(args: argparse.Namespace) -> int:
    changes = parse_pairs(args.pairs)
    home = SwarmHome()
    config = home.load_config()
    if config.role != "host":
        raise EngineError(f"{home.path} belongs to member {config.name}: the planner's settings live on the host "
                          "(run 'swarmctl config' there)")
    if not changes:
        print(show(config))
        return 0
    with home.locked():  # read-modify-write of node.json
        config = home.load_config()
        before = {key: getattr(config, SETTINGS[key].field) for key in changes}
        for key, value in changes.items():
            setattr(config, SETTINGS[key].field, value)
        home.save_config(config)
    for key, value in changes.items():
        old = before[key]
        print(f"{key}: {SETTINGS[key].describe(value)}" + (" (unchanged)" if old == value else
                                                         f", was {SETTINGS[key].describe(old)}"))
    if not _host_is_listening(Address.parse(config.listen)):
        print("the host is not running: it plans with these settings when 'swarmctl run --role host' starts")
        return 0
    try:
        reply = asyncio.run(tell_running_host(config, home))
    except (ConnectionError, OSError, asyncio.TimeoutError) as e:
        raise EngineError(f"saved, but the running host could not be told ({e}): restart it "
                          "('swarmctl run --role host') to apply them") from None
    except (m.Refused, WireError) as e:
        raise EngineError(f"saved, but the running host did not apply them ({e}): "
                          "restart it ('swarmctl run --role host') to apply them") from None
    warnings = "".join(f"; {w}" for w in reply.warnings or ())
    print(f"the running host re-planned under them: plan v{reply.plan_version}{warnings}")
    return 0
