"""One record per architecture: its RoPE kind, its tensors and its attention and FFN builders.

    record.py  Architecture, Block, LayerTensor, ModelTensor: what a record holds
    llama.py   llama (and llama-MoE): the tensors and builders the others reuse
    qwen.py    qwen2, qwen3, qwen3moe
    deepseek2.py  DeepSeek-V2/V3 and Kimi K2: latent attention, dense leading layers, shared experts

The spec (kernels.spec), the weight loader (kernels.weights) and the graph builder
(kernels.graph) all read the record; none of them branches on the architecture's name. Adding an
architecture means a record here, its builders if llama's do not fit, and a tiny test model
(harness/tiny_models.py) that the oracle tests run.
"""

from __future__ import annotations

from ..errors import UnsupportedModelError
from .deepseek2 import DEEPSEEK2
from .llama import LLAMA
from .qwen import QWEN2, QWEN3, QWEN3MOE
from .record import Architecture, Block, LayerTensor, ModelTensor

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (LLAMA, QWEN2, QWEN3, QWEN3MOE, DEEPSEEK2)}

__all__ = ["ARCHITECTURES", "Architecture", "Block", "LayerTensor", "ModelTensor", "architecture_for"]


def architecture_for(name: str) -> Architecture:
    """The record of ``general.architecture`` = ``name``, or UnsupportedModelError (one line)."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        supported = ", ".join(ARCHITECTURES)
        raise UnsupportedModelError(f"architecture '{name}' is not supported (supported: {supported})")
    return arch
