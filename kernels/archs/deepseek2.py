"""deepseek2: DeepSeek-V2/V3, Kimi K2, DeepSeek-V2-Lite, Moonlight and their kin.

Two halves unlike llama's, following llama.cpp's ``llm_build_deepseek2`` (src/models/deepseek2.cpp)
step for step, with MLA's absorption optimisation (the GGUF's split ``attn_k_b`` / ``attn_v_b``):

- latent attention: Q through a low rank (``attn_q_a`` → norm → ``attn_q_b``) or one ``attn_q``;
  K and V through one compressed latent (``attn_kv_a_mqa`` → norm) plus a decoupled RoPE part.
  ``attn_k_b`` is absorbed into Q, so every head attends the same cached latent (MQA with one KV
  head of kv_rank + n_rot values), and ``attn_v_b`` turns each head's attended latent into its
  values. The KV cache holds the latent and the RoPE part only (kernels.kv_cache, no V).
- FFN: the first ``leading_dense_block_count`` layers dense, the rest a mixture of experts with
  softmax or sigmoid gating, an optional routing bias (``exp_probs_b``), group-limited top-k,
  optional weight normalisation and scale, plus shared experts every token runs through.

An older conversion with the unsplit ``attn_kv_b`` (no ``attention.key_length_mla``) runs as
llama.cpp runs it: the latent is decompressed into full heads of K and V, which the cache holds
(``n_head`` × (k_head + v_head) values per token instead of kv_rank + n_rot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from .. import ggml
from ..cmath import f32, logf, sqrtf
from ..errors import UnsupportedModelError
from .llama import DENSE_FFN, MODEL_TENSORS, MOE_FFN_TENSORS, moe_ffn
from .record import Architecture, Block, LayerTensor

if TYPE_CHECKING:
    from ..graph import GraphBuilder
    from ..spec import ModelSpec
    from ..weights import LayerWeights


def _has_q_rank(spec: ModelSpec) -> bool:
    return bool(spec.mla and spec.mla.q_rank)


def _no_q_rank(spec: ModelSpec) -> bool:
    return not _has_q_rank(spec)


def _absorbed(spec: ModelSpec) -> bool:
    return bool(spec.mla and spec.mla.absorbed)


def _unsplit(spec: ModelSpec) -> bool:
    return bool(spec.mla and not spec.mla.absorbed)


LATENT_ATTENTION_TENSORS = (
    LayerTensor("attn_norm", "attn_norm.weight", ("n_embd",)),
    LayerTensor("wq", "attn_q.weight", ("n_embd", "n_embd_q_mla"), required=False, required_if=_no_q_rank,
                matmul_only=True),
    LayerTensor("wq_a", "attn_q_a.weight", ("n_embd", "q_rank"), required=False, required_if=_has_q_rank,
                matmul_only=True),
    LayerTensor("q_a_norm", "attn_q_a_norm.weight", ("q_rank",), required=False, required_if=_has_q_rank),
    LayerTensor("wq_b", "attn_q_b.weight", ("q_rank", "n_embd_q_mla"), required=False, required_if=_has_q_rank,
                matmul_only=True),
    LayerTensor("wkv_a_mqa", "attn_kv_a_mqa.weight", ("n_embd", "kv_a"), matmul_only=True),
    LayerTensor("kv_a_norm", "attn_kv_a_norm.weight", ("kv_rank",)),
    LayerTensor("wk_b", "attn_k_b.weight", ("qk_nope", "kv_rank", "n_head"), required=False, required_if=_absorbed),
    LayerTensor("wv_b", "attn_v_b.weight", ("kv_rank", "v_head", "n_head"), required=False, required_if=_absorbed),
    LayerTensor("wkv_b", "attn_kv_b.weight", ("kv_rank", "n_embd_kv_b"), required=False, required_if=_unsplit,
                matmul_only=True),
    LayerTensor("wo", "attn_output.weight", ("n_embd_v_mla", "n_embd"), matmul_only=True),
)
SHARED_EXPERT_TENSORS = (
    LayerTensor("ffn_exp_probs_b", "exp_probs_b.bias", ("n_expert",), required=False),
    LayerTensor("ffn_gate_shexp", "ffn_gate_shexp.weight", ("n_embd", "n_ff_shexp"), matmul_only=True),
    LayerTensor("ffn_up_shexp", "ffn_up_shexp.weight", ("n_embd", "n_ff_shexp"), matmul_only=True),
    LayerTensor("ffn_down_shexp", "ffn_down_shexp.weight", ("n_ff_shexp", "n_embd"), matmul_only=True),
)


def latent_attention(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> int:
    """Multi-head latent attention on the normed input, as llama.cpp builds it with MLA."""
    s, ctx, m, n = b.spec, b.ctx, b.spec.mla, b.n_tokens
    if w.wq_a is not None:
        q = b.name(ggml.mul_mat(ctx, w.wq_a, x), "q", il)
        q = b.norm(q, w.q_a_norm, "q", il)
        q = b.name(ggml.mul_mat(ctx, w.wq_b, q), "q", il)
    else:
        q = b.name(ggml.mul_mat(ctx, w.wq, x), "q", il)
    q = b.name(ggml.reshape_3d(ctx, q, m.k_head, s.n_head, n), "q", il)  # [k_head, n_head, n]

    kv_cmpr_pe = b.name(ggml.mul_mat(ctx, w.wkv_a_mqa, x), "kv_cmpr_pe", il)  # [kv_rank + n_rot, n]
    row = ggml.tensor_strides(kv_cmpr_pe)[1]
    kv_cmpr = b.name(ggml.view_2d(ctx, kv_cmpr_pe, m.kv_rank, n, row, 0), "kv_cmpr", il)
    k_pe = ggml.view_3d(ctx, kv_cmpr_pe, m.n_rot, 1, n, row, row, ggml.row_size(ggml.TYPE_F32, m.kv_rank))
    k_pe = b.rope(k_pe, "k_pe", il)  # [n_rot, 1, n]
    kv_cmpr = b.norm(kv_cmpr, w.kv_a_norm, "kv_cmpr", il)
    if not m.absorbed:
        return _unsplit_attention(b, w, q, kv_cmpr, k_pe, il)

    nb = ggml.tensor_strides(q)
    q_nope = b.name(ggml.view_3d(ctx, q, m.qk_nope, s.n_head, n, nb[1], nb[2], 0), "q_nope", il)
    q_pe = ggml.view_3d(ctx, q, m.n_rot, s.n_head, n, nb[1], nb[2], ggml.row_size(ggml.TYPE_F32, m.qk_nope))
    q_pe = b.rope(q_pe, "q_pe", il)  # [n_rot, n_head, n]
    q_nope = ggml.permute(ctx, q_nope, 0, 2, 1, 3)  # [qk_nope, n, n_head]
    q_absorbed = b.name(ggml.mul_mat(ctx, w.wk_b, q_nope), "q_nope_absorbed", il)  # [kv_rank, n, n_head]
    q_absorbed = ggml.permute(ctx, q_absorbed, 0, 2, 1, 3)  # [kv_rank, n_head, n]

    q_cur = b.name(ggml.concat(ctx, q_absorbed, q_pe, 0), "Qcur", il)  # [kv_rank + n_rot, n_head, n]
    kv_cmpr = b.name(ggml.reshape_3d(ctx, kv_cmpr, m.kv_rank, 1, n), "kv_cmpr_reshape", il)
    k_cur = b.name(ggml.concat(ctx, kv_cmpr, k_pe, 0), "Kcur", il)  # [kv_rank + n_rot, 1, n]: the cached row
    return b.name(b.attention(w, q_cur, k_cur, kv_cmpr, il, v_mla=w.wv_b), "attn_out", il)


def _unsplit_attention(b: GraphBuilder, w: LayerWeights, q: int, kv_cmpr: int, k_pe: int, il: int) -> int:
    """An older conversion's attn_kv_b: decompress the latent into each head's K (no-RoPE part)
    and V, share the RoPE part across heads, and attend as ordinary multi-head attention."""
    s, ctx, m, n = b.spec, b.ctx, b.spec.mla, b.n_tokens
    kv = b.name(ggml.mul_mat(ctx, w.wkv_b, kv_cmpr), "kv", il)  # [n_head * (qk_nope + v_head), n]
    row = ggml.row_size(ggml.TYPE_F32, m.qk_nope + m.v_head)
    k_nope = b.name(ggml.view_3d(ctx, kv, m.qk_nope, s.n_head, n, row, row * s.n_head, 0), "k_nope_view", il)
    v = ggml.view_3d(ctx, kv, m.v_head, s.n_head, n, row, row * s.n_head, ggml.row_size(ggml.TYPE_F32, m.qk_nope))
    v = b.name(ggml.cont(ctx, v), "Vcur_cont", il)
    q_cur = b.rope(q, "Qcur", il)
    q_cur = ggml.rope_set_offset(q_cur, m.qk_nope)  # RoPE on each head's trailing n_rot values only
    k_cur = ggml.concat(ctx, k_nope, ggml.repeat_4d(ctx, k_pe, m.n_rot, s.n_head, n, 1), 0)
    k_cur = b.name(k_cur, "Kcur", il)  # [k_head, n_head, n]
    return b.name(b.attention(w, q_cur, k_cur, v, il), "attn_out", il)


def shared_expert_moe_ffn(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> int:
    """The routed experts (llama's mixture, with this model's gating) plus the shared experts."""
    moe_out = moe_ffn(b, w, x, il)
    return b.name(ggml.add(b.ctx, moe_out, b.shared_experts(w, x, il)), "ffn_out", il)


def read_hparams(key: Callable, spec: ModelSpec) -> dict:
    """deepseek2's own metadata: latent attention's ranks and head widths, dense leading layers,
    shared experts and gating, and the attention scale llama.cpp derives with YaRN."""
    from ..spec import GATING_SIGMOID, GATING_SOFTMAX, LatentAttention

    k_head, v_head = int(key("attention.key_length_mla", 0) or 0), int(key("attention.value_length_mla", 0) or 0)
    q_rank, kv_rank = int(key("attention.q_lora_rank", 0) or 0), int(key("attention.kv_lora_rank", 0) or 0)
    if k_head and v_head:  # split attn_k_b / attn_v_b: one latent "head" of kv_rank + n_rot values is cached
        mla = LatentAttention(q_rank, kv_rank, k_head, v_head, spec.rope.n_dims)
        heads_ok = spec.n_head_kv == 1 and spec.head_dim == kv_rank + mla.n_rot
    else:  # an unsplit attn_kv_b: full heads are cached
        mla = LatentAttention(q_rank, kv_rank, spec.head_dim, spec.head_dim_v, spec.rope.n_dims, absorbed=False)
        heads_ok = spec.n_head_kv == spec.n_head
    if not (heads_ok and kv_rank > 0 and 0 < mla.n_rot < mla.k_head):
        raise UnsupportedModelError(
            f"deepseek2 attention of {spec.n_head_kv} KV heads of {spec.head_dim} values does not fit kv_lora_rank "
            f"{kv_rank} with {mla.n_rot} rope dimensions and keys of {mla.k_head}")
    gating = int(key("expert_gating_func", 0) or GATING_SOFTMAX)
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise UnsupportedModelError(f"expert gating function {gating} is not supported (1 softmax, 2 sigmoid)")
    # llama.cpp pre-scales the attention scale for YaRN (deepseek2.cpp, TAG_DEEPSEEK2_YARN_LOG_MUL_FIX).
    log_mul = f32(float(key("rope.scaling.yarn_log_multiplier", 0.0) or 0.0)) / f32(0.1)
    inv_scale = f32(1.0) / f32(spec.rope.freq_scale)
    attn_factor_org = f32(spec.rope.attn_factor) * (f32(1.0) + f32(0.1) * logf(inv_scale))
    mscale = attn_factor_org * (f32(1.0) + f32(0.1) * log_mul * logf(inv_scale))
    return dict(
        mla=mla,
        attention_scale=float(f32(1.0) * mscale * mscale / sqrtf(f32(mla.k_head))),
        n_layer_dense_lead=int(key("leading_dense_block_count", 0) or 0),
        n_expert_shared=int(key("expert_shared_count", 0) or 0),
        expert_gating=gating,
        expert_weights_norm=bool(key("expert_weights_norm", False)),
    )


LATENT_ATTENTION = Block(latent_attention, LATENT_ATTENTION_TENSORS)
SHARED_EXPERT_MOE_FFN = Block(shared_expert_moe_ffn, MOE_FFN_TENSORS + SHARED_EXPERT_TENSORS)

DEEPSEEK2 = Architecture("deepseek2", ggml.ROPE_TYPE_NORM, LATENT_ATTENTION, DENSE_FFN, SHARED_EXPERT_MOE_FFN,
                         MODEL_TENSORS, read_hparams=read_hparams, yarn_log_multiplier=True)
