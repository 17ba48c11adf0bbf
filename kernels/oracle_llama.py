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

import functools
import os
from typing import Any

from .tokenizer import _quiet_llama_logs


@functools.cache
def _plain_llama_class() -> type:
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
            self._plain_model_params = params

    return PlainBufferLlama


def load_llama(path: str | os.PathLike[str], *, repack: bool = False, **kwargs: Any):
    """A ``llama_cpp.Llama`` over the GGUF at ``path``; ``kwargs`` go to ``Llama``.

    ``repack=False`` (the oracle's way): plain weight buffers, as our engine uses.
    ``repack=True``: llama.cpp's default, repacked extra buffer types where the CPU has them."""
    _quiet_llama_logs()
    kwargs.setdefault("verbose", False)
    if repack:
        from llama_cpp import Llama

        llm = Llama(os.fspath(path), **kwargs)
    else:
        llm = _plain_llama_class()(os.fspath(path), **kwargs)
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
