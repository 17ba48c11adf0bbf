"""Where tensors live and graphs run. The one place that knows we compute on the CPU.

A CUDA build of llama-cpp-python exposes a CUDA backend through the same ggml-backend calls;
supporting it means changing this module only: ``weights_buffer`` would copy host bytes into a
device buffer instead of wrapping them, and ``compute`` would run there.
"""

from __future__ import annotations

import functools
import os

from . import ggml

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
    """A ggml compute backend (CPU) with a fixed thread count."""

    def __init__(self, n_threads: int | None = None) -> None:
        self.n_threads = n_threads or default_threads()
        self.handle: int = ggml.backend_cpu_init()
        if not self.handle:
            raise RuntimeError("ggml_backend_cpu_init failed")
        ggml.backend_cpu_set_n_threads(self.handle, self.n_threads)
        self.name = "cpu"

    def weights_buffer(self, host_address: int, size: int) -> int:
        """A buffer over memory-mapped weights. On the CPU this wraps the map: no copy, no read."""
        buffer = ggml.backend_cpu_buffer_from_ptr(host_address, size)
        if not buffer:
            raise MemoryError("ggml_backend_cpu_buffer_from_ptr failed")
        return buffer

    def buffer_type(self) -> int:
        return ggml.backend_get_default_buffer_type(self.handle)

    def repack_buffer_type(self) -> int | None:
        """ggml's CPU_REPACK buffer type, where this build has it; None otherwise."""
        return cpu_extra_buffer_types().get(REPACK_BUFFER_TYPE)

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
