"""List the devices this machine's build of llama.cpp offers, the way --device names them.

A GPU appears only when llama-cpp-python was built with its backend (docs/gpus.md). Memory is
what each device reports now; on a GPU, a trunk offers what is free less a reserve unless told
--gpu-memory.

examples:
  swarmctl devices
  GGML_VK_VISIBLE_DEVICES=0 swarmctl devices     (Vulkan: also list CPU-type devices, e.g. lavapipe)
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from kernels.devices import available_devices, choose_device, device_budget

    devices = available_devices()
    auto = choose_device("auto", devices)
    rows = [("DEVICE", "KIND", "MEMORY FREE / TOTAL", "A TRUNK OFFERS", "NAME")]
    for d in devices:
        offers = "--memory (host RAM)" if d.is_cpu else f"{device_budget(d) / 1e9:.1f} GB"
        rows.append((d.label + (" *" if d == auto else ""), d.kind, f"{d.memory_free / 1e9:.1f} / "
                     f"{d.memory_total / 1e9:.1f} GB", offers, d.description or d.name))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("* what --device auto picks")
    return 0
