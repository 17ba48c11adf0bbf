"""Forward graphs of a slice, built from ggml operators, for one request or a batch of them.

Reads like llama.cpp's ``llm_build_llama``: inputs → layer loop (norm, Q/K/V, RoPE, attention,
residual, norm, FFN, residual) → output norm → LM head, with every intermediate tensor named the
way llama.cpp names it (``attn_norm-3``, ``Qcur-3``, ``ffn_inp-3``, ``l_out-3``, ``result_norm``),
so a slice's tensors can be compared with a whole-model llama.cpp run by name. The layer loop is
the same for every architecture; its attention and FFN come from the architecture's record
(kernels.archs), built from the helpers here.

The operator sequence deliberately mirrors llama.cpp's graph (F16 KV cache; without flash
attention a transposed V, F32-accumulated KQ, fused soft_max_ext; with it ggml_flash_attn_ext at
F32 precision over an untransposed V and an F16 mask; swiglu_split): the same kernels on the same
data give the same bits, which keeps greedy tokens equal to the oracle's.

A batch stacks the requests' tokens as columns: norms, projections and the FFN run once over all
of them (shared matmuls); attention runs per request, against that request's own KV cache with
its own mask and padded length, exactly as it would alone; the per-request results are
concatenated back before the output projection. A batch of one is the single-request graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import ggml
from .graph_bind import KVViews
from .kv_cache import KVCache
from .spec import GATING_SIGMOID, ModelSpec, SliceSpec
from .weights import LayerWeights, SliceWeights


@dataclass(frozen=True, order=True)
class RequestShape:
    """What one request contributes to a graph's shape."""

    n_tokens: int
    n_kv: int  # cells attended (padded like llama.cpp's n_kv); 0 for a slice without layers
    n_outputs: int  # rows kept after the model's last layer
    kv_generation: int  # the cache tensors it reads and writes (0 where the graph is rebound to them)
    rowwise: bool = False  # attention one row at a time (a speculative check: GraphBuilder._attend)
    kv_cells: int = 0  # the cache's capacity: its tensors' strides, which the graph's views use


@dataclass(frozen=True)
class GraphShape:
    """Everything a built graph depends on besides input data; equal shapes → reuse the graph."""

    requests: tuple[RequestShape, ...]
    # each member's KV cache is wired into the graph; empty where the engine rebinds a kept graph
    # to whichever caches the batch has (kernels.graph_bind)
    request_ids: tuple[bytes, ...]
    hidden: bool = False  # also output every row's final hidden state (``extra_outputs["hidden"]``)
    flash: bool = False  # attention by ggml_flash_attn_ext (caches laid out for it: KVCache v_trans False)

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.requests)

    @property
    def n_outputs(self) -> int:
        return sum(r.n_outputs for r in self.requests)

    @property
    def attention_units(self) -> int:
        """Separate attention computations per layer: one per request, one per row when rowwise."""
        return sum(r.n_tokens if r.rowwise else 1 for r in self.requests)


@dataclass
class AttentionInputs:
    """One request's attention placeholders (llama.cpp's llm_graph_input_attn_kv)."""

    kq_mask: int  # F32 [n_kv, n_tokens] (F16 under flash): 0 where a token may attend a cell, -inf elsewhere
    k_idxs: int  # I64 [n_tokens]: cell each token's K (and, under flash, V) is written to
    v_idxs: int | None  # I64 [n_tokens * v_width]: element of the transposed V each value goes to
    # (None: a cache without V, latent attention; or V untransposed, flash, written with k_idxs)


@dataclass
class GraphInputs:
    """Placeholders filled just before compute (llama.cpp's llm_graph_input_*)."""

    pos: int | None  # I32 [N]: absolute position of each token (all requests, stacked)
    attention: list[AttentionInputs] = field(default_factory=list)  # one per request
    tokens: int | None = None  # I32 [N] (slices with the embedding)
    embd: int | None = None  # F32 [n_embd, N] (slices fed by activations)
    out_ids: int | None = None  # I32 [n_outputs]: rows kept after the model's last layer (LM head slices only)


