"""ctypes binding to the ggml shared libraries that llama-cpp-python installs.

Binds only what the slice engine uses. The struct layouts below match the ggml bundled with
llama-cpp-python 0.3.36 (pinned in pyproject.toml); a different version may move them.

Every tensor and context is passed around as a plain integer address (``c_void_p``); use
``tensor_view(ptr)`` to read a tensor's type and shape.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
from ctypes import c_bool, c_char_p, c_float, c_int, c_int32, c_int64, c_size_t, c_uint8, c_void_p
from pathlib import Path

from .errors import TensorBoundsError

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64
GGML_DEFAULT_GRAPH_SIZE = 2048

# enum ggml_type (only the members we name in code; any GGUF type id passes through untouched)
TYPE_F32 = 0
TYPE_F16 = 1
TYPE_Q4_0 = 2
TYPE_Q4_1 = 3
TYPE_Q8_0 = 8
TYPE_I32 = 26
TYPE_I64 = 27

# enum ggml_prec
PREC_F32 = 10

# rope modes (ggml.h GGML_ROPE_TYPE_*)
ROPE_TYPE_NORM = 0
ROPE_TYPE_NEOX = 2

STATUS_SUCCESS = 0


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


class TensorStruct(ctypes.Structure):
    """struct ggml_tensor: read (type, shape, strides, name); written only by kernels.graph_bind,
    which points a kept graph's views at another cache (view_src, data, buffer, src[0])."""

    _fields_ = [
        ("type", c_int),
        ("buffer", c_void_p),
        ("ne", c_int64 * GGML_MAX_DIMS),
        ("nb", c_size_t * GGML_MAX_DIMS),
        ("op", c_int),
        ("op_params", c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", c_int32),
        ("src", c_void_p * GGML_MAX_SRC),
        ("view_src", c_void_p),
        ("view_offs", c_size_t),
        ("data", c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def tensor_view(ptr: int) -> TensorStruct:
    return TensorStruct.from_address(ptr)


def tensor_shape(ptr: int) -> tuple[int, int, int, int]:
    """ggml order: ne[0] is the fastest-moving (innermost) dimension."""
    t = tensor_view(ptr)
    return (t.ne[0], t.ne[1], t.ne[2], t.ne[3])


def tensor_strides(ptr: int) -> tuple[int, int, int, int]:
    t = tensor_view(ptr)
    return (t.nb[0], t.nb[1], t.nb[2], t.nb[3])


def _library_dir() -> Path:
    # Locate llama_cpp without importing it: importing it loads libllama, which a trunk does not need.
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def _load(name: str) -> ctypes.CDLL:
    # Load the files named by the libraries' sonames (libggml-base.so.0, not libggml-base.so): pip
    # installs the two as separate copies, and libllama (the oracle, and our tokenizer) links
    # against the soname. Loading the same file keeps one ggml in the process, not two.
    lib_dir = _library_dir()
    for candidate in (f"{name}.so.0", f"{name}.so"):
        path = lib_dir / candidate
        if path.exists():
            return ctypes.CDLL(os.fspath(path), mode=ctypes.RTLD_GLOBAL)
    raise ImportError(f"{name} not found in {lib_dir}")


# ggml parallelises each graph with OpenMP; after a parallel region libgomp's threads spin for
# GOMP_SPINCOUNT iterations (300000 by default) before sleeping. Several swarm processes share a
# small machine's cores, and that spinning starved the one doing the work (a local swarm ran at
# 30 tokens/s instead of 63 on 2 cores, measured). A short spin keeps barriers fast without
# stealing. Must be set before libgomp loads; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

_P = c_void_p  # any pointer: context, tensor, graph, backend, buffer

# What each binding is, bound on first use: importing kernels (the host reads a GGUF's spec, the
# planner its layout) loads no shared library; the first ggml call loads them.
_DECLARED: dict[str, tuple[str, str, object, tuple]] = {}


def _declare(attr: str, lib: str, symbol: str, restype, *argtypes) -> None:
    _DECLARED[attr] = (lib, symbol, restype, argtypes)


@functools.cache
def _libraries() -> dict[str, ctypes.CDLL]:
    libraries = {"base": _load("libggml-base"), "cpu": _load("libggml-cpu"),
                 # the backend registry: the CPU and whatever GPU backends this build has linked in
                 "registry": _load("libggml")}
    # ggml writes its log to stderr by default; route it to Python logging (debug level) instead,
    # so stderr stays for our own one-line messages.
    log_set = libraries["base"].ggml_log_set
    log_set.restype, log_set.argtypes = None, [c_void_p, c_void_p]
    log_set(_LOG_CALLBACK, None)
    return libraries


def __getattr__(name: str):
    """A binding (or one of the libraries: base, cpu, registry), loaded and bound on first use and
    kept as a module global, so later calls cost what a plain ctypes call costs."""
    if name in ("base", "cpu", "registry"):
        return _libraries()[name]
    if name not in _DECLARED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    lib, symbol, restype, argtypes = _DECLARED[name]
    fn = getattr(_libraries()[lib], symbol)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    globals()[name] = fn
    return fn


def _fn(name: str):
    """A binding, for this module's own functions (a module's __getattr__ serves only others)."""
    return globals().get(name) or __getattr__(name)


# --- contexts, tensors, graphs (ggml.h) ---
_declare("init", "base", "ggml_init", _P, InitParams)
_declare("free", "base", "ggml_free", None, _P)
_declare("tensor_overhead", "base", "ggml_tensor_overhead", c_size_t)
_declare("graph_overhead_custom", "base", "ggml_graph_overhead_custom", c_size_t, c_size_t, c_bool)
_declare("new_tensor_1d", "base", "ggml_new_tensor_1d", _P, _P, c_int, c_int64)
_declare("new_tensor_2d", "base", "ggml_new_tensor_2d", _P, _P, c_int, c_int64, c_int64)
_declare("new_tensor_3d", "base", "ggml_new_tensor_3d", _P, _P, c_int, c_int64, c_int64, c_int64)
_declare("new_tensor_4d", "base", "ggml_new_tensor_4d", _P, _P, c_int, c_int64, c_int64, c_int64, c_int64)
_declare("set_name", "base", "ggml_set_name", _P, _P, c_char_p)
_declare("get_name", "base", "ggml_get_name", c_char_p, _P)
_declare("format_name", "base", "ggml_format_name", _P, _P, c_char_p)
_declare("set_input", "base", "ggml_set_input", None, _P)
_declare("set_output", "base", "ggml_set_output", None, _P)
_declare("nbytes", "base", "ggml_nbytes", c_size_t, _P)
_declare("nelements", "base", "ggml_nelements", c_int64, _P)
_declare("row_size", "base", "ggml_row_size", c_size_t, c_int, c_int64)
_declare("type_size", "base", "ggml_type_size", c_size_t, c_int)
_declare("blck_size", "base", "ggml_blck_size", c_int64, c_int)
_declare("type_name", "base", "ggml_type_name", c_char_p, c_int)
_declare("new_graph_custom", "base", "ggml_new_graph_custom", _P, _P, c_size_t, c_bool)
_declare("build_forward_expand", "base", "ggml_build_forward_expand", None, _P, _P)
_declare("graph_n_nodes", "base", "ggml_graph_n_nodes", c_int, _P)
_declare("graph_get_tensor", "base", "ggml_graph_get_tensor", _P, _P, c_char_p)

# --- operators (ggml.h) ---
_declare("get_rows", "base", "ggml_get_rows", _P, _P, _P, _P)
_declare("set_rows", "base", "ggml_set_rows", _P, _P, _P, _P, _P)
_declare("rms_norm", "base", "ggml_rms_norm", _P, _P, _P, c_float)
_declare("mul", "base", "ggml_mul", _P, _P, _P, _P)
_declare("add", "base", "ggml_add", _P, _P, _P, _P)
_declare("scale", "base", "ggml_scale", _P, _P, _P, c_float)
_declare("mul_mat", "base", "ggml_mul_mat", _P, _P, _P, _P)
_declare("mul_mat_id", "base", "ggml_mul_mat_id", _P, _P, _P, _P, _P)
_declare("prec_set_acc", "base", "ggml_prec_set_acc", c_bool, _P, c_int)
_declare("reshape_2d", "base", "ggml_reshape_2d", _P, _P, _P, c_int64, c_int64)
_declare("reshape_3d", "base", "ggml_reshape_3d", _P, _P, _P, c_int64, c_int64, c_int64)
_declare("reshape_4d", "base", "ggml_reshape_4d", _P, _P, _P, c_int64, c_int64, c_int64, c_int64)
_declare("view_1d", "base", "ggml_view_1d", _P, _P, _P, c_int64, c_size_t)
_declare("view_2d", "base", "ggml_view_2d", _P, _P, _P, c_int64, c_int64, c_size_t, c_size_t)
_declare("view_3d", "base", "ggml_view_3d", _P, _P, _P, c_int64, c_int64, c_int64, c_size_t, c_size_t, c_size_t)
_declare("view_4d", "base", "ggml_view_4d", _P, _P, _P, c_int64, c_int64, c_int64, c_int64, c_size_t, c_size_t, c_size_t, c_size_t)
_declare("permute", "base", "ggml_permute", _P, _P, _P, c_int, c_int, c_int, c_int)
_declare("transpose", "base", "ggml_transpose", _P, _P, _P)
_declare("cont", "base", "ggml_cont", _P, _P, _P)
_declare("cont_2d", "base", "ggml_cont_2d", _P, _P, _P, c_int64, c_int64)
_declare("cpy", "base", "ggml_cpy", _P, _P, _P, _P)
_declare("concat", "base", "ggml_concat", _P, _P, _P, _P, c_int)
_declare("rope_set_offset", "base", "ggml_rope_set_offset", _P, _P, c_int)
_declare("repeat_4d", "base", "ggml_repeat_4d", _P, _P, _P, c_int64, c_int64, c_int64, c_int64)
_declare("rope_ext", "base", "ggml_rope_ext", _P, _P, _P, _P, _P, c_int, c_int, c_int, c_float, c_float, c_float, c_float, c_float, c_float)
_declare("soft_max_ext", "base", "ggml_soft_max_ext", _P, _P, _P, _P, c_float, c_float)
_declare("flash_attn_ext", "base", "ggml_flash_attn_ext", _P, _P, _P, _P, _P, _P, c_float, c_float, c_float)
_declare("swiglu_split", "base", "ggml_swiglu_split", _P, _P, _P, _P)
_declare("silu", "base", "ggml_silu", _P, _P, _P)
_declare("argsort_top_k", "base", "ggml_argsort_top_k", _P, _P, _P, c_int)
_declare("soft_max", "base", "ggml_soft_max", _P, _P, _P)
_declare("sum_rows", "base", "ggml_sum_rows", _P, _P, _P)
_declare("div", "base", "ggml_div", _P, _P, _P, _P)
_declare("sigmoid", "base", "ggml_sigmoid", _P, _P, _P)
_declare("clamp", "base", "ggml_clamp", _P, _P, _P, c_float, c_float)
_declare("fill", "base", "ggml_fill", _P, _P, _P, c_float)

# --- backends and allocation (ggml-backend.h, ggml-alloc.h, ggml-cpu.h) ---
_declare("backend_free", "base", "ggml_backend_free", None, _P)
_declare("backend_graph_compute", "base", "ggml_backend_graph_compute", c_int, _P, _P)
_declare("backend_get_default_buffer_type", "base", "ggml_backend_get_default_buffer_type", _P, _P)
_declare("backend_tensor_set", "base", "ggml_backend_tensor_set", None, _P, c_void_p, c_size_t, c_size_t)
_declare("backend_tensor_get", "base", "ggml_backend_tensor_get", None, _P, c_void_p, c_size_t, c_size_t)
_declare("backend_tensor_alloc", "base", "ggml_backend_tensor_alloc", c_int, _P, _P, c_void_p)
_declare("backend_buffer_free", "base", "ggml_backend_buffer_free", None, _P)
_declare("backend_buffer_get_size", "base", "ggml_backend_buffer_get_size", c_size_t, _P)
_declare("backend_buffer_clear", "base", "ggml_backend_buffer_clear", None, _P, c_uint8)
_declare("backend_alloc_ctx_tensors", "base", "ggml_backend_alloc_ctx_tensors", _P, _P, _P)
_declare("backend_cpu_buffer_from_ptr", "base", "ggml_backend_cpu_buffer_from_ptr", _P, c_void_p, c_size_t)
_declare("backend_cpu_buffer_type", "base", "ggml_backend_cpu_buffer_type", _P)
_declare("gallocr_new", "base", "ggml_gallocr_new", _P, _P)
_declare("gallocr_free", "base", "ggml_gallocr_free", None, _P)
_declare("gallocr_alloc_graph", "base", "ggml_gallocr_alloc_graph", c_bool, _P, _P)
_declare("gallocr_get_buffer_size", "base", "ggml_gallocr_get_buffer_size", c_size_t, _P, c_int)
_declare("backend_cpu_init", "cpu", "ggml_backend_cpu_init", _P)
_declare("backend_cpu_set_n_threads", "cpu", "ggml_backend_cpu_set_n_threads", None, _P, c_int)
# the CPU backend's "extra" buffer types (weights repacked for faster matmuls; kernels.backend)
_declare("backend_cpu_reg", "cpu", "ggml_backend_cpu_reg", _P)
_declare("backend_reg_dev_get", "base", "ggml_backend_reg_dev_get", _P, _P, c_size_t)
_declare("backend_reg_get_proc_address", "base", "ggml_backend_reg_get_proc_address", c_void_p, _P, c_char_p)
DevGetExtraBufts = ctypes.CFUNCTYPE(ctypes.POINTER(c_void_p), c_void_p)  # ggml_backend_dev_get_extra_bufts_t
_declare("backend_buft_name", "base", "ggml_backend_buft_name", c_char_p, _P)
_declare("backend_alloc_ctx_tensors_from_buft", "base", "ggml_backend_alloc_ctx_tensors_from_buft", _P, _P, _P)
_declare("backend_buffer_set_usage", "base", "ggml_backend_buffer_set_usage", None, _P, c_int)
_declare("backend_buft_alloc_buffer", "base", "ggml_backend_buft_alloc_buffer", _P, _P, c_size_t)
_declare("backend_dev_supports_op", "base", "ggml_backend_dev_supports_op", c_bool, _P, _P)
BUFFER_USAGE_WEIGHTS = 1

# --- devices (ggml-backend.h): every backend this build registers, GPUs included ---
_declare("backend_dev_count", "registry", "ggml_backend_dev_count", c_size_t)
_declare("backend_dev_get", "registry", "ggml_backend_dev_get", _P, c_size_t)
_declare("backend_dev_name", "base", "ggml_backend_dev_name", c_char_p, _P)
_declare("backend_dev_description", "base", "ggml_backend_dev_description", c_char_p, _P)
_declare("backend_dev_type", "base", "ggml_backend_dev_type", c_int, _P)
_declare("backend_dev_memory", "base", "ggml_backend_dev_memory", None, _P, ctypes.POINTER(c_size_t),
                           ctypes.POINTER(c_size_t))
_declare("backend_dev_init", "base", "ggml_backend_dev_init", _P, _P, c_char_p)
_declare("backend_supports_op", "base", "ggml_backend_supports_op", c_bool, _P, _P)
_declare("graph_node", "base", "ggml_graph_node", _P, _P, c_int)
_declare("backend_sched_new", "base", "ggml_backend_sched_new", _P, ctypes.POINTER(c_void_p), ctypes.POINTER(c_void_p),
                          c_int, c_size_t, c_bool, c_bool)
_declare("backend_sched_free", "base", "ggml_backend_sched_free", None, _P)
_declare("backend_sched_alloc_graph", "base", "ggml_backend_sched_alloc_graph", c_bool, _P, _P)
_declare("backend_sched_graph_compute", "base", "ggml_backend_sched_graph_compute", c_int, _P, _P)

_declare("op_desc", "base", "ggml_op_desc", c_char_p, _P)
# enum ggml_backend_dev_type
DEVICE_TYPE_CPU, DEVICE_TYPE_GPU, DEVICE_TYPE_IGPU, DEVICE_TYPE_ACCEL, DEVICE_TYPE_META = range(5)

_log = logging.getLogger("ggml")
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)(
    lambda level, text, user: _log.debug("%s", (text or b"").decode(errors="replace").rstrip())
)


def new_context(n_tensors: int, *, graph_nodes: int = 0) -> int:
    """A metadata-only context (no_alloc): tensor data lives in backend buffers, never here."""
    size = _fn("tensor_overhead")() * n_tensors
    if graph_nodes:
        size += _fn("graph_overhead_custom")(graph_nodes, False)
    ctx = _fn("init")(InitParams(size, None, True))
    if not ctx:
        raise MemoryError("ggml_init failed")
    return ctx


# --- copies checked in Python (a GGML_ASSERT is abort(), not an exception) ---

def copy_in(tensor: int, array) -> None:
    """Copy a C-contiguous numpy array into ``tensor`` from its first byte; TensorBoundsError if
    the bytes do not fit (ggml_backend_tensor_set would abort the process on a GGML_ASSERT)."""
    _check_fits(tensor, array, "into")
    _fn("backend_tensor_set")(tensor, array.ctypes.data, 0, array.nbytes)


def copy_out(tensor: int, array) -> None:
    """Fill a C-contiguous numpy array from ``tensor``'s first bytes; TensorBoundsError if the
    tensor holds fewer (ggml_backend_tensor_get would abort the process on a GGML_ASSERT)."""
    _check_fits(tensor, array, "out of")
    _fn("backend_tensor_get")(tensor, array.ctypes.data, 0, array.nbytes)


def _check_fits(tensor: int, array, direction: str) -> None:
    size = _fn("nbytes")(tensor)
    if not array.flags.c_contiguous or array.nbytes > size:
        raise TensorBoundsError(f"a copy of {array.nbytes} bytes {direction} a tensor of {size} "
                                f"(shape {list(tensor_shape(tensor))}) does not fit")
