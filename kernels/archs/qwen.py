"""The Qwen family: llama's blocks with NEOX RoPE, and each variant's own tensors.

    qwen2     Q/K/V biases (always present)
    qwen3     a per-head RMSNorm on Q and K before RoPE: llama's attention reads them when present
    qwen3moe  qwen3 with mixture-of-experts FFNs in every layer
"""

from __future__ import annotations

from .. import ggml
from .llama import ATTENTION, ATTENTION_TENSORS, DENSE_FFN, MODEL_TENSORS, MOE_FFN
from .record import Architecture, Block, LayerTensor, with_required

QWEN2_ATTENTION = Block(ATTENTION.build, with_required(ATTENTION_TENSORS, "bq", "bk", "bv"))
QWEN3_ATTENTION = Block(ATTENTION.build, ATTENTION_TENSORS + (
    LayerTensor("q_norm", "attn_q_norm.weight", ("head_dim",)),
    LayerTensor("k_norm", "attn_k_norm.weight", ("head_dim",)),
))

QWEN2 = Architecture("qwen2", ggml.ROPE_TYPE_NEOX, QWEN2_ATTENTION, DENSE_FFN, None, MODEL_TENSORS)
QWEN3 = Architecture("qwen3", ggml.ROPE_TYPE_NEOX, QWEN3_ATTENTION, DENSE_FFN, None, MODEL_TENSORS)
QWEN3MOE = Architecture("qwen3moe", ggml.ROPE_TYPE_NEOX, QWEN3_ATTENTION, None, MOE_FFN, MODEL_TENSORS)