class SliceGraph:
    """A built graph with its ggml context. Free with ``close()``."""

    def __init__(self, ctx: int, graph: int, inputs: GraphInputs, output: int, shape: GraphShape,
                 extra_outputs: dict[str, int] | None = None) -> None:
        self.ctx = ctx
        self.graph = graph
        self.inputs = inputs
        self.output = output  # F32 [n_embd or n_vocab, rows]
        self.shape = shape
        self.extra_outputs = extra_outputs or {}  # a router segment: ffn_in, selected, weights
        self.kv_views: KVViews | None = None  # its views of the requests' caches (to rebind it)

    def close(self) -> None:
        if self.ctx:
            ggml.free(self.ctx)
            self.ctx = 0


class GraphBuilder:
    """Shared helpers for the architecture builders; each names the tensors it makes."""

    def __init__(self, spec: ModelSpec, ctx: int, graph: int, caches: list[KVCache | None], shape: GraphShape,
                 inputs: GraphInputs) -> None:
        self.spec = spec
        self.ctx = ctx
        self.graph = graph
        self.caches = caches
        self.shape = shape
        self.n_tokens = shape.n_tokens
        self.inputs = inputs
        self.rope_freqs: int | None = None  # llama 3's long-context factors, when the model has them
        starts = [0]
        for r in shape.requests:
            starts.append(starts[-1] + r.n_tokens)
        self.row_starts = starts  # request m owns stacked rows [starts[m], starts[m + 1])
        self.kv_views = KVViews(caches)  # every view of a cache made below is recorded in it

    @classmethod
    def new(cls, spec: ModelSpec, slice_spec: SliceSpec, weights: SliceWeights, caches: list[KVCache | None],
            shape: GraphShape, size: int) -> "GraphBuilder":
        """A fresh ggml context and graph of ``size`` nodes, with the inputs ``slice_spec`` takes."""
        ctx = ggml.new_context(size + 16, graph_nodes=size)
        graph = ggml.new_graph_custom(ctx, size, False)
        builder = cls(spec, ctx, graph, caches, shape, _new_inputs(ctx, spec, slice_spec, shape))
        builder.rope_freqs = weights.rope_freqs
        return builder

    def finish(self, output: int, extra_outputs: dict[str, int] | None = None) -> SliceGraph:
        graph = SliceGraph(self.ctx, self.graph, self.inputs, output, self.shape, extra_outputs)
        graph.kv_views = self.kv_views
        return graph

    def name(self, tensor: int, label: str, il: int = -1) -> int:
        ggml.set_name(tensor, (f"{label}-{il}" if il >= 0 else label).encode())
        return tensor

    def norm(self, x: int, weight: int, label: str, il: int) -> int:
        """RMSNorm, then the learned scale (llama.cpp's build_norm with LLM_NORM_RMS)."""
        return self.name(ggml.mul(self.ctx, ggml.rms_norm(self.ctx, x, self.spec.norm_eps), weight), label, il)

    def linear(self, weight: int, x: int, bias: int | None = None) -> int:
        y = ggml.mul_mat(self.ctx, weight, x)
        return ggml.add(self.ctx, y, bias) if bias is not None else y

    def qkv(self, w: LayerWeights, x: int, il: int) -> tuple[int, int, int]:
        """Projections, biases where present, reshaped to [head_dim, heads, N]."""
        s = self.spec
        q = ggml.reshape_3d(self.ctx, self.linear(w.wq, x, w.bq), s.head_dim, s.n_head, self.n_tokens)
        k = ggml.reshape_3d(self.ctx, self.linear(w.wk, x, w.bk), s.head_dim, s.n_head_kv, self.n_tokens)
        v = ggml.reshape_3d(self.ctx, self.linear(w.wv, x, w.bv), s.head_dim, s.n_head_kv, self.n_tokens)
        return self.name(q, "Qcur", il), self.name(k, "Kcur", il), self.name(v, "Vcur", il)

    def rope(self, x: int, label: str, il: int) -> int:
        r = self.spec.rope
        y = ggml.rope_ext(self.ctx, x, self.inputs.pos, self.rope_freqs, r.n_dims, r.mode, r.n_ctx_orig,
                          r.freq_base, r.freq_scale, r.ext_factor, r.attn_factor, r.beta_fast, r.beta_slow)
        return self.name(y, label, il)

    def attention(self, w: LayerWeights, q: int, k: int, v: int, il: int, v_mla: int | None = None) -> int:
        """Per request: store its K/V in its cache, attend over its cells. Then project out.
        ``v_mla`` (latent attention): the per-head matrices that turn attended latents into values."""
        outs = []
        for m, (cache, inp) in enumerate(zip(self.caches, self.inputs.attention)):
            q_m, k_m, v_m = (self._rows(t, m) for t in (q, k, v))
            self._store_kv(cache, inp, k_m, v_m, il)
            if self.shape.requests[m].rowwise:
                outs.append(_concat_rows(self.ctx, [
                    self._attend(cache, inp, self._row_range(q_m, j, j + 1), il, v_m, v_mla, row=j)
                    for j in range(ggml.tensor_shape(q_m)[2])]))
            else:
                outs.append(self._attend(cache, inp, q_m, il, v_m, v_mla))
        cur = _concat_rows(self.ctx, outs)
        self.name(cur, "kqv_out", il)
        return self.linear(w.wo, cur, w.bo)

    def _rows(self, t: int, m: int) -> int:
        """Request m's slice [head_dim, heads, n_m] of a stacked [head_dim, heads, N] tensor."""
        if len(self.caches) == 1:
            return t
        return self._row_range(t, self.row_starts[m], self.row_starts[m + 1])

    def _row_range(self, t: int, a: int, b: int) -> int:
        """Rows [a, b) [head_dim, heads, b - a] of a [head_dim, heads, n] tensor."""
        ne0, ne1, _, _ = ggml.tensor_shape(t)
        nb = ggml.tensor_strides(t)
        return ggml.view_3d(self.ctx, t, ne0, ne1, b - a, nb[1], nb[2], a * nb[2])

    def _store_kv(self, cache: KVCache, inp: AttentionInputs, k: int, v: int, il: int) -> None:
        ctx = self.ctx
        n = ggml.tensor_shape(k)[2]
        kv = self.kv_views.record
        k_rows = ggml.view_2d(ctx, k, cache.k_width, n, ggml.tensor_strides(k)[2], 0)
        ggml.build_forward_expand(self.graph, kv(ggml.set_rows(ctx, cache.k[il], k_rows, inp.k_idxs)))
        if not cache.v_width:  # latent attention: the values are read from the K rows
            return
        if not cache.v_trans:  # flash attention: one row per cell, as K (llama.cpp's cpy_v without v_trans)
            v_rows = ggml.view_2d(ctx, v, cache.v_width, n, ggml.tensor_strides(v)[2], 0)
            ggml.build_forward_expand(self.graph, kv(ggml.set_rows(ctx, cache.v[il], v_rows, inp.k_idxs)))
            return
        # V is stored transposed: scatter single elements, as llama.cpp's cpy_v does.
        v_elems = ggml.reshape_2d(ctx, v, 1, cache.v_width * n)
        v_cells = kv(ggml.reshape_2d(ctx, cache.v[il], 1, cache.v_width * cache.capacity))
        ggml.build_forward_expand(self.graph, kv(ggml.set_rows(ctx, v_cells, v_elems, inp.v_idxs)))

    def _attend(self, cache: KVCache, inp: AttentionInputs, q: int, il: int, v_cur: int,
                v_mla: int | None = None, row: int | None = None) -> int:
        """Attention of q's rows over the request's cells. ``row``: q is that one row of the step,
        attending with its own mask row. Why rows one at a time for a speculative check: ggml's CPU
        matmul hands a product with two or more columns to llamafile's sgemm and a single column
        to ggml_vec_dot_f16, and the two add the F16 products of KQ and KQV in a different order,
        so a position checked in a step of n rows could get other bits than the same position in
        a one-token step (seen: logits 0.85 apart after 30 layers of SmolLM2, an argmax flip)."""
        s, ctx = self.spec, self.ctx
        n = ggml.tensor_shape(q)[2]
        mask = inp.kq_mask
        n_kv = ggml.tensor_shape(mask)[0]
        if row is not None:
            mask = ggml.view_2d(ctx, mask, n_kv, 1, ggml.tensor_strides(mask)[1], row * ggml.tensor_strides(mask)[1])
        k_all, v_all = self._cached_kv(cache, n_kv, il, v_cur)
        if not cache.v_trans and cache.v_width:
            return self._flash(q, k_all, v_all, mask, il)
        kv = self.kv_views.record
        q = ggml.permute(ctx, q, 0, 2, 1, 3)  # [head_dim, n, n_head]
        k_all = kv(ggml.permute(ctx, k_all, 0, 2, 1, 3))  # [head_dim, n_kv, n_head_kv]
        v_all = kv(ggml.permute(ctx, v_all, 0, 2, 1, 3))  # [n_kv, head_dim, n_head_kv]
        if not cache.v_width:  # values read from the K rows are not transposed: llama.cpp copies them so
            v_all = self.name(ggml.cont(ctx, kv(ggml.transpose(ctx, v_all))), "v_cont", il)
        kq = self.name(ggml.mul_mat(ctx, k_all, q), "kq", il)  # [n_kv, n, n_head]
        ggml.prec_set_acc(kq, ggml.PREC_F32)
        kq = self.name(ggml.soft_max_ext(ctx, kq, mask, s.attention_scale, 0.0), "kq_soft_max", il)
        kqv = self.name(ggml.mul_mat(ctx, v_all, kq), "kqv", il)  # [head_dim, n, n_head]
        if v_mla is not None:  # latent → each head's values
            kqv = self.name(ggml.mul_mat(ctx, v_mla, kqv), "kqv_mla", il)  # [v_head, n, n_head]
        width, _, heads, _ = ggml.tensor_shape(kqv)
        return ggml.cont_2d(ctx, ggml.permute(ctx, kqv, 0, 2, 1, 3), width * heads, n)

    def _flash(self, q: int, k_all: int, v_all: int, mask: int, il: int) -> int:
        """Attention as llama.cpp's build_attn_mha with flash attention on: one fused ggml op over
        the untransposed cache (mask F16, n_kv cells), accumulated in F32 (llama.cpp sets that
        precision on every flash node). Its CPU kernel splits a one-row step's cells between
        the threads once there are 512 or more, so there the bits depend on the thread count,
        as in llama.cpp itself."""
        ctx, kv = self.ctx, self.kv_views.record
        q = ggml.permute(ctx, q, 0, 2, 1, 3)  # [head_dim, n, n_head]
        k_all = kv(ggml.permute(ctx, k_all, 0, 2, 1, 3))  # [head_dim, n_kv, n_head_kv]
        v_all = kv(ggml.permute(ctx, v_all, 0, 2, 1, 3))  # [head_v, n_kv, n_head_kv]
        out = self.name(ggml.flash_attn_ext(ctx, q, k_all, v_all, mask, self.spec.attention_scale, 0.0, 0.0),
                        "fattn", il)  # [head_v, n_head, n]
        ggml.prec_set_acc(out, ggml.PREC_F32)
        width, heads, n, _ = ggml.tensor_shape(out)
        return ggml.reshape_2d(ctx, out, width * heads, n)

    def _cached_kv(self, cache: KVCache, n_kv: int, il: int, v_cur: int) -> tuple[int, int]:
        """Views of the cache's first ``n_kv`` cells: K [head_dim, n_head_kv, n_kv] and V
        [n_kv, n_head_kv, head_dim] transposed ([head_dim, n_head_kv, n_kv] under flash), or, for a
        cache without V, the first ``v_cur``-width values of each K row [v_width, n_head_kv, n_kv]
        (llama.cpp's MLA)."""
        s, cap, f16 = self.spec, cache.capacity, ggml.TYPE_F16
        row, kv = ggml.row_size, self.kv_views.record
        k = kv(ggml.view_4d(self.ctx, cache.k[il], s.head_dim, s.n_head_kv, n_kv, 1,
                            row(f16, s.head_dim), row(f16, s.n_embd_kv), row(f16, s.n_embd_kv * cap), 0))
        if not cache.v_width:
            nb = ggml.tensor_strides(k)
            v = ggml.view_4d(self.ctx, k, ggml.tensor_shape(v_cur)[0], s.n_head_kv, n_kv, 1, nb[1], nb[2], nb[3], 0)
            return k, kv(v)
        head_v = s.head_dim_v or s.head_dim
        if not cache.v_trans:
            return k, kv(ggml.view_4d(self.ctx, cache.v[il], head_v, s.n_head_kv, n_kv, 1, row(f16, head_v),
                                      row(f16, cache.v_width), row(f16, cache.v_width * cap), 0))
        v = ggml.view_4d(self.ctx, cache.v[il], n_kv, s.n_head_kv, head_v, 1,
                         row(f16, cap * head_v), row(f16, cap), row(f16, cap * cache.v_width), 0)
        return k, kv(v)

    def swiglu(self, gate: int, up: int, down: int, x: int, il: int, label: str = "ffn_out") -> int:
        """down(silu(gate(x)) * up(x)) (llama.cpp's build_ffn with LLM_FFN_SILU, LLM_FFN_PAR)."""
        ctx = self.ctx
        u = self.name(ggml.mul_mat(ctx, up, x), "ffn_up", il)
        g = self.name(ggml.mul_mat(ctx, gate, x), "ffn_gate", il)
        act = self.name(ggml.swiglu_split(ctx, g, u), "ffn_swiglu", il)
        return self.name(ggml.mul_mat(ctx, down, act), label, il)

    def shared_experts(self, w: LayerWeights, x: int, il: int) -> int:
        """The shared experts every token runs through (DeepSeek): one SwiGLU FFN."""
        return self.swiglu(w.ffn_gate_shexp, w.ffn_up_shexp, w.ffn_down_shexp, x, il, "ffn_shexp")

    def route(self, w: LayerWeights, x: int, il: int) -> tuple[int, int]:
        """The router (llama.cpp's build_moe_ffn): top-k experts per token (I32 [k, n]) and their
        weights (F32 [1, k, n]). Softmax or sigmoid gating; a routing bias and expert groups only
        choose the experts, the weights come from the unbiased probabilities."""
        s, ctx = self.spec, self.ctx
        n = ggml.tensor_shape(x)[1]
        k = s.n_expert_used
        logits = self.name(ggml.mul_mat(ctx, w.ffn_gate_inp, x), "ffn_moe_logits", il)  # [n_expert, n]
        gate = ggml.sigmoid if s.expert_gating == GATING_SIGMOID else ggml.soft_max
        probs = self.name(gate(ctx, logits), "ffn_moe_probs", il)
        choice = probs
        if w.ffn_exp_probs_b is not None:
            choice = self.name(ggml.add(ctx, probs, w.ffn_exp_probs_b), "ffn_moe_probs_biased", il)
        if s.n_expert_groups > 1 and n > 0:
            choice = self._best_groups(choice, n, il)
        selected = self.name(ggml.argsort_top_k(ctx, choice, k), "ffn_moe_topk", il)  # I32 [k, n]
        weights = self.name(ggml.get_rows(ctx, ggml.reshape_3d(ctx, probs, 1, s.n_expert, n), selected),
                            "ffn_moe_weights", il)  # [1, k, n]
        if s.expert_weights_norm:
            weights = ggml.reshape_2d(ctx, weights, k, n)
            total = ggml.clamp(ctx, ggml.sum_rows(ctx, weights), 6.103515625e-5, float("inf"))
            weights = ggml.reshape_3d(ctx, self.name(ggml.div(ctx, weights, total), "ffn_moe_weights_norm", il), 1, k, n)
        if s.expert_weights_scale not in (0.0, 1.0):
            weights = self.name(ggml.scale(ctx, weights, s.expert_weights_scale), "ffn_moe_weights_scaled", il)
        ggml.build_forward_expand(self.graph, weights)
        return selected, weights

    def _best_groups(self, choice: int, n: int, il: int) -> int:
        """Group-limited routing (DeepSeek-V3): a group scores the sum of its two best experts,
        and experts outside the best ``n_group_used`` groups are set to -inf."""
        s, ctx = self.spec, self.ctx
        groups, per = s.n_expert_groups, s.n_expert // s.n_expert_groups
        by_group = ggml.reshape_3d(ctx, choice, per, groups, n)  # [per, groups, n]
        best_two = ggml.argsort_top_k(ctx, by_group, 2)  # [2, groups, n]
        scores = ggml.get_rows(ctx, ggml.reshape_4d(ctx, by_group, 1, per, groups, n), best_two)  # [1, 2, groups, n]
        scores = ggml.sum_rows(ctx, ggml.reshape_3d(ctx, scores, 2, groups, n))  # [1, groups, n]
        scores = ggml.reshape_2d(ctx, scores, groups, n)
        kept = self.name(ggml.argsort_top_k(ctx, scores, s.n_group_used), "ffn_moe_group_topk", il)
        chosen = ggml.get_rows(ctx, by_group, kept)  # [per, n_group_used, n]
        masked = ggml.set_rows(ctx, ggml.fill(ctx, by_group, float("-inf")), chosen, kept)
        return self.name(ggml.reshape_2d(ctx, masked, s.n_expert, n), "ffn_moe_probs_masked", il)

    def experts(self, w: LayerWeights, x: int, selected: int, il: int) -> int:
        """Each token through its selected experts: [n_embd, 1|k, n] rows → [n_embd, k, n]."""
        up = self.name(ggml.mul_mat_id(self.ctx, w.ffn_up_exps, x, selected), "ffn_moe_up", il)
        gate = self.name(ggml.mul_mat_id(self.ctx, w.ffn_gate_exps, x, selected), "ffn_moe_gate", il)
        act = self.name(ggml.swiglu_split(self.ctx, gate, up), "ffn_moe_swiglu", il)
        return self.name(ggml.mul_mat_id(self.ctx, w.ffn_down_exps, act, selected), "ffn_moe_down", il)

    def combine_experts(self, experts: int, weights: int, n: int, il: int) -> int:
        """Weight each expert's output and add them in slot order (the order fixes the bits)."""
        ctx, k = self.ctx, self.spec.n_expert_used
        experts = self.name(ggml.mul(ctx, experts, weights), "ffn_moe_weighted", il)
        ggml.build_forward_expand(self.graph, experts)
        nb = ggml.tensor_strides(experts)
        views = [ggml.view_2d(ctx, experts, self.spec.n_embd, n, nb[2], i * nb[1]) for i in range(k)]
        for view in views:
            ggml.build_forward_expand(self.graph, view)
        out = views[0]
        for view in views[1:]:
            out = ggml.add(ctx, out, view)
            ggml.build_forward_expand(self.graph, out)
        if k == 1:
            out = ggml.cont(ctx, out)
        return self.name(out, "ffn_moe_out", il)

    def keep_output_rows(self, x: int, il: int) -> int:
        """On the model's last layer keep only the rows whose output is wanted (llama.cpp's inp_out_ids)."""
        if il != self.spec.n_layer - 1 or self.inputs.out_ids is None:
            return x
        return ggml.get_rows(self.ctx, x, self.inputs.out_ids)


