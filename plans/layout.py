"""What a model asks of the machines that run it, per layer: weight bytes, KV bytes per token,
FLOPs per token, and the activation bytes that cross each link. Read from GGUF metadata and the
tensor directory alone (no weights are read), or built from known dimensions so that a model
nobody here has downloaded (a 70B) can be planned on paper."""

from __future__ import annotations

from dataclasses import dataclass

# bits per weight of the GGML types a layout on paper may use (block bytes × 8 / block size)
# (tests/test_kimi_plan.py checks each against ggml's own type_size / blck_size)
BITS_PER_WEIGHT = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5,
                   "Q4_K": 4.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q3_K": 3.4375, "Q2_K": 2.625,
                   "IQ2_XXS": 2.0625, "IQ2_XS": 2.3125, "IQ1_S": 1.5625}


@dataclass(frozen=True)
class ModelLayout:
    name: str
    n_layer: int
    n_embd: int
    layer_bytes: tuple[int, ...]  # weight bytes of each layer
    layer_flops: tuple[int, ...]  # FLOPs per token of each layer (2 per weight; attention over a short context)
    kv_bytes_per_token_per_layer: int  # K and V in f16
    embedding_bytes: int
    lm_head_bytes: int  # output norm + output matrix (the embedding again when tied)
    n_vocab: int = 0
    expert_bytes: tuple[int, ...] = ()  # MoE models: bytes of each layer's experts (part of layer_bytes)
    n_expert: int = 0
    n_expert_used: int = 0
    # Layouts on paper also say what is not read from a GGUF (empty or 0: not known):
    # each layer's shared expert (part of layer_bytes): it stays with the stage, every token runs it
    shared_expert_bytes: tuple[int, ...] = ()
    expert_flops: tuple[int, ...] = ()  # FLOPs per token of the routed experts a token uses (part of layer_flops)
    attention_bytes: tuple[int, ...] = ()  # each layer's attention matrices (MLA: q_a, q_b, kv_a, k_b, v_b, output)
    n_params: int = 0  # all parameters
    # the ones a token reads: the used experts, not the others (embedding and output whole, as published counts do)
    n_active_params: int = 0

    @property
    def activation_bytes_per_token(self) -> int:
        """What crosses a link per token: one row of f32 activations."""
        return 4 * self.n_embd

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embedding_bytes + self.lm_head_bytes

    def range_bytes(self, start: int, stop: int) -> int:
        return sum(self.layer_bytes[start:stop])

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """An MoE model's layers without routed experts (DeepSeek-V3's first three); every layer of a
        dense model."""
        if not self.expert_bytes:
            return tuple(range(self.n_layer))
        return tuple(il for il, e in enumerate(self.expert_bytes) if e == 0)

    @classmethod
    def from_gguf(cls, path) -> "ModelLayout":
        from kernels.gguf_file import GGUFFile
        from kernels.spec import ModelSpec, layer_of

        with GGUFFile(path) as gguf:
            spec = ModelSpec.from_gguf(gguf)
            flops, experts = [0] * spec.n_layer, [0] * spec.n_layer
            for info in gguf.tensors.values():
                il = layer_of(info.name)
                if il is not None and il < spec.n_layer and len(info.shape) >= 2:
                    n = 1
                    for d in info.shape:
                        n *= d
                    if "_exps." in info.name:  # a token runs through only the experts its router picks
                        experts[il] += info.n_bytes
                        n = n * spec.n_expert_used // max(1, spec.n_expert)
                    flops[il] += 2 * n
            return cls(name=gguf.path.name, n_layer=spec.n_layer, n_embd=spec.n_embd,
                       layer_bytes=spec.layer_bytes, layer_flops=tuple(flops),
                       kv_bytes_per_token_per_layer=spec.kv_bytes_per_token_per_layer,
                       embedding_bytes=spec.embedding_bytes, lm_head_bytes=spec.lm_head_bytes, n_vocab=spec.n_vocab,
                       expert_bytes=tuple(experts) if spec.n_expert else (), n_expert=spec.n_expert,
                       n_expert_used=spec.n_expert_used)

    @classmethod
    def from_dimensions(cls, name: str, *, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_head_kv: int,
                        n_vocab: int, weight_type: str = "Q4_K", wide_type: str | None = None,
                        embedding_type: str = "Q4_K", output_type: str = "Q6_K") -> "ModelLayout":
        """A dense llama-style layout on paper. ``wide_type`` (e.g. Q6_K for a Q4_K_M file) is used
        for attn_v and ffn_down on the layers llama.cpp's *_M mixes give more bits: the first and
        last eighth of the layers and every third layer between."""
        head_dim = n_embd // n_head
        kv = n_head_kv * head_dim
        bits = BITS_PER_WEIGHT
        layer_bytes, layer_flops = [], []
        for il in range(n_layer):
            more = wide_type is not None and (il < n_layer // 8 or il >= 7 * n_layer // 8
                                              or (il - n_layer // 8) % 3 == 2)
            wide = bits[wide_type] if more else bits[weight_type]
            main = n_embd * n_embd * 2 + n_embd * kv + 2 * n_embd * n_ff  # q, o, k, gate, up
            wide_params = n_embd * kv + n_ff * n_embd  # v, down
            layer_bytes.append(int(main * bits[weight_type] / 8 + wide_params * wide / 8 + 2 * n_embd * 4))
            layer_flops.append(2 * (main + wide_params))
        return cls(name=name, n_layer=n_layer, n_embd=n_embd, layer_bytes=tuple(layer_bytes),
                   layer_flops=tuple(layer_flops), kv_bytes_per_token_per_layer=2 * kv * 2,
                   embedding_bytes=int(n_vocab * n_embd * bits[embedding_type] / 8),
                   lm_head_bytes=int(n_vocab * n_embd * bits[output_type] / 8) + n_embd * 4, n_vocab=n_vocab)

    @classmethod
    def from_mla_moe(cls, name: str, *, n_layer: int, n_dense_layers: int, n_embd: int, n_ff: int, n_expert: int,
                     n_expert_used: int, n_expert_shared: int, n_ff_expert: int, n_head: int, q_lora_rank: int,
                     kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, n_vocab: int,
                     weight_type: str = "Q4_K", embedding_type: str = "Q4_K",
                     output_type: str = "Q4_K") -> "ModelLayout":
        """A DeepSeek-V3-style layout on paper (GGUF arch ``deepseek2``: DeepSeek-V3, Kimi K2): MLA
        attention, the first ``n_dense_layers`` with a dense FFN, the rest MoE with ``n_expert``
        routed experts (``n_expert_used`` per token) and ``n_expert_shared`` shared ones. Every matrix
        is ``weight_type``; norms, the router and its bias stay F32, as in GGUFs of these models."""
        bits = BITS_PER_WEIGHT
        w, f32 = bits[weight_type] / 8, 4  # bytes per weight
        qk_head = qk_nope_head_dim + qk_rope_head_dim
        attention = (n_embd * q_lora_rank  # attn_q_a
                     + q_lora_rank * n_head * qk_head  # attn_q_b
                     + n_embd * (kv_lora_rank + qk_rope_head_dim)  # attn_kv_a_mqa
                     + n_head * qk_nope_head_dim * kv_lora_rank  # attn_k_b
                     + n_head * kv_lora_rank * v_head_dim  # attn_v_b
                     + n_head * v_head_dim * n_embd)  # attn_output
        norms = 2 * n_embd + q_lora_rank + kv_lora_rank  # attn_norm, ffn_norm, attn_q_a_norm, attn_kv_a_norm
        one_expert = 3 * n_embd * n_ff_expert  # gate, up, down
        router = n_embd * n_expert + n_expert  # ffn_gate_inp and the routing bias (exp_probs_b)
        layer_bytes, layer_flops, experts, shared, expert_flops = [], [], [], [], []
        attention_bytes = int(attention * w)
        n_params = n_active = 0
        for il in range(n_layer):
            if il < n_dense_layers:
                ffn = 3 * n_embd * n_ff
                layer_bytes.append(int((attention + ffn) * w + norms * f32))
                layer_flops.append(2 * (attention + ffn))
                experts.append(0), shared.append(0), expert_flops.append(0)
                n_params += attention + ffn + norms
                n_active += attention + ffn + norms
                continue
            routed, common = n_expert * one_expert, n_expert_shared * one_expert
            layer_bytes.append(int((attention + routed + common) * w + (norms + router) * f32))
            # a token runs attention, the router, the shared expert and only the experts it was routed to
            used = n_expert_used * one_expert
            layer_flops.append(2 * (attention + common + n_embd * n_expert + used))
            experts.append(int(routed * w)), shared.append(int(common * w)), expert_flops.append(2 * used)
            n_params += attention + routed + common + norms + router
            n_active += attention + used + common + norms + router
        embedding, output = n_vocab * n_embd, n_vocab * n_embd  # untied
        return cls(name=name, n_layer=n_layer, n_embd=n_embd, layer_bytes=tuple(layer_bytes),
                   layer_flops=tuple(layer_flops),
                   # MLA caches the compressed latent and the shared rope key, not K and V per head
                   kv_bytes_per_token_per_layer=2 * (kv_lora_rank + qk_rope_head_dim),
                   embedding_bytes=int(embedding * bits[embedding_type] / 8),
                   lm_head_bytes=int(output * bits[output_type] / 8) + n_embd * f32, n_vocab=n_vocab,
                   expert_bytes=tuple(experts), n_expert=n_expert, n_expert_used=n_expert_used,
                   shared_expert_bytes=tuple(shared), expert_flops=tuple(expert_flops),
                   attention_bytes=(attention_bytes,) * n_layer,
                   n_params=n_params + embedding + output + n_embd,
                   n_active_params=n_active + embedding + output + n_embd)


# Layouts on paper, for `swarmctl plan --layout NAME` (dimensions from the models' published configs).
LAYOUTS = {
    "llama-3-70b-q4_k_m": dict(n_layer=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8, n_vocab=128256,
                               weight_type="Q4_K", wide_type="Q6_K"),
    "llama-3-8b-q4_k_m": dict(n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, n_vocab=128256,
                              weight_type="Q4_K", wide_type="Q6_K"),
    "qwen2.5-32b-q4_k_m": dict(n_layer=64, n_embd=5120, n_ff=27648, n_head=40, n_head_kv=8, n_vocab=152064,
                               weight_type="Q4_K", wide_type="Q6_K"),
}

# MLA + MoE layouts (GGUF arch deepseek2), every matrix Q4_K (4.5 bits per weight): not llama.cpp's
# Q4_K_M mix, which gives some tensors more bits, so a real Q4_K_M file is somewhat larger.
_DEEPSEEK_V3 = dict(n_layer=61, n_dense_layers=3, n_embd=7168, n_ff=18432, n_expert=256, n_expert_used=8,
                    n_expert_shared=1, n_ff_expert=2048, n_head=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_vocab=129280)
_KIMI_K2 = {**_DEEPSEEK_V3, "n_dense_layers": 1, "n_expert": 384, "n_head": 64, "n_vocab": 163840}
# Each at one quantization for every matrix (uniform: not llama.cpp's _M/_S/_XL mixes, which give
# some tensors more bits), the token embedding and the output at Q6_K as those mixes keep them, and
# the Q4_K layouts as before (every matrix at Q4_K, embedding and output included).
QUANTIZATIONS = ("Q2_K", "Q3_K", "Q4_K", "Q8_0", "IQ2_XXS", "IQ2_XS")
MLA_MOE_LAYOUTS = {
    f"{model}-{q.lower()}": ({**base, "weight_type": q, "embedding_type": "Q6_K", "output_type": "Q6_K"}
                             if q != "Q4_K" else base)
    # Kimi K2: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer, a larger vocabulary
    for model, base in (("deepseek-v3", _DEEPSEEK_V3), ("kimi-k2", _KIMI_K2)) for q in QUANTIZATIONS
}
ALIASES = {"deepseek-v3": "deepseek-v3-q4_k", "kimi-k2": "kimi-k2-q4_k"}


def layout_by_name(name: str) -> ModelLayout:
    from kernels.errors import EngineError

    key = ALIASES.get(name.lower(), name.lower())
    if key in MLA_MOE_LAYOUTS:
        return ModelLayout.from_mla_moe(key, **MLA_MOE_LAYOUTS[key])
    if key not in LAYOUTS:
        known = [*LAYOUTS, *MLA_MOE_LAYOUTS, *ALIASES]
        raise EngineError(f"unknown layout {name!r} (known: {', '.join(known)})")
    return ModelLayout.from_dimensions(key, **LAYOUTS[key])
