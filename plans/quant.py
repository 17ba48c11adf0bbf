"""What a quantized GGUF of a model holds, tensor by tensor, without the file: ggml's block sizes,
the tensor list llama.cpp's converter writes for a ``deepseek2`` model (DeepSeek-V3, Kimi K2), and
the type llama-quantize gives each tensor. Layouts on paper are summed from this, so their bytes
are a real file's bytes for the stated types (less the GGUF header and alignment padding)."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

# ggml's type traits: (weights per block, bytes per block), as ggml_blck_size / ggml_type_size
# give them (tests/test_quant_layouts.py checks every entry against the installed ggml)
BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "IQ1_S": (256, 50), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
}

# llama-quantize's fallback when a tensor's rows are not a whole number of the type's blocks
# (src/llama-quant.cpp, tensor_type_fallback); Q8_0, Q5_0 and the like have 32-weight blocks
FALLBACK = {"IQ1_S": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL", "IQ3_XXS": "IQ4_NL",
            "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0",
            "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# the types a uniform layout may use, and llama-quantize's file types (mixes) modelled here, each
# with the type most of its tensors get
UNIFORM_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q8_0", "IQ2_XXS", "IQ2_XS")
MIX_DEFAULT = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q8_0": "Q8_0",
               "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS"}
_IQ2 = ("IQ2_XXS", "IQ2_XS")


def bits_per_weight(ggml_type: str) -> float:
    block, size = BLOCKS[ggml_type]
    return size * 8 / block


def row_bytes(ggml_type: str, n: int) -> int:
    """Bytes of one row of ``n`` weights, as ggml_row_size computes it."""
    block, size = BLOCKS[ggml_type]
    if n % block:
        raise ValueError(f"a row of {n} is not a whole number of {ggml_type}'s {block}-weight blocks")
    return n // block * size


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml's order: ne0 (the length of a row) first

    @property
    def n_params(self) -> int:
        return prod(self.shape)

    @property
    def layer(self) -> int | None:
        if not self.name.startswith("blk."):
            return None
        return int(self.name.split(".")[1])

    def n_bytes(self, ggml_type: str) -> int:
        return row_bytes(ggml_type, self.shape[0]) * prod(self.shape[1:])

    @property
    def quantizable(self) -> bool:
        """What llama-quantize quantizes (tensor_allows_quantization): 2-D and 3-D weights, not the
        norms and not the router, which keep the converter's F32."""
        return (len(self.shape) >= 2 and self.name.endswith("weight") and "_norm.weight" not in self.name
                and "ffn_gate_inp.weight" not in self.name)