def _concat_rows(ctx: int, parts: list[int]) -> int:
    """Stack [width, n_m] tensors along rows, as a balanced tree (each row is copied log2(B) times)."""
    while len(parts) > 1:
        parts = [ggml.concat(ctx, parts[i], parts[i + 1], 1) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


# --- a transformer block, top to bottom: the pre-norm pair of residuals around the record's halves ---

def attention_half(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> int:
    """ffn_inp = x + attention(attn_norm(x)), with the architecture's attention."""
    cur = b.norm(x, w.attn_norm, "attn_norm", il)
    cur = b.spec.arch.attention.build(b, w, cur, il)
    cur, inp_sa = b.keep_output_rows(cur, il), b.keep_output_rows(x, il)
    return b.name(ggml.add(b.ctx, cur, inp_sa), "ffn_inp", il)


def ffn_half(b: GraphBuilder, w: LayerWeights, ffn_inp: int, il: int) -> int:
    """l_out = ffn_inp + ffn(ffn_norm(ffn_inp)), with the model's FFN (dense or mixture of experts)."""
    cur = b.spec.ffn_for(il).build(b, w, b.norm(ffn_inp, w.ffn_norm, "ffn_norm", il), il)
    return b.name(ggml.add(b.ctx, cur, ffn_inp), "l_out", il)


def transformer_layer(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> int:
    return ffn_half(b, w, attention_half(b, w, x, il), il)


def graph_size_for(n_layers: int, n_requests: int, n_expert_used: int = 0) -> int:
    """Graph nodes to reserve: a block makes up to about 50 shared tensors (latent attention's
    the most) and 20 per request; a mixture-of-experts FFN some 40 more (group routing, shared
    experts), plus two per selected expert."""
    moe = 40 + 3 * n_expert_used if n_expert_used else 0
    return (56 + moe + 28 * n_requests) * max(n_layers, 1) + 64 + 4 * n_requests


def build_slice_graph(spec: ModelSpec, slice_spec: SliceSpec, weights: SliceWeights,
                      caches: list[KVCache | None], shape: GraphShape) -> SliceGraph:
    """The whole slice as one graph: [embedding] → layers [start, stop) → [output norm → LM head].
    With ``shape.hidden`` a slice with the LM head also outputs every row's final normed hidden
    state (``extra_outputs["hidden"]``, [n_embd, N]: what a nextn layer drafts from), and the
    logits' rows are computed exactly as without it."""
    if slice_spec.nextn:
        return build_nextn_graph(spec, slice_spec, weights, caches, shape)
    n_layers = slice_spec.stop - slice_spec.start
    every_row = shape.hidden and slice_spec.has_lm_head
    size = graph_size_for(n_layers + every_row, shape.attention_units, spec.n_expert_used)
    b = GraphBuilder.new(spec, slice_spec, weights, caches, shape, size)
    ctx, graph, inputs = b.ctx, b.graph, b.inputs

    if slice_spec.has_embedding:
        cur = b.name(ggml.get_rows(ctx, weights.tok_embd, inputs.tokens), "inp_embd")
    else:
        cur = inputs.embd
    all_rows = None  # with every_row, while the logits keep fewer rows: every row's last l_out
    for il in slice_spec.layers:
        if every_row and inputs.out_ids is not None and il == spec.n_layer - 1:
            cur, all_rows = _last_layer_every_row(b, weights.layers[il], cur, il)
        else:
            cur = transformer_layer(b, weights.layers[il], cur, il)
    extra = {}
    if slice_spec.has_lm_head:
        if n_layers == 0 and inputs.out_ids is not None:  # a head-only slice selects rows itself
            all_rows = cur
            cur = ggml.get_rows(ctx, cur, inputs.out_ids)
        cur = b.norm(cur, weights.output_norm, "result_norm", -1)
        if every_row:  # (rms norm is per row: the rows kept get the same bits either way)
            extra["hidden"] = cur if all_rows is None else b.norm(all_rows, weights.output_norm, "result_norm_all", -1)
        cur = b.name(b.linear(weights.output, cur, weights.output_b), "result_output")
    for t in (cur, *extra.values()):
        ggml.set_output(t)
        ggml.build_forward_expand(graph, t)
    return b.finish(cur, extra)


def _last_layer_every_row(b: GraphBuilder, w: LayerWeights, x: int, il: int) -> tuple[int, int]:
    """The model's last layer when the logits keep some rows and the hidden states are wanted for
    all: attention over every row (as always), then the FFN twice, on the kept rows (the logits'
    path, the same operations as ``transformer_layer``: selecting rows of attn + x adds the same
    numbers) and on every row. Returns (l_out of the kept rows, l_out of every row)."""
    attn = b.spec.arch.attention.build(b, w, b.norm(x, w.attn_norm, "attn_norm", il), il)
    ffn_inp = b.name(ggml.add(b.ctx, attn, x), "ffn_inp_all", il)
    kept = ffn_half(b, w, ggml.get_rows(b.ctx, ffn_inp, b.inputs.out_ids), il)
    return kept, b.name(ffn_half(b, w, ffn_inp, il), "l_out_all", il)


def build_nextn_graph(spec: ModelSpec, slice_spec: SliceSpec, weights: SliceWeights,
                      caches: list[KVCache | None], shape: GraphShape) -> SliceGraph:
    """A multi-token-prediction layer (DeepSeek-V3's MTP module, as vLLM runs it): at position i,
    the embedding of token i + 1 and the final hidden state of position i, each normed, joined
    and projected to one row, through one more block of the model's kind, then its own norm and
    head: logits for token i + 2. Outputs the logits of the kept rows and the block's output for
    every row (``extra_outputs["hidden"]``, before the norm), which feeds the next draft."""
    il, nw = slice_spec.start, weights.nextn
    size = graph_size_for(1, shape.attention_units, spec.n_expert_used) + 16
    b = GraphBuilder.new(spec, slice_spec, weights, caches, shape, size)
    ctx, graph, inputs = b.ctx, b.graph, b.inputs
    embd = b.norm(b.name(ggml.get_rows(ctx, nw.embd, inputs.tokens), "nextn_inp_embd"), nw.enorm, "nextn_enorm", il)
    hidden = b.norm(inputs.embd, nw.hnorm, "nextn_hnorm", il)
    cur = b.name(ggml.mul_mat(ctx, nw.eh_proj, ggml.concat(ctx, embd, hidden, 0)), "nextn_eh_proj", il)
    l_out = transformer_layer(b, weights.layers[il], cur, il)
    cur = ggml.get_rows(ctx, l_out, inputs.out_ids) if inputs.out_ids is not None else l_out
    cur = b.norm(cur, nw.head_norm, "nextn_result_norm", -1)
    cur = b.name(ggml.mul_mat(ctx, nw.head, cur), "nextn_result_output")
    for t in (cur, l_out):
        ggml.set_output(t)
        ggml.build_forward_expand(graph, t)
    return b.finish(cur, {"hidden": l_out})


def build_router_segment(spec: ModelSpec, slice_spec: SliceSpec, weights: SliceWeights, caches: list[KVCache | None],
                         shape: GraphShape, il: int) -> SliceGraph:
    """One mixture-of-experts layer up to its router, for a stage whose experts live on other
    nodes. Input: the layer's input activations. Outputs: ``output`` = the residual (ffn_inp),
    and ``ffn_in`` (normed, what the experts take), ``selected`` (I32 [k, N] expert per slot) and
    ``weights`` (F32 [1, k, N]), computed exactly as the whole-layer graph computes them."""
    size = graph_size_for(1, shape.attention_units, spec.n_expert_used)
    b = GraphBuilder.new(spec, SliceSpec(il, il + 1), weights, caches, shape, size)
    ctx, graph, inputs = b.ctx, b.graph, b.inputs
    w = weights.layers[il]
    ffn_inp = attention_half(b, w, inputs.embd, il)
    ffn_in = b.norm(ffn_inp, w.ffn_norm, "ffn_norm", il)
    selected, routing = b.route(w, ffn_in, il)
    # argsort_top_k is a strided view of the full ranking: copy it contiguous to read it out
    outputs = {"ffn_in": ffn_in, "selected": ggml.cont(ctx, selected), "weights": routing}
    if w.ffn_up_shexp is not None:  # shared experts stay with the stage
        outputs["shared"] = b.shared_experts(w, ffn_in, il)
    for t in (ffn_inp, *outputs.values()):
        ggml.set_output(t)
        ggml.build_forward_expand(graph, t)
    return b.finish(ffn_inp, outputs)


def _new_inputs(ctx: int, spec: ModelSpec, s: SliceSpec, shape: GraphShape) -> GraphInputs:
    def placeholder(name: str, ggml_type: int, *ne: int) -> int:
        t = ggml.new_tensor_1d(ctx, ggml_type, ne[0]) if len(ne) == 1 else ggml.new_tensor_2d(ctx, ggml_type, *ne)
        ggml.set_name(t, name.encode())
        ggml.set_input(t)
        return t

    n = shape.n_tokens
    has_layers = s.stop > s.start
    inputs = GraphInputs(pos=placeholder("inp_pos", ggml.TYPE_I32, n) if has_layers else None)
    if has_layers:
        mask_type = ggml.TYPE_F16 if shape.flash else ggml.TYPE_F32  # (flash attention takes an F16 mask)
        inputs.attention = [AttentionInputs(
            kq_mask=placeholder("attn_inp_kq_mask", mask_type, r.n_kv, r.n_tokens),
            k_idxs=placeholder("attn_inp_k_idxs", ggml.TYPE_I64, r.n_tokens),
            v_idxs=placeholder("attn_inp_v_idxs", ggml.TYPE_I64, r.n_tokens * spec.kv_widths[1])
            if spec.kv_widths[1] and not shape.flash else None,
        ) for r in shape.requests]
    if s.has_embedding or s.nextn:  # (a nextn layer takes both: a token and the hidden state before it)
        inputs.tokens = placeholder("inp_tokens", ggml.TYPE_I32, n)
    if not s.has_embedding:
        inputs.embd = placeholder("inp_embd", ggml.TYPE_F32, spec.n_embd, n)
    if (s.has_lm_head or s.nextn) and shape.n_outputs != n:
        # Only the slice that makes the logits keeps fewer rows (kernels.slice._graph_shape): one
        # that passes activations on returns every row, whatever the next slice holds.
        inputs.out_ids = placeholder("inp_out_ids", ggml.TYPE_I32, shape.n_outputs)
    return inputs
