"""llama (SmolLM2, Llama 2/3, Mistral) and, with experts, Mixtral-style llama-MoE.

Its tensors and its two builders, which the Qwen family reuses (kernels.archs.qwen). The builders
follow llama.cpp's ``llm_build_llama`` step for step and name each intermediate tensor as it does
(``Qcur-3``, ``attn_out-3``, ``ffn_moe_out-3``), from the shared helpers in kernels.graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import ggml
from .record import Architecture, Block, LayerTensor, ModelTensor

if TYPE_CHECKING:
    from ..graph import GraphBuilder
    from ..weights import LayerWeights

ATTENTION_TENSORS = (
    LayerTensor("attn_norm", "attn_norm.weight", ("n_embd",)),
    LayerTensor("wq", "attn_q.weight", ("n_embd", "n_embd_q"), matmul_only=True),
    LayerTensor("wk", "attn_k.weight", ("n_embd", "n_embd_kv"), matmul_only=True),
    LayerTensor("wv", "attn_v.weight", ("n_embd", "n_embd_kv"), matmul_only=True),
    LayerTensor("wo", "attn_output.weight", ("n_embd_q", "n_embd"), matmul_only=True),
    LayerTensor("bq", "attn_q.bias", ("n_embd_q",), required=False),
    LayerTensor("bk", "attn_k.bias", ("n_embd_kv",), required=False),
    LayerTensor("bv", "attn_v.bias", ("n_embd_kv",), required=False),
    LayerTensor("bo", "attn_output.bias", ("n_embd",), required=False),
)
DENSE_FFN_TENSORS = (
    LayerTensor("ffn_norm", "ffn_norm.weight", ("n_embd",)),
    LayerTensor("ffn_gate", "ffn_gate.weight", ("n_embd", "n_ff"), matmul_only=True),
    LayerTensor("ffn_up", "ffn_up.weight", ("n_embd", "n_ff"), matmul_only=True),
    LayerTensor("ffn_down", "ffn_down.weight", ("n_ff", "n_embd"), matmul_only=True),
)
MOE_FFN_TENSORS = (
    LayerTensor("ffn_norm", "ffn_norm.weight", ("n_embd",)),
    LayerTensor("ffn_gate_inp", "ffn_gate_inp.weight", ("n_embd", "n_expert")),  # the router
    LayerTensor("ffn_gate_exps", "ffn_gate_exps.weight", ("n_embd", "n_ff", "n_expert"), expert=True),
    LayerTensor("ffn_up_exps", "ffn_up_exps.weight", ("n_embd", "n_ff", "n_expert"), expert=True),
    LayerTensor("ffn_down_exps", "ffn_down_exps.weight", ("n_ff", "n_embd", "n_expert"), expert=True),
)
MODEL_TENSORS = (
    ModelTensor("rope_freqs", "rope_freqs.weight", "layers", required=False),  # llama 3's long-context factors
    ModelTensor("tok_embd", "token_embd.weight", "embedding"),
    ModelTensor("output_norm", "output_norm.weight", "lm_head"),
    ModelTensor("output", "output.weight", "lm_head", fallback="token_embd.weight", matmul_only=True),
    ModelTensor("output_b", "output.bias", "lm_head", required=False),
)


def llama_attention(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> int:
    """Self-attention on the normed input: Q/K/V (with biases where the layer has them), RoPE,
    attention over the request's KV cache, output projection. A layer with Q/K norm tensors
    (qwen3) RMS-normalises each head of Q and of K before RoPE."""
    q, k, v = b.qkv(w, x, il)
    if w.q_norm is not None:
        q = b.norm(q, w.q_norm, "Qcur_normed", il)
    q = b.rope(q, "Qcur", il)
    if w.k_norm is not None:
        k = b.norm(k, w.k_norm, "Kcur_normed", il)
    k = b.rope(k, "Kcur", il)
    return b.name(b.attention(w, q, k, v, il), "attn_out", il)


def swiglu_ffn(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> int:
    """down(silu(gate(x)) * up(x)) (llama.cpp's build_ffn with LLM_FFN_SILU, LLM_FFN_PAR)."""
    return b.swiglu(w.ffn_gate, w.ffn_up, w.ffn_down, x, il)


def moe_ffn(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> int:
    """Mixture of experts (llama.cpp's build_moe_ffn with softmax gating and normalised weights):
    the router picks the top-k experts per token, each runs its SwiGLU FFN, and their outputs are
    added with the router's weights."""
    n = ggml.tensor_shape(x)[1]  # rows: fewer than the batch's tokens after the last layer's row selection
    selected, weights = b.route(w, x, il)
    experts = b.experts(w, ggml.reshape_3d(b.ctx, x, b.spec.n_embd, 1, n), selected, il)  # [n_embd, k, n]
    return b.combine_experts(experts, weights, n, il)


ATTENTION = Block(llama_attention, ATTENTION_TENSORS)
DENSE_FFN = Block(swiglu_ffn, DENSE_FFN_TENSORS)
MOE_FFN = Block(moe_ffn, MOE_FFN_TENSORS)

LLAMA = Architecture("llama", ggml.ROPE_TYPE_NORM, ATTENTION, DENSE_FFN, MOE_FFN, MODEL_TENSORS)
