"""The compute devices this build of llama.cpp offers, and picking one by what a user types.

ggml keeps a registry of backends: the CPU always, and whatever GPU backends llama-cpp-python was
compiled with (CUDA, Metal, Vulkan, ROCm/HIP, SYCL, RPC; see docs/gpus.md for the install lines). Each
device has a name ("CPU", "CUDA0", "Vulkan0", "Metal", "ROCm0", ...), a description (the card's
name) and the memory it reports. Users say ``--device auto|cpu|cuda[:N]|metal|vulkan[:N]|rocm[:N]``:
a family and an index within it. ``auto`` takes the first GPU the build offers, else the CPU.

Vulkan skips devices that are themselves CPUs (Mesa's lavapipe, say) unless
``GGML_VK_VISIBLE_DEVICES`` lists them; tests set it to use lavapipe as a GPU that is not the
host's memory.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass, field

from . import ggml
from .errors import EngineError

# How ggml names each family's devices (the name without its index), lower-cased → what users type.
_FAMILIES = {"cpu": "cpu", "cuda": "cuda", "vulkan": "vulkan", "metal": "metal", "mtl": "metal", "rocm": "rocm",
             "hip": "rocm", "sycl": "sycl", "rpc": "rpc", "opencl": "opencl", "cann": "cann", "musa": "musa"}
_KINDS = {ggml.DEVICE_TYPE_CPU: "cpu", ggml.DEVICE_TYPE_GPU: "gpu", ggml.DEVICE_TYPE_IGPU: "igpu"}


class DeviceError(EngineError):
    """A device that was asked for and is not there, or cannot be started."""


@dataclass(frozen=True)
class Device:
    name: str  # ggml's: CPU, CUDA0, Vulkan0, ...
    family: str  # what users type: cpu, cuda, vulkan, metal, rocm, ...
    index: int  # within its family: cuda:1 is the second CUDA device
    kind: str  # cpu, gpu (own memory) or igpu (shares the host's)
    description: str
    memory_free: int  # bytes, as the device reports them now
    memory_total: int
    handle: int = field(default=0, compare=False, repr=False)  # ggml_backend_dev_t

    @property
    def label(self) -> str:
        """What users type for it: ``cpu``, ``cuda:0``, ``vulkan:1``."""
        return "cpu" if self.family == "cpu" else f"{self.family}:{self.index}"

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"

    def refreshed(self) -> "Device":
        """The same device with the memory it reports now."""
        free, total = _memory(self.handle)
        return Device(self.name, self.family, self.index, self.kind, self.description, free, total, self.handle)


def _memory(handle: int) -> tuple[int, int]:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    ggml.backend_dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return free.value, total.value


def _family(name: str) -> str:
    stem = re.sub(r"[\d\[].*$", "", name).lower()  # "CUDA0" → "cuda", "RPC[host:port]" → "rpc"
    return _FAMILIES.get(stem, stem or "unknown")


@functools.cache
def _registry() -> tuple[int, ...]:
    return tuple(ggml.backend_dev_get(i) for i in range(ggml.backend_dev_count()))


def available_devices() -> list[Device]:
    """Every device a slice can run on: the CPU, then each GPU, in ggml's order. Accelerators
    that only help the CPU (BLAS, AMX) are not devices of their own here."""
    devices: list[Device] = []
    per_family: dict[str, int] = {}
    for handle in _registry():
        kind = _KINDS.get(ggml.backend_dev_type(handle))
        if kind is None:
            continue
        name = (ggml.backend_dev_name(handle) or b"?").decode(errors="replace")
        family = "cpu" if kind == "cpu" else _family(name)
        index = per_family.get(family, 0)
        per_family[family] = index + 1
        free, total = _memory(handle)
        description = (ggml.backend_dev_description(handle) or b"").decode(errors="replace").strip()
        devices.append(Device(name, family, index, kind, description, free, total, handle))
    return devices


def choose_device(wanted: str = "auto", devices: list[Device] | None = None) -> Device:
    """The device ``wanted`` names (``auto``, ``cpu``, ``cuda``, ``cuda:1``, ``vulkan:0``, ...);
    DeviceError, naming what this build offers, when it is not there."""
    devices = available_devices() if devices is None else devices
    text = wanted.strip().lower()
    if text == "auto":
        gpus = [d for d in devices if not d.is_cpu]
        return gpus[0] if gpus else _cpu(devices)
    family, _, number = text.partition(":")
    family = _FAMILIES.get(family, family)
    if not re.fullmatch(r"[a-z]+", family) or (number and not number.isdigit()):
        raise DeviceError(f"--device {wanted!r}: expected auto, cpu, or a family with an optional index "
                          f"(cuda, cuda:1, metal, vulkan:0, rocm)")
    if family == "cpu":
        return _cpu(devices)
    index = int(number) if number else 0
    matches = [d for d in devices if d.family == family and d.index == index]
    if not matches:
        raise DeviceError(f"no {family}{':' + number if number else ''} device: this build offers "
                          f"{describe_all(devices)}")
    return matches[0]


def _cpu(devices: list[Device]) -> Device:
    for d in devices:
        if d.is_cpu:
            return d
    raise DeviceError("this build of llama.cpp registers no CPU device")


def describe_all(devices: list[Device]) -> str:
    return ", ".join(f"{d.label} ({d.description or d.name})" for d in devices) or "no devices"


# Left free on a GPU for what the slice's tensors and KV cache do not count: compute buffers, the
# driver's own allocations, other programs' windows. llama.cpp's fitting leaves about 1 GiB.
MIN_RESERVE_BYTES = 512 * 2**20
RESERVE_SHARE = 0.05


def device_budget(device: Device) -> int:
    """Bytes a slice may take on ``device`` when the user does not say: what it reports free now,
    less a reserve (the larger of 512 MiB and 5% of its total)."""
    device = device.refreshed()
    reserve = max(MIN_RESERVE_BYTES, int(device.memory_total * RESERVE_SHARE))
    return max(0, device.memory_free - reserve)
