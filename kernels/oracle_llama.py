"""llama-cpp-python loaded the way the tests' oracle and the benchmarks' baselines need it.

By default llama.cpp places the weights its CPU backend can repack (Q4_0, Q4_K, IQ4_NL, ... on
AVX2 / NEON machines) in an "extra" buffer type: ``CPU_REPACK``, or ``AMX`` on Intel CPUs with
AMX, whose matmul faults with SIGILL on some of them while processing a prompt. Our engine
computes on plain buffers, so the oracle does too (``llama_model_params.use_extra_bufts =
False``): it compares like with like, and it runs on every CPU. ``repack=True`` keeps
llama.cpp's default, for benchmarks that report what a llama.cpp user sees (run those in a
subprocess: on an AMX CPU they can die).

This is the one place that builds a full (non vocab-only) ``Llama``.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

from .tokenizer import _quiet_llama_logs


class _BufferTypeOverride(ctypes.Structure):
    """llama.cpp's ``struct llama_model_tensor_buft_override`` (llama-cpp-python declares the
    model parameters' pointer to a list of them, not the struct)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_overrides(pattern: str) -> ctypes.Array:
    """A NULL-terminated list that keeps tensors whose names match ``pattern`` (a regex) in CPU
    memory: llama.cpp's ``--override-tensor PATTERN=CPU``."""
    from . import ggml

    overrides = (_BufferTypeOverride * 2)()
    overrides[0].pattern = pattern.encode()
    overrides[0].buft = ggml.backend_cpu_buffer_type()
    return overrides


@functools.cache
def _plain_llama_class(keep_on_cpu: str | None = None) -> type:
    from llama_cpp import Llama

    class PlainBufferLlama(Llama):
        """``Llama`` whose model loads without llama.cpp's extra (repacked) buffer types.

        llama-cpp-python 0.3.36 has no argument for it: ``Llama(..., use_extra_bufts=False)``
        lands in ``**kwargs`` and is ignored. ``__init__`` builds ``self.model_params`` from
        ``llama_model_default_params()`` and loads the model from it in the same call, so the
        flag is set as that attribute is assigned, before the load."""

        @property
        def model_params(self):
            return self._plain_model_params

        @model_params.setter
        def model_params(self, params) -> None:
            params.use_extra_bufts = False
            if keep_on_cpu is not None:  # (kept on the instance: llama.cpp reads it while it loads)
                self._buffer_type_overrides = _cpu_overrides(keep_on_cpu)
                params.tensor_buft_overrides = ctypes.addressof(self._buffer_type_overrides)
            self._plain_model_params = params

    return PlainBufferLlama


def load_llama(path: str | os.PathLike[str], *, repack: bool = False, keep_on_cpu: str | None = None, **kwargs: Any):
    """A ``llama_cpp.Llama`` over the GGUF at ``path``; ``kwargs`` go to ``Llama``.

    ``repack=False`` (the oracle's way): plain weight buffers, as our engine uses.
    ``repack=True``: llama.cpp's default, repacked extra buffer types where the CPU has them.
    ``keep_on_cpu``: tensors whose names match this regex stay in CPU memory however many layers
    go to a device, as ``llama-cli --override-tensor PATTERN=CPU`` (e.g. ``"_exps"``: the routed
    experts, as a split member keeps them: kernels/device_split.py)."""
    _quiet_llama_logs()
    kwargs.setdefault("verbose", False)
    if repack:
        from llama_cpp import Llama

        if keep_on_cpu is not None:
            raise ValueError("keep_on_cpu is for plain buffers (repack=False)")

        llm = Llama(os.fspath(path), **kwargs)
    else:
        llm = _plain_llama_class(keep_on_cpu)(os.fspath(path), **kwargs)
    if bool(llm.model_params.use_extra_bufts) != repack:
        llm.close()
        raise RuntimeError(f"llama-cpp-python loaded with use_extra_bufts={llm.model_params.use_extra_bufts}, "
                           f"expected {repack}")
    return llm


def last_logits(llm):
    """The logits of the last position ``llm.eval`` computed, as a numpy view (no copy).

    With ``logits_all=False`` llama-cpp-python 0.3.36's ``eval`` no longer copies logits into
    ``llm.scores`` (that array stays zero, with ``n_batch`` rows), so read llama.cpp's own."""
    import numpy as np
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    if not ptr:
        raise RuntimeError("llama.cpp has no logits for the last position")
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))