def deepseek2_tensors(*, n_layer: int, n_dense_layers: int, n_embd: int, n_ff: int, n_expert: int,
                      n_expert_shared: int, n_ff_expert: int, n_head: int, q_lora_rank: int, kv_lora_rank: int,
                      qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, n_vocab: int,
                      **_) -> list[Tensor]:
    """The tensors of a ``deepseek2`` GGUF as convert_hf_to_gguf.py writes it today (``kv_b_proj``
    split into ``attn_k_b`` and ``attn_v_b``, k_b transposed; no multi-token-prediction layer),
    in the order llama.cpp's loader visits them (by layer, then by name), which llama-quantize's
    per-tensor counters follow."""
    shexp = n_ff_expert * n_expert_shared
    tensors = [Tensor("token_embd.weight", (n_embd, n_vocab)), Tensor("output_norm.weight", (n_embd,)),
               Tensor("output.weight", (n_embd, n_vocab))]
    for il in range(n_layer):
        blk = f"blk.{il}."
        layer = [
            Tensor(blk + "attn_norm.weight", (n_embd,)),
            Tensor(blk + "attn_q_a_norm.weight", (q_lora_rank,)),
            Tensor(blk + "attn_kv_a_norm.weight", (kv_lora_rank,)),
            Tensor(blk + "attn_q_a.weight", (n_embd, q_lora_rank)),
            Tensor(blk + "attn_q_b.weight", (q_lora_rank, n_head * (qk_nope_head_dim + qk_rope_head_dim))),
            Tensor(blk + "attn_kv_a_mqa.weight", (n_embd, kv_lora_rank + qk_rope_head_dim)),
            Tensor(blk + "attn_k_b.weight", (qk_nope_head_dim, kv_lora_rank, n_head)),
            Tensor(blk + "attn_v_b.weight", (kv_lora_rank, v_head_dim, n_head)),
            Tensor(blk + "attn_output.weight", (n_head * v_head_dim, n_embd)),
            Tensor(blk + "ffn_norm.weight", (n_embd,)),
        ]
        if il < n_dense_layers:
            layer += [Tensor(blk + "ffn_gate.weight", (n_embd, n_ff)), Tensor(blk + "ffn_up.weight", (n_embd, n_ff)),
                      Tensor(blk + "ffn_down.weight", (n_ff, n_embd))]
        else:
            layer += [
                Tensor(blk + "ffn_gate_inp.weight", (n_embd, n_expert)),
                Tensor(blk + "exp_probs_b.bias", (n_expert,)),
                Tensor(blk + "ffn_gate_exps.weight", (n_embd, n_ff_expert, n_expert)),
                Tensor(blk + "ffn_up_exps.weight", (n_embd, n_ff_expert, n_expert)),
                Tensor(blk + "ffn_down_exps.weight", (n_ff_expert, n_embd, n_expert)),
                Tensor(blk + "ffn_gate_shexp.weight", (n_embd, shexp)),
                Tensor(blk + "ffn_up_shexp.weight", (n_embd, shexp)),
                Tensor(blk + "ffn_down_shexp.weight", (shexp, n_embd)),
            ]
        tensors += layer
    return sorted(tensors, key=lambda t: (-1 if t.layer is None else t.layer, t.name))


def uniform_types(tensors: list[Tensor], ggml_type: str) -> list[str]:
    """``llama-quantize --pure``: every quantizable tensor at ``ggml_type`` (the token embedding and
    the output included), rows the type's blocks do not divide at its fallback."""
    return [_fallback(t, ggml_type) if t.quantizable else "F32" for t in tensors]


def mix_types(tensors: list[Tensor], ftype: str, n_layer: int) -> list[str]:
    """llama-quantize's choice for file type ``ftype`` (llama_tensor_get_type_impl) on a deepseek2
    model: only the rules that name a deepseek2 tensor are here (its MLA tensors are none of
    attn_v/attn_k/attn_q/attn_qkv/attn_kv_b, and it has far more than 8 experts)."""
    default = MIX_DEFAULT[ftype]
    types, i_ffn_down = [], 0
    for t in tensors:
        if not t.quantizable:
            types.append("F32")
            continue
        chosen = default
        if t.name == "output.weight":
            chosen = ("Q8_0" if t.shape[0] % BLOCKS[default][0] else "Q5_K" if ftype in _IQ2
                      else default if default == "Q8_0" else "Q6_K")
        elif t.name == "token_embd.weight":
            chosen = "Q2_K" if ftype in _IQ2 else default
        elif "ffn_down" in t.name:
            chosen = _ffn_down_type(ftype, default, t.layer, n_layer, i_ffn_down)
            i_ffn_down += 1
        elif "attn_output.weight" in t.name:
            chosen = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K"}.get(ftype, default)
        types.append(_fallback(t, chosen))
    return types


def _ffn_down_type(ftype: str, default: str, il: int, n_layer: int, i_ffn_down: int) -> str:
    if ftype in _IQ2:  # a count of ffn_down tensors visited, not a layer: the first eighth of them
        return "Q2_K" if i_ffn_down < n_layer // 8 else default
    if ftype == "Q2_K":
        return "Q3_K"
    if ftype == "Q3_K_M":
        return "Q5_K" if il < n_layer // 16 else "Q4_K"
    if ftype == "Q4_K_M":
        more_bits = il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2
        return "Q6_K" if more_bits else default
    return default


def _fallback(t: Tensor, ggml_type: str) -> str:
    if t.shape[0] % BLOCKS[ggml_type][0] == 0:
        return ggml_type
    fallback = FALLBACK[ggml_type]
    return fallback if t.shape[0] % BLOCKS[fallback][0] == 0 else "F16"
