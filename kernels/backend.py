"""Where tensors live and graphs run: the one place that knows which device computes.

On the CPU (the default) weights stay in the GGUF's memory map: ``weights_buffer`` wraps it, no
copy and no read. On any other device (kernels.devices: CUDA, Metal, Vulkan, ROCm, ...) weights
are copied into the device's memory (``upload_buffer_type``), and the KV cache and every graph's
tensors are allocated there too, through the same ggml-backend calls; the graphs themselves do
not change. ``upload=True`` sends a CPU backend down that copying path, so it can be tested on a
machine with no GPU.
"""

from __future__ import annotations

import ctypes
import functools

from . import ggml
from .devices import Device, DeviceError
from .threads import default_threads

# The kernels a slice's weights may use (the swarm's `kernels` setting, plans/options.py):
# plain: every weight computes from the GGUF's map, as llama.cpp with use_extra_bufts=False;
# repack: the weights the CPU's extra buffer types take are copied there (kernels/weight_bufts.py),
#   all but AMX: ggml's AMX matmul has crashed llama.cpp on AMX Xeons (SIGSEGV and SIGILL, seen
#   here with llama-cpp-python's default load; https://github.com/ggml-org/llama.cpp/issues/20824), so it is opt-in;
# amx: every extra type ggml offers, in its order (AMX first where the CPU has it): llama.cpp's
#   default load exactly.
KERNELS = ("plain", "repack", "amx")
REPACK_BUFFER_TYPE = "CPU_REPACK"
AMX_BUFFER_TYPE = "AMX"


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


def kernel_buffer_types(kernels: str) -> list[tuple[str, int]]:
    """The CPU's extra buffer types ``kernels`` may put weights in, in ggml's order (the order
    llama.cpp tries them in); [] for plain, or where this build and CPU offer none."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, not {kernels!r}")
    if kernels == "plain":
        return []
    return [(name, buft) for name, buft in cpu_extra_buffer_types().items()
            if kernels == "amx" or name != AMX_BUFFER_TYPE]


def describe_kernels(kernels: str) -> str:
    """One line for start-up logs: what ``kernels`` means on this CPU, and what it falls back to."""
    offered = list(cpu_extra_buffer_types())
    used = [name for name, _ in kernel_buffer_types(kernels)]
    if kernels == "plain":
        return "kernels plain: weights compute from the model file's map" + (
            f" (this CPU also offers {', '.join(offered)}: `swarmctl config kernels repack`)" if offered else "")
    if not used:
        left = f" ({', '.join(offered)} left out: AMX matmuls crash on some Xeons; `kernels amx` opts in)" if offered else ""
        return f"kernels {kernels}: this CPU offers no extra buffer types we use{left}; weights stay plain"
    skipped = [n for n in offered if n not in used]
    note = f"; {', '.join(skipped)} left out (crashes on some Xeons; `kernels amx` opts in)" if skipped else ""
    return f"kernels {kernels}: {', '.join(used)} where ggml takes the weight, else plain{note}"


@functools.cache
def cpu_device() -> int:
    """The CPU's ggml device (ggml_backend_dev_t), whose supports_op judges extra buffer types."""
    return ggml.backend_reg_dev_get(ggml.backend_cpu_reg(), 0)


