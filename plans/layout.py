"""What a model asks of the machines that run it, per layer: weight bytes, KV bytes per token,
FLOPs per token, and the activation bytes that cross each link. Read from GGUF metadata and the
tensor directory alone (no weights are read), or built from known dimensions so that a model
nobody here has downloaded (a 70B) can be planned on paper."""

from __future__ import annotations

from dataclasses import dataclass

from plans.quant import BLOCKS, MIX_DEFAULT, UNIFORM_TYPES, bits_per_weight

# bits per weight of the GGML types a layout on paper may use (block bytes × 8 / block size, from
# ggml's block sizes in plans/quant.py)
BITS_PER_WEIGHT = {t: bits_per_weight(t) for t in BLOCKS}


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
    # FLOPs per token of each layer's attention matrices (part of layer_flops; empty: not known): a
    # prompt's rows that need no logits skip the last layer's FFN, not its attention (plans/prefill.py)
    attention_flops: tuple[int, ...] = ()

    @property
    def activation_bytes_per_token(self) -> int:
        """What crosses a link per token: one row of f32 activations."""
        return 4 * self.n_embd

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embedding_bytes + self.lm_head_bytes

    def range_bytes(self, start: int, stop: int) -> int:
        return sum(self.layer_bytes[start:stop])

    def read_bytes(self, il: int) -> float:
        """The weight bytes one token reads in layer ``il``: all of it but the routed experts it skips."""
        if not self.expert_bytes or not self.expert_bytes[il]:
            return float(self.layer_bytes[il])
        return self.layer_bytes[il] - self.expert_bytes[il] * (1 - self.n_expert_used / self.n_expert)

    def asker_read_bytes(self, head_layers: int) -> float:
        """What the asker reads per token: its head and tail layers and the LM head (the embedding
        is one row)."""
        own = [*range(head_layers), *range(self.n_layer - head_layers, self.n_layer)]
        return sum(self.read_bytes(il) for il in own) + self.lm_head_bytes

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
            flops, experts, attention = [0] * spec.n_layer, [0] * spec.n_layer, [0] * spec.n_layer
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
                    if ".attn_" in info.name:
                        attention[il] += 2 * n
            return cls(name=gguf.path.name, n_layer=spec.n_layer, n_embd=spec.n_embd,
                       layer_bytes=spec.layer_bytes, layer_flops=tuple(flops),
                       kv_bytes_per_token_per_layer=spec.kv_bytes_per_token_per_layer,
                       embedding_bytes=spec.embedding_bytes, lm_head_bytes=spec.lm_head_bytes, n_vocab=spec.n_vocab,
                       expert_bytes=tuple(experts) if spec.n_expert else (), n_expert=spec.n_expert,
                       n_expert_used=spec.n_expert_used, attention_flops=tuple(attention))

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
        attention_flops = (2 * (2 * n_embd * n_embd + 2 * n_embd * kv),) * n_layer  # q, o, k, v
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
                   lm_head_bytes=int(n_vocab * n_embd * bits[output_type] / 8) + n_embd * 4, n_vocab=n_vocab,
                   attention_flops=attention_flops)

    @classmethod
    def from_mla_moe(cls, name: str, *, quantization: str = "Q4_K", mix: bool = False,
                     **dims: int) -> "ModelLayout":
        """A DeepSeek-V3-style layout on paper (GGUF arch ``deepseek2``: DeepSeek-V3, Kimi K2): MLA
        attention, the first ``n_dense_layers`` with a dense FFN, the rest MoE with ``n_expert``
        routed experts (``n_expert_used`` per token) and ``n_expert_shared`` shared ones. Summed over
        the tensor list a real GGUF holds (plans/quant.py), each tensor at the type llama-quantize
        gives it: with ``mix``, what its file type ``quantization`` (e.g. Q4_K_M) chooses; without,
        ``--pure``: every quantizable tensor at the type ``quantization``. Norms, the router and its
        bias stay F32 either way."""
        from plans.quant import deepseek2_tensors, mix_types, uniform_types

        n_layer, n_embd = dims["n_layer"], dims["n_embd"]
        n_expert, n_expert_used = dims["n_expert"], dims["n_expert_used"]
        tensors = deepseek2_tensors(**dims)
        types = mix_types(tensors, quantization, n_layer) if mix else uniform_types(tensors, quantization)
        layer_bytes, flops, experts, shared, expert_flops, attention = ([0] * n_layer for _ in range(6))
        embedding = lm_head = n_params = n_active = 0
        for t, ggml_type in zip(tensors, types):
            size, n = t.n_bytes(ggml_type), t.n_params
            routed = "_exps." in t.name
            # a token runs attention, the router, the shared expert and only the experts it was routed to
            used = n * n_expert_used // n_expert if routed else n
            n_params, n_active = n_params + n, n_active + used
            il = t.layer
            if il is None:
                if t.name == "token_embd.weight":
                    embedding += size
                else:  # the output matrix and the output norm
                    lm_head += size
                continue
            layer_bytes[il] += size
            if len(t.shape) >= 2:
                flops[il] += 2 * used
            if routed:
                experts[il] += size
                expert_flops[il] += 2 * used
            elif "_shexp." in t.name:
                shared[il] += size
            elif ".attn_" in t.name and len(t.shape) >= 2:  # q_a, q_b, kv_a, k_b, v_b and the output
                attention[il] += size
        return cls(name=name, n_layer=n_layer, n_embd=n_embd, layer_bytes=tuple(layer_bytes),
                   layer_flops=tuple(flops),
                   # MLA caches the compressed latent and the shared rope key, not K and V per head
                   kv_bytes_per_token_per_layer=2 * (dims["kv_lora_rank"] + dims["qk_rope_head_dim"]),
                   embedding_bytes=embedding, lm_head_bytes=lm_head, n_vocab=dims["n_vocab"],
                   expert_bytes=tuple(experts), n_expert=n_expert, n_expert_used=n_expert_used,
                   shared_expert_bytes=tuple(shared), expert_flops=tuple(expert_flops),
                   attention_bytes=tuple(attention), n_params=n_params, n_active_params=n_active)


