"""A short micro-benchmark a node runs when it joins: milliseconds per layer per decode token, on
one real layer of the model it will serve (so the figure reflects this model's layer shape and
quantization on this machine)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from .gguf_file import GGUFFile
from .slice import SliceEngine
from .spec import ModelSpec, SliceSpec


def measure_ms_per_layer(gguf: GGUFFile, *, n_threads: int | None = None, layer: int | None = None,
                         steps: int = 12) -> float:
    """Median time of one-token decode steps through a single layer (after a short prefill)."""
    spec = ModelSpec.from_gguf(gguf)
    present = [i for i in range(spec.n_layer) if spec.layer_bytes[i] > 0]
    if not present:
        raise ValueError("the model file holds no layers to measure")
    il = layer if layer is not None else present[len(present) // 2]
    rng = np.random.default_rng(0)
    with SliceEngine(gguf, SliceSpec(il, il + 1), n_threads=n_threads, max_context=256) as engine:
        rid = b"speed-probe-0000"
        engine.forward(rid, start_pos=0, hidden=rng.standard_normal((16, spec.n_embd)).astype(np.float32))
        times = []
        x = rng.standard_normal((1, spec.n_embd)).astype(np.float32)
        for pos in range(16, 16 + 4 + steps):  # the first steps fault the weights in and build the graph
            t0 = time.perf_counter()
            engine.forward(rid, start_pos=pos, hidden=x)
            if pos >= 20:
                times.append(time.perf_counter() - t0)
        engine.release(rid)
    return statistics.median(times) * 1e3