class Backend:
    """A ggml compute backend on one device (the CPU unless told otherwise), and on a GPU a CPU
    backend beside it for the layers that do not fit (partial offload) and for operations the
    device lacks, which ggml's scheduler then runs there. CPU work uses ``n_threads`` threads."""

    def __init__(self, n_threads: int | None = None, device: Device | None = None, *, upload: bool = False,
                 device_layers: range | None = None, expert_layers: frozenset[int] | None = None) -> None:
        """``device_layers``: with a GPU (or ``upload`` on the CPU: the device path, tested without
        one), the layers whose weights and KV cache go there (None: all of them, and the slice's
        embedding and LM head too); the rest stay on the CPU. ``expert_layers``: of those, the
        layers whose routed experts go there too (None: all of them; kernels/device_split.py)."""
        self.n_threads = n_threads or default_threads()
        self.device = device
        on_cpu = device is None or device.is_cpu
        self.uploads_weights = upload or not on_cpu
        self.device_layers = device_layers if self.uploads_weights else None
        self.expert_layers = expert_layers if self.device_layers is not None else None
        self.handle: int = ggml.backend_cpu_init() if on_cpu else ggml.backend_dev_init(device.handle, None)
        if not self.handle:
            raise DeviceError(f"cannot start ggml's backend for {device.label if device else 'cpu'}")
        self.cpu_handle = self.handle if on_cpu else ggml.backend_cpu_init()
        # Graph allocators no graph uses now, kept for the next graph rather than freed: on a
        # device (not the CPU), ggml-vulkan crashed within a few steps when compute buffers were
        # freed and new ones allocated (lavapipe; llama.cpp never frees its compute buffers while
        # it runs, so it never takes that path). They are freed with the backend.
        self._idle_gallocrs: list[int] = []
        self.weights_kept_on_cpu = False  # set by the weights: some the device cannot hold stay in host memory
        ggml.backend_cpu_set_n_threads(self.cpu_handle, self.n_threads)
        self.name = "cpu" if device is None else device.label

    def set_threads(self, n_threads: int) -> None:
        """CPU work from the next graph on uses ``n_threads`` threads."""
        self.n_threads = n_threads
        ggml.backend_cpu_set_n_threads(self.cpu_handle, n_threads)

    @property
    def partial(self) -> bool:
        """Some layers on the device, the rest on the CPU; or weights the device could not hold
        kept on the CPU (kernels/weights.py)."""
        return self.device_layers is not None or self.weights_kept_on_cpu

    def on_device(self, layer: int | None, expert: bool = False) -> bool:
        """Whether ``layer``'s weights and KV cache live on the device (None: the slice's
        embedding and LM head, which stay on the CPU under partial offload, as llama.cpp's do);
        ``expert``: its routed experts' weights."""
        if not self.uploads_weights:
            return False
        if self.device_layers is None:
            return True
        if layer is None or layer not in self.device_layers:
            return False
        return not expert or self.expert_layers is None or layer in self.expert_layers

    def weights_buffer(self, host_address: int, size: int) -> int:
        """A buffer over memory-mapped weights the CPU computes on in place: it wraps the map, no
        copy, no read."""
        buffer = ggml.backend_cpu_buffer_from_ptr(host_address, size)
        if not buffer:
            raise MemoryError("ggml_backend_cpu_buffer_from_ptr failed")
        return buffer

    def upload_buffer_type(self) -> int | None:
        """Where weights are copied to (the device's memory); None where they are used in place."""
        return ggml.backend_get_default_buffer_type(self.handle) if self.uploads_weights else None

    def buffer_type(self) -> int:
        return ggml.backend_get_default_buffer_type(self.handle)

    def layer_buffer_type(self, layer: int) -> int:
        """Where ``layer``'s KV cache lives."""
        return ggml.backend_get_default_buffer_type(self.handle if self.on_device(layer) else self.cpu_handle)

    def weight_buffer_types(self, kernels: str) -> list[tuple[str, int]]:
        """The extra buffer types weights may go to under ``kernels`` (kernel_buffer_types),
        where weights stay on the CPU; [] when they go to a device."""
        return [] if self.uploads_weights else kernel_buffer_types(kernels)

    def unsupported_ops(self, graph: int) -> list[str]:
        """The operations of ``graph`` this backend cannot run (none on the CPU), by name."""
        missing: dict[str, None] = {}
        for i in range(ggml.graph_n_nodes(graph)):
            node = ggml.graph_node(graph, i)
            if not ggml.backend_supports_op(self.handle, node):
                missing[(ggml.op_desc(node) or b"?").decode()] = None
        return list(missing)

    def scheduler_for(self, graph: int) -> int | None:
        """A ggml scheduler for ``graph`` when one backend cannot run it all: layers split between
        the device and the CPU, or operations the device lacks. It sends each operation to the
        backend holding its weights, the rest to the device where it can, else to the CPU, and
        copies activations between them. None: the device runs the whole graph itself."""
        if self.handle == self.cpu_handle or not (self.partial or self.unsupported_ops(graph)):
            return None
        backends = (ctypes.c_void_p * 2)(self.handle, self.cpu_handle)
        sched = ggml.backend_sched_new(backends, None, 2, max(ggml.GGML_DEFAULT_GRAPH_SIZE, 2 * ggml.graph_n_nodes(graph)),
                                       False, False)
        if not sched:
            raise MemoryError("ggml_backend_sched_new failed")
        return sched

    def new_gallocr(self) -> int:
        """A graph allocator for this backend's buffer type (0 if ggml cannot make one)."""
        if self._idle_gallocrs:
            return self._idle_gallocrs.pop()
        return ggml.gallocr_new(self.buffer_type())

    def release_gallocr(self, galloc: int) -> None:
        """A graph allocator no graph uses any more: freed on the CPU, kept for reuse on a device."""
        if self.handle == self.cpu_handle:
            ggml.gallocr_free(galloc)
        else:
            self._idle_gallocrs.append(galloc)

    def idle_gallocr_bytes(self) -> int:
        """Bytes the idle graph allocators kept for reuse still hold (their device buffers)."""
        return sum(ggml.gallocr_get_buffer_size(g, 0) for g in self._idle_gallocrs)

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
        while self._idle_gallocrs:
            ggml.gallocr_free(self._idle_gallocrs.pop())
        if self.cpu_handle and self.cpu_handle != self.handle:
            ggml.backend_free(self.cpu_handle)
        self.cpu_handle = 0
        if self.handle:
            ggml.backend_free(self.handle)
            self.handle = 0

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
