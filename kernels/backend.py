"""Where tensors live and graphs run: the one place that knows which device computes.

On the CPU (the default) weights stay in the GGUF's memory map: ``weights_buffer`` wraps it, no
copy and no read. On any other device (kernels.devices: CUDA, Metal, Vulkan, ROCm, ...) weights
are copied into the device's memory (``upload_buffer_type``), and the KV cache and every graph's
tensors are allocated there too, through the same ggml-backend calls; the graphs themselves do
not change. ``upload=True`` sends a CPU backend down that copying path, so it can be tested on a
machine with no GPU.
"""

from __future__ import annotations

import functools
import os

from . import ggml
from .devices import Device, DeviceError

# The CPU extra buffer type whose weights the engine may repack (kernels.weights, repack=True).
# Never "AMX": llama.cpp's AMX matmul dies with SIGILL on some AMX CPUs (issue 13).
REPACK_BUFFER_TYPE = "CPU_REPACK"


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


@functools.cache
def cpu_extra_buffer_types() -> dict[str, int]:
    """The CPU backend's extra buffer types by name (e.g. CPU_REPACK, AMX, CPU_KLEIDIAI: what
    this build and this CPU offer), as llama.cpp finds them: through the CPU registry's
    ``ggml_backend_dev_get_extra_bufts``."""
    reg = ggml.backend_cpu_reg()
    address = ggml.backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not reg or not address:
        return {}
    bufts = ggml.DevGetExtraBufts(address)(ggml.backend_reg_dev_get(reg, 0))
    found: dict[str, int] = {}
    i = 0
    while bufts and bufts[i]:
        found[ggml.backend_buft_name(bufts[i]).decode()] = bufts[i]
        i += 1
    return found


class Backend:
    """A ggml compute backend on one device (the CPU unless told otherwise); on the CPU with a
    fixed thread count."""

    def __init__(self, n_threads: int | None = None, device: Device | None = None, *, upload: bool = False) -> None:
        self.n_threads = n_threads or default_threads()
        self.device = device
        on_cpu = device is None or device.is_cpu
        self.uploads_weights = upload or not on_cpu
        self.handle: int = ggml.backend_cpu_init() if on_cpu else ggml.backend_dev_init(device.handle, None)
        if not self.handle:
            raise DeviceError(f"cannot start ggml's backend for {device.label if device else 'cpu'}")
        if on_cpu:
            ggml.backend_cpu_set_n_threads(self.handle, self.n_threads)
        self.name = "cpu" if device is None else device.label

    def weights_buffer(self, host_address: int, size: int) -> int:
        """A buffer over memory-mapped weights, for a backend that computes on them in place (the
        CPU): it wraps the map, no copy, no read."""
        if self.uploads_weights:
            raise RuntimeError(f"{self.name} copies its weights (upload_buffer_type); it cannot wrap the map")
        buffer = ggml.backend_cpu_buffer_from_ptr(host_address, size)
        if not buffer:
            raise MemoryError("ggml_backend_cpu_buffer_from_ptr failed")
        return buffer

    def upload_buffer_type(self) -> int | None:
        """Where weights are copied to (the device's memory); None where they are used in place."""
        return ggml.backend_get_default_buffer_type(self.handle) if self.uploads_weights else None

    def buffer_type(self) -> int:
        return ggml.backend_get_default_buffer_type(self.handle)

    def repack_buffer_type(self) -> int | None:
        """ggml's CPU_REPACK buffer type, where this build has it and weights stay on the CPU;
        None otherwise."""
        if self.uploads_weights:
            return None
        return cpu_extra_buffer_types().get(REPACK_BUFFER_TYPE)

    def unsupported_ops(self, graph: int) -> list[str]:
        """The operations of ``graph`` this backend cannot run (none on the CPU), by name."""
        missing: dict[str, None] = {}
        for i in range(ggml.graph_n_nodes(graph)):
            node = ggml.graph_node(graph, i)
            if not ggml.backend_supports_op(self.handle, node):
                missing[(ggml.op_desc(node) or b"?").decode()] = None
        return list(missing)

    def alloc_context_tensors(self, ctx: int) -> int:
        """Allocate every tensor of a no_alloc context in one backend buffer (zeroed)."""
        buffer = ggml.backend_alloc_ctx_tensors(ctx, self.handle)
        if not buffer:
            raise MemoryError("ggml_backend_alloc_ctx_tensors failed")
        ggml.backend_buffer_clear(buffer, 0)
        return buffer

    def compute(self, graph: int) -> None:
        status = ggml.backend_graph_compute(self.handle, graph)
        if status != ggml.STATUS_SUCCESS:
            raise RuntimeError(f"ggml graph compute failed (status {status})")

    def close(self) -> None:
        if self.handle:
            ggml.backend_free(self.handle)
            self.handle = 0

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