# Layouts on paper, for `swarmctl plan --layout NAME` (dimensions from the models' published configs).
LAYOUTS = {
    "llama-3-70b-q4_k_m": dict(n_layer=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8, n_vocab=128256,
                               weight_type="Q4_K", wide_type="Q6_K"),
    "llama-3-8b-q4_k_m": dict(n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, n_vocab=128256,
                              weight_type="Q4_K", wide_type="Q6_K"),
    "qwen2.5-32b-q4_k_m": dict(n_layer=64, n_embd=5120, n_ff=27648, n_head=40, n_head_kv=8, n_vocab=152064,
                               weight_type="Q4_K", wide_type="Q6_K"),
}

# MLA + MoE layouts (GGUF arch deepseek2), summed over the real tensor list (plans/quant.py).
_DEEPSEEK_V3 = dict(n_layer=61, n_dense_layers=3, n_embd=7168, n_ff=18432, n_expert=256, n_expert_used=8,
                    n_expert_shared=1, n_ff_expert=2048, n_head=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_vocab=129280)
# Kimi K2: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer, a larger vocabulary
_KIMI_K2 = {**_DEEPSEEK_V3, "n_dense_layers": 1, "n_expert": 384, "n_head": 64, "n_vocab": 163840}
_MODELS = (("deepseek-v3", _DEEPSEEK_V3), ("kimi-k2", _KIMI_K2))
# NAME-TYPE (e.g. kimi-k2-q2_k) is uniform, `llama-quantize --pure TYPE`: every quantizable tensor at
# TYPE, the token embedding and the output included. NAME-FTYPE is llama-quantize's own mix for that
# file type (kimi-k2-q4_k_m), named NAME-FTYPE-mix where FTYPE is also a type's name (kimi-k2-q2_k-mix);
# Q8_0's mix is its uniform layout (llama-quantize keeps every tensor at Q8_0), so it has no -mix name.
QUANTIZATIONS = UNIFORM_TYPES
MIXES = tuple(f for f in MIX_DEFAULT if f != "Q8_0")
MLA_MOE_LAYOUTS = {
    **{f"{model}-{q.lower()}": {**dims, "quantization": q} for model, dims in _MODELS for q in QUANTIZATIONS},
    **{f"{model}-{f.lower()}" + ("-mix" if f in UNIFORM_TYPES else ""): {**dims, "quantization": f, "mix": True}
       for model, dims in _MODELS for f in MIXES},
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
