"""Tiny random-weight GGUF models written with ``gguf.GGUFWriter``, for tests.

They carry the bundled model's tokenizer (vocabulary, merges, chat template) so that
llama-cpp-python loads them and stays the oracle. Architectures: llama, qwen2 (Q/K/V biases,
separate output matrix with a bias), qwen3 (per-head Q/K norms), llama-MoE, qwen3moe and deepseek2
(latent attention with or without a Q rank, dense leading layers, shared experts, softmax or
sigmoid gating, a routing bias, expert groups, YaRN); F32 or a quantized type. Also deepseek2
files as llama.cpp's converter writes them (write_converted_deepseek2, CONVERTED_DEEPSEEK2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from kernels.gguf_file import GGUFFile


@dataclass(frozen=True)
class TinyConfig:
    arch: str = "llama"
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx: int = 512
    qtype: str = "F32"  # or Q8_0, Q4_0, Q4_1, Q5_0: used for every matrix
    tied_output: bool = True
    seed: int = 0
    n_expert: int = 0  # > 0: mixture-of-experts FFNs (llama-MoE, or arch "qwen3moe")
    n_expert_used: int = 2
    omit: tuple[str, ...] = ()  # GGUF tensor names left out (a model missing a tensor, for error tests)
    vocab_limit: int = 0  # > 0: only the tokenizer's first N tokens (another vocabulary, for error tests)
    # deepseek2 only (widths are multiples of 32, the quantized types' block size)
    q_rank: int = 32  # 0: one plain attn_q (DeepSeek-V2-Lite style)
    kv_rank: int = 32
    qk_nope: int = 32
    qk_rope: int = 16
    v_head: int = 32
    n_ff_exp: int = 64
    n_dense_lead: int = 1
    n_shared: int = 1
    sigmoid_gating: bool = False  # DeepSeek-V3 / Kimi K2: sigmoid, a routing bias, normalised weights
    n_groups: int = 0  # > 1: group-limited routing
    n_group_used: int = 0
    weights_scale: float = 0.0
    yarn: bool = False  # YaRN RoPE scaling with DeepSeek's log multiplier
    unsplit_kv_b: bool = False  # an older conversion: one attn_kv_b, full K/V heads in the cache
    nextn: bool = False  # one multi-token-prediction layer after the n_layer (DeepSeek-V3's MTP module)
    echo: bool = False  # F32, untied: a model that says a fixed token after each token, and a nextn layer that knows it (_echo)
    extra_keys: tuple[tuple[str, int], ...] = ()  # more "{arch}.{key}" u32 metadata (e.g. nextn_predict_layers)
    chat_template: str = ""  # "": the tokenizer source's

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                  "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path, limit: int = 0, chat_template: str = "") -> int:
    with GGUFFile(source) as src:
        tokens = list(src.get("tokenizer.ggml.tokens"))[:limit or None]
        writer.add_tokenizer_model(src.get("tokenizer.ggml.model"))
        writer.add_tokenizer_pre(src.get("tokenizer.ggml.pre"))
        writer.add_token_list(tokens)
        writer.add_token_types([int(t) for t in src.get("tokenizer.ggml.token_type")][:len(tokens)])
        merges = list(src.get("tokenizer.ggml.merges"))
        if limit:  # only merges of the tokens kept (every node of a simulated swarm parses them all)
            known = set(tokens)
            merges = [m for m in merges if all(part in known for part in (*m.split(" ", 1), m.replace(" ", "")))]
        writer.add_token_merges(merges)
        writer.add_bos_token_id(int(src.get("tokenizer.ggml.bos_token_id")))
        writer.add_eos_token_id(int(src.get("tokenizer.ggml.eos_token_id")))
        writer.add_add_bos_token(bool(src.get("tokenizer.ggml.add_bos_token", False)))
        template = chat_template or src.get("tokenizer.chat_template")
        if template:
            writer.add_chat_template(template)
        return len(tokens)


def write_tiny_model(path: Path, cfg: TinyConfig, tokenizer_source: Path) -> Path:
    rng = np.random.default_rng(cfg.seed)
    writer = gguf.GGUFWriter(str(path), cfg.arch)
    writer.add_name(f"tiny-{cfg.arch}-{cfg.qtype}")
    n_vocab = _copy_tokenizer(writer, tokenizer_source, cfg.vocab_limit, cfg.chat_template)
    writer.add_context_length(cfg.n_ctx)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_block_count(cfg.n_layer + cfg.nextn)
    writer.add_feed_forward_length(cfg.n_ff)
    writer.add_head_count(cfg.n_head)
    # deepseek2's split MLA caches one shared latent "head"; its unsplit form full heads
    writer.add_head_count_kv((cfg.n_head if cfg.unsplit_kv_b else 1) if cfg.arch == "deepseek2" else cfg.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(n_vocab)
    if cfg.arch in ("qwen3", "qwen3moe"):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    for key, value in cfg.extra_keys:
        writer.add_uint32(f"{cfg.arch}.{key}", value)
    if cfg.nextn:
        writer.add_uint32(f"{cfg.arch}.nextn_predict_layers", 1)
    if cfg.arch == "deepseek2":
        _add_deepseek2_metadata(writer, cfg)
    elif cfg.n_expert:
        writer.add_expert_count(cfg.n_expert)
        writer.add_expert_used_count(cfg.n_expert_used)
        if cfg.arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.n_ff)
    qtype = gguf.GGMLQuantizationType[cfg.qtype]

    held: dict[str, np.ndarray] = {}

    def add(name: str, data: np.ndarray, **kwargs) -> None:
        if cfg.echo:
            data = _echo(name, data, held)
        if name not in cfg.omit and data is not None:
            writer.add_tensor(name, data, **kwargs)

    def matrix(name: str, rows: int, cols: int, scale: float | None = None, experts: int = 0) -> None:
        """A [cols, rows(, experts)] ggml tensor (numpy shape ([experts,] rows, cols)), quantized if asked."""
        shape = (experts, rows, cols) if experts else (rows, cols)
        data = rng.standard_normal(shape).astype(np.float32) * (scale or cols ** -0.5)
        if qtype == gguf.GGMLQuantizationType.F32:
            add(name, data)
        else:
            add(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, center: float, spread: float) -> None:
        add(name, (center + spread * rng.standard_normal(n)).astype(np.float32))

    e, q, kv, ff = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_ff
    matrix("token_embd.weight", n_vocab, e, scale=1.0)
    vector("output_norm.weight", e, 1.0, 0.1)
    if not cfg.tied_output:
        matrix("output.weight", n_vocab, e, scale=0.5)
        if cfg.arch == "qwen2":
            vector("output.bias", n_vocab, 0.0, 0.1)
    if cfg.arch == "deepseek2":
        _add_deepseek2_layers(cfg, matrix, vector, add, rng, n_vocab)
    for il in range(cfg.n_layer if cfg.arch != "deepseek2" else 0):
        p = f"blk.{il}."
        vector(p + "attn_norm.weight", e, 1.0, 0.1)
        matrix(p + "attn_q.weight", q, e)
        matrix(p + "attn_k.weight", kv, e)
        matrix(p + "attn_v.weight", kv, e)
        matrix(p + "attn_output.weight", e, q)
        if cfg.arch == "qwen2":
            vector(p + "attn_q.bias", q, 0.0, 0.2)
            vector(p + "attn_k.bias", kv, 0.0, 0.2)
            vector(p + "attn_v.bias", kv, 0.0, 0.2)
        if cfg.arch in ("qwen3", "qwen3moe"):
            vector(p + "attn_q_norm.weight", cfg.head_dim, 1.0, 0.1)
            vector(p + "attn_k_norm.weight", cfg.head_dim, 1.0, 0.1)
        vector(p + "ffn_norm.weight", e, 1.0, 0.1)
        if cfg.n_expert:
            add(p + "ffn_gate_inp.weight",  # the router stays F32, as converters leave it
                (rng.standard_normal((cfg.n_expert, e)) * e ** -0.5).astype(np.float32))
            matrix(p + "ffn_gate_exps.weight", ff, e, experts=cfg.n_expert)
            matrix(p + "ffn_up_exps.weight", ff, e, experts=cfg.n_expert)
            matrix(p + "ffn_down_exps.weight", e, ff, experts=cfg.n_expert)
        else:
            matrix(p + "ffn_gate.weight", ff, e)
            matrix(p + "ffn_up.weight", ff, e)
            matrix(p + "ffn_down.weight", e, ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_deepseek2_metadata(writer: gguf.GGUFWriter, cfg: TinyConfig) -> None:
    """DeepSeek-V3-style keys, as llama.cpp's converter writes them (MLA with split k_b/v_b)."""
    if cfg.unsplit_kv_b:  # full heads: key = no-RoPE part + RoPE part, value = v_head
        writer.add_key_length(cfg.qk_nope + cfg.qk_rope)
        writer.add_value_length(cfg.v_head)
    else:
        writer.add_key_length(cfg.kv_rank + cfg.qk_rope)
        writer.add_value_length(cfg.kv_rank)
        writer.add_key_length_mla(cfg.qk_nope + cfg.qk_rope)
        writer.add_value_length_mla(cfg.v_head)
    writer.add_rope_dimension_count(cfg.qk_rope)
    writer.add_q_lora_rank(cfg.q_rank)
    writer.add_kv_lora_rank(cfg.kv_rank)
    writer.add_leading_dense_block_count(cfg.n_dense_lead)
    writer.add_expert_count(cfg.n_expert)
    writer.add_expert_used_count(cfg.n_expert_used)
    writer.add_expert_feed_forward_length(cfg.n_ff_exp)
    writer.add_expert_shared_count(cfg.n_shared)
    writer.add_expert_weights_scale(cfg.weights_scale)
    writer.add_expert_weights_norm(cfg.sigmoid_gating)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.sigmoid_gating
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.n_groups:
        writer.add_expert_group_count(cfg.n_groups)
        writer.add_expert_group_used_count(cfg.n_group_used)
    if cfg.yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(128)
        writer.add_rope_scaling_yarn_log_mul(0.1)  # 0.1 × mscale_all_dim, as the converter writes it


def _add_deepseek2_layers(cfg: TinyConfig, matrix, vector, add, rng: np.random.Generator, n_vocab: int) -> None:
    e, heads = cfg.n_embd, cfg.n_head
    k_head = cfg.qk_nope + cfg.qk_rope
    for il in range(cfg.n_layer + cfg.nextn):  # (the nextn layer last: the others' weights do not change)
        p = f"blk.{il}."
        vector(p + "attn_norm.weight", e, 1.0, 0.1)
        if cfg.q_rank:
            matrix(p + "attn_q_a.weight", cfg.q_rank, e)
            vector(p + "attn_q_a_norm.weight", cfg.q_rank, 1.0, 0.1)
            matrix(p + "attn_q_b.weight", heads * k_head, cfg.q_rank)
        else:
            matrix(p + "attn_q.weight", heads * k_head, e)
        matrix(p + "attn_kv_a_mqa.weight", cfg.kv_rank + cfg.qk_rope, e)
        vector(p + "attn_kv_a_norm.weight", cfg.kv_rank, 1.0, 0.1)
        if cfg.unsplit_kv_b:
            matrix(p + "attn_kv_b.weight", heads * (cfg.qk_nope + cfg.v_head), cfg.kv_rank)
        else:
            matrix(p + "attn_k_b.weight", cfg.kv_rank, cfg.qk_nope, experts=heads)  # ggml [qk_nope, kv_rank, heads]
            matrix(p + "attn_v_b.weight", cfg.v_head, cfg.kv_rank, experts=heads)  # ggml [kv_rank, v_head, heads]
        matrix(p + "attn_output.weight", e, heads * cfg.v_head)
        vector(p + "ffn_norm.weight", e, 1.0, 0.1)
        if il < cfg.n_dense_lead:
            matrix(p + "ffn_gate.weight", cfg.n_ff, e)
            matrix(p + "ffn_up.weight", cfg.n_ff, e)
            matrix(p + "ffn_down.weight", e, cfg.n_ff)
            continue
        add(p + "ffn_gate_inp.weight", (rng.standard_normal((cfg.n_expert, e)) * e ** -0.5).astype(np.float32))
        if cfg.sigmoid_gating:
            vector(p + "exp_probs_b.bias", cfg.n_expert, 0.0, 0.05)
        matrix(p + "ffn_gate_exps.weight", cfg.n_ff_exp, e, experts=cfg.n_expert)
        matrix(p + "ffn_up_exps.weight", cfg.n_ff_exp, e, experts=cfg.n_expert)
        matrix(p + "ffn_down_exps.weight", e, cfg.n_ff_exp, experts=cfg.n_expert)
        shared = cfg.n_ff_exp * cfg.n_shared
        matrix(p + "ffn_gate_shexp.weight", shared, e)
        matrix(p + "ffn_up_shexp.weight", shared, e)
        matrix(p + "ffn_down_shexp.weight", e, shared)
    if cfg.nextn:  # its own projection, norms and head; the embedding is the model's (as GLM's files leave it)
        p = f"blk.{cfg.n_layer}.nextn."
        matrix(p + "eh_proj.weight", e, 2 * e)
        vector(p + "enorm.weight", e, 1.0, 0.1)
        vector(p + "hnorm.weight", e, 1.0, 0.1)
        vector(p + "shared_head_norm.weight", e, 1.0, 0.1)
        matrix(p + "shared_head_head.weight", n_vocab, e, scale=0.5)


def _echo(name: str, data: np.ndarray, held: dict[str, np.ndarray]) -> np.ndarray | None:
    """A model whose layers barely touch the residual stream (their output matrices scaled by
    1e-3) and whose output head is the embedding with its rows permuted, so after token t it says
    the token whose head row is t's embedding, whatever came before; and a nextn layer that takes
    the token alone ([I | 0] projection, unit norm, the model's output norm and head), so it
    predicts what the model will say after the token it is given. Drafts from it are kept only
    when positions, tokens and hidden states line up as they should (a wiring check for mtp)."""
    held[name] = data
    if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")):
        return data * np.float32(1e-3)
    if name == "output.weight":
        embedding = held["token_embd.weight"]
        return embedding[np.random.default_rng(0).permutation(len(embedding))]
    if name.endswith("nextn.eh_proj.weight"):
        e = data.shape[0]
        return np.hstack([np.eye(e), np.zeros((e, e))]).astype(np.float32)  # [embedding; hidden] → embedding
    if name.endswith("nextn.enorm.weight"):
        return np.ones_like(data)
    if name.endswith("nextn.shared_head_norm.weight"):
        return held["output_norm.weight"]
    if name.endswith("nextn.shared_head_head.weight"):
        return None  # the model's own head (a file may leave it out)
    return data


# --- deepseek2 files as llama.cpp's converter writes them ------------------------------------------
# convert_hf_to_gguf.py at the commit llama-cpp-python 0.3.36 vendors (vendor/llama.cpp in its sdist):
# conversion/deepseek.py's DeepseekV2Model (set_vocab, set_gguf_parameters, modify_tensors) over
# conversion/base.py's TextModel (set_gguf_parameters, filter_tensors, prepare_tensors' tensor types).
# A tiny Hugging Face checkpoint (config.json's fields, random weights under their HF names) goes
# through the same steps, so the file has the converter's key names, value types, tensor names,
# shapes and types, not ours.


@dataclass(frozen=True)
class HFConfig:
    """The config.json fields DeepseekV2Model reads (DeepseekV3ForCausalLM's; Kimi K2's is one), at
    tiny widths. The defaults are Kimi-K2-Instruct's choices; DEEPSEEK_V3_HF has DeepSeek-V3's."""
    num_hidden_layers: int = 4
    hidden_size: int = 64
    intermediate_size: int = 128  # the dense leading layers' FFN
    moe_intermediate_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 4  # the checkpoint's (= heads); the file says 1: MLA runs as MQA
    q_lora_rank: int | None = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float | None = 2.827
    rope_theta: float = 50000.0
    # rope_scaling: (type, factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim)
    rope_scaling: tuple = ("yarn", 32.0, 4096, 1.0, 1.0, 1.0, 1.0)
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 0  # Kimi K2: 0; DeepSeek-V3: 1 (model.layers.61)


DEEPSEEK_V3_HF = HFConfig(first_k_dense_replace=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          rope_theta=10000.0, rope_scaling=("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0),
                          max_position_embeddings=163840, num_nextn_predict_layers=1)

KIMI_K2_VOCAB = 163840
# Kimi K2's named special tokens (its tokenizer_config.json); the rest of ids 163584-163839 are
# "<|reserved_token_N|>", all of them in its tokenizer's special_tokens
KIMI_K2_SPECIALS = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
                    163588: "<|im_assistant|>", 163590: "<|start_header_id|>", 163591: "<|end_header_id|>",
                    163593: "[EOT]", 163594: "<|im_system|>", 163595: "<|tool_calls_section_begin|>",
                    163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
                    163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>"}
KIMI_CHAT_TEMPLATE = ("{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
                      "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
                      "{% endif %}")  # Kimi K2's turn format, abridged (no tools, no default system turn)

# gguf-py's tensor map for deepseek2 (tensor_mapping.py), the part a DeepSeek-V3 checkpoint uses:
# HF name (within a layer) → GGUF name; the converter renames e_score_correction_bias first
_HF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "self_attn.k_b_proj": "attn_k_b", "self_attn.v_b_proj": "attn_v_b",
    "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.gate.e_score_correction": "exp_probs_b",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
    # the multi-token-prediction block's own (model.layers.61 in DeepSeek-V3)
    "embed_tokens": "nextn.embed_tokens", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm",
    "eh_proj": "nextn.eh_proj", "shared_head.norm": "nextn.shared_head_norm",
    "shared_head.head": "nextn.shared_head_head",
}
_HF_MODEL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
               "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def gguf_name_of(hf_name: str) -> str:
    """The GGUF name the converter gives a (filtered) HF tensor name."""
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        bid, rest = base[len("model.layers."):].split(".", 1)
        return f"blk.{bid}.{_HF_LAYER_NAMES[rest]}.{suffix}"
    return f"{_HF_MODEL_NAMES[base]}.{suffix}"


def write_converted_deepseek2(path: Path, hf: HFConfig, tokenizer_source: Path, *, outtype: str = "Q8_0",
                              kimi_vocab: bool = False, keep_mtp: bool = False, legacy_kv_b: bool = False,
                              seed: int = 0) -> Path:
    """A tiny deepseek2 GGUF as ``convert_hf_to_gguf.py --outtype {f32,f16,q8_0}`` writes one.

    ``kimi_vocab``: set_vocab's kimi-k2 branch: 163840 entries, pre-tokenizer "kimi-k2", ids the
    tokenizer lacks as "[PAD{i}]" (UNUSED), special ids CONTROL. The tiktoken ranks are stood in for
    by ``tokenizer_source``'s byte-level BPE (its tokens and merges keep their ids).
    ``keep_mtp``: the converter skips the MTP block (``skip_mtp``); kept, it is written the way
    DeepseekV32Model writes its own: block_count counts it, ``nextn_predict_layers`` says how many,
    and ``blk.N.*`` carries the whole block with its ``nextn.*`` tensors.
    ``legacy_kv_b``: the converter before the k_b/v_b split (early-2025 files): one ``attn_kv_b``,
    head_count_kv = the heads, key/value lengths of full heads, no ``*_mla`` keys.
    """
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"tiny-deepseek2-converted-{outtype}")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if kimi_vocab:
        n_vocab = _add_kimi_vocab(writer, tokenizer_source)
    else:  # _set_vocab_gpt2: the source's tokens, merges and special ids
        n_vocab = _copy_tokenizer(writer, tokenizer_source)
    n_mtp = hf.num_nextn_predict_layers if keep_mtp else 0
    _add_converted_keys(writer, hf, n_vocab, n_mtp, legacy_kv_b, outtype)
    qtype = gguf.GGMLQuantizationType[outtype]
    for name, data in _converted_tensors(hf, _hf_checkpoint(hf, n_vocab, rng), n_mtp, legacy_kv_b):
        _add_converted_tensor(writer, name, data, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_kimi_vocab(writer: gguf.GGUFWriter, source: Path) -> int:
    with GGUFFile(source) as src:
        tokens = list(src.get("tokenizer.ggml.tokens"))
        types = [int(t) for t in src.get("tokenizer.ggml.token_type")]
        merges = list(src.get("tokenizer.ggml.merges"))
    # the ranks' stand-in is the source's byte-level tokens; its own special tokens are not ranks
    # (and would clash with Kimi's: llama.cpp aborts on a repeated token), so their ids go unused
    for i, kind in enumerate(types):
        if kind != gguf.TokenType.NORMAL:
            tokens[i], types[i] = f"[PAD{i}]", gguf.TokenType.UNUSED
    first_special = KIMI_K2_VOCAB - 256
    for i in range(len(tokens), KIMI_K2_VOCAB):
        special = i >= first_special
        tokens.append(KIMI_K2_SPECIALS.get(i, f"<|reserved_token_{i}|>") if special else f"[PAD{i}]")
        types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("kimi-k2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(163584)  # SpecialVocab: [BOS], [EOS]
    writer.add_eos_token_id(163585)
    writer.add_chat_template(KIMI_CHAT_TEMPLATE)
    return len(tokens)


def _add_converted_keys(writer: gguf.GGUFWriter, hf: HFConfig, n_vocab: int, n_mtp: int, legacy_kv_b: bool,
                        outtype: str) -> None:
    """TextModel.set_gguf_parameters, then DeepseekV2Model's, with their conditions."""
    writer.add_block_count(hf.num_hidden_layers + n_mtp)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads if legacy_kv_b else 1)
    kind, factor, orig_ctx, beta_fast, beta_slow, _mscale, mscale_all_dim = hf.rope_scaling
    if kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(orig_ctx)
        writer.add_rope_scaling_yarn_beta_fast(beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(beta_slow)
    writer.add_rope_freq_base(hf.rope_theta)
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_expert_count(hf.n_routed_experts)
    writer.add_expert_used_count(hf.num_experts_per_tok)
    writer.add_expert_group_count(hf.n_group)
    writer.add_expert_group_used_count(hf.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if hf.scoring_func == "sigmoid"
                                  else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_file_type(_FILE_TYPES[outtype])
    if n_mtp:
        writer.add_nextn_predict_layers(n_mtp)
    writer.add_leading_dense_block_count(hf.first_k_dense_replace)
    writer.add_vocab_size(n_vocab)
    if hf.q_lora_rank is not None:
        writer.add_q_lora_rank(hf.q_lora_rank)
    writer.add_kv_lora_rank(hf.kv_lora_rank)
    if legacy_kv_b:
        writer.add_key_length(hf.qk_nope_head_dim + hf.qk_rope_head_dim)
        writer.add_value_length(hf.v_head_dim)
    else:  # "MQA with larger heads": the cached latent + RoPE part, then the MLA heads' own widths
        writer.add_key_length(hf.kv_lora_rank + hf.qk_rope_head_dim)
        writer.add_value_length(hf.kv_lora_rank)
        writer.add_key_length_mla(hf.qk_nope_head_dim + hf.qk_rope_head_dim)
        writer.add_value_length_mla(hf.v_head_dim)
    writer.add_expert_feed_forward_length(hf.moe_intermediate_size)
    writer.add_expert_shared_count(hf.n_shared_experts)
    if hf.routed_scaling_factor is not None:
        writer.add_expert_weights_scale(hf.routed_scaling_factor)
    if hf.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(hf.qk_rope_head_dim)
    if kind == "yarn":  # written as 0.1 × mscale_all_dim [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)


def _hf_checkpoint(hf: HFConfig, n_vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under their Hugging Face names and shapes ([out, in]), the MTP block included
    (its embed_tokens and shared_head.head copies of the model's, as DeepSeek-V3 ships them)."""
    w: dict[str, np.ndarray] = {}

    def mat(name: str, out: int, inp: int, scale: float | None = None) -> None:
        w[name] = (rng.standard_normal((out, inp)) * (scale or inp ** -0.5)).astype(np.float32)

    def vec(name: str, n: int, center: float = 1.0, spread: float = 0.1) -> None:
        w[name] = (center + spread * rng.standard_normal(n)).astype(np.float32)

    e, heads, k_head = hf.hidden_size, hf.num_attention_heads, hf.qk_nope_head_dim + hf.qk_rope_head_dim
    mat("model.embed_tokens.weight", n_vocab, e, scale=1.0)
    for il in range(hf.num_hidden_layers + hf.num_nextn_predict_layers):
        p = f"model.layers.{il}."
        vec(p + "input_layernorm.weight", e)
        if hf.q_lora_rank is not None:
            mat(p + "self_attn.q_a_proj.weight", hf.q_lora_rank, e)
            vec(p + "self_attn.q_a_layernorm.weight", hf.q_lora_rank)
            mat(p + "self_attn.q_b_proj.weight", heads * k_head, hf.q_lora_rank)
        else:
            mat(p + "self_attn.q_proj.weight", heads * k_head, e)
        mat(p + "self_attn.kv_a_proj_with_mqa.weight", hf.kv_lora_rank + hf.qk_rope_head_dim, e)
        vec(p + "self_attn.kv_a_layernorm.weight", hf.kv_lora_rank)
        mat(p + "self_attn.kv_b_proj.weight", heads * (hf.qk_nope_head_dim + hf.v_head_dim), hf.kv_lora_rank)
        mat(p + "self_attn.o_proj.weight", e, heads * hf.v_head_dim)
        vec(p + "post_attention_layernorm.weight", e)
        if il < hf.first_k_dense_replace:
            mat(p + "mlp.gate_proj.weight", hf.intermediate_size, e)
            mat(p + "mlp.up_proj.weight", hf.intermediate_size, e)
            mat(p + "mlp.down_proj.weight", e, hf.intermediate_size)
        else:
            mat(p + "mlp.gate.weight", hf.n_routed_experts, e)
            if hf.scoring_func == "sigmoid":
                vec(p + "mlp.gate.e_score_correction_bias", hf.n_routed_experts, 0.0, 0.05)
            for x in range(hf.n_routed_experts):
                mat(p + f"mlp.experts.{x}.gate_proj.weight", hf.moe_intermediate_size, e)
                mat(p + f"mlp.experts.{x}.up_proj.weight", hf.moe_intermediate_size, e)
                mat(p + f"mlp.experts.{x}.down_proj.weight", e, hf.moe_intermediate_size)
            shared = hf.moe_intermediate_size * hf.n_shared_experts
            mat(p + "mlp.shared_experts.gate_proj.weight", shared, e)
            mat(p + "mlp.shared_experts.up_proj.weight", shared, e)
            mat(p + "mlp.shared_experts.down_proj.weight", e, shared)
        if il >= hf.num_hidden_layers:
            w[p + "embed_tokens.weight"] = w["model.embed_tokens.weight"]
            vec(p + "enorm.weight", e)
            vec(p + "hnorm.weight", e)
            mat(p + "eh_proj.weight", e, 2 * e)
            vec(p + "shared_head.norm.weight", e)
    vec("model.norm.weight", e)
    if not hf.tie_word_embeddings:
        mat("lm_head.weight", n_vocab, e, scale=0.5)
        for il in range(hf.num_hidden_layers, hf.num_hidden_layers + hf.num_nextn_predict_layers):
            w[f"model.layers.{il}.shared_head.head.weight"] = w["lm_head.weight"]
    return w


def _converted_tensors(hf: HFConfig, checkpoint: dict[str, np.ndarray], n_mtp: int, legacy_kv_b: bool):
    """(GGUF name, data) as filter_tensors + DeepseekV2Model.modify_tensors yield them: the tied
    head and the MTP block skipped, each layer's experts stacked into one [n_expert, out, in]
    tensor, kv_b split into k_b (transposed) and v_b."""
    experts: dict[int, dict[str, np.ndarray]] = {}
    for name, data in checkpoint.items():
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        bid = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if hf.tie_word_embeddings and name == "lm_head.weight":
            continue
        if bid is not None and bid >= hf.num_hidden_layers + n_mtp:  # skip_mtp
            continue
        if ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = data
            if len(experts[bid]) < 3 * hf.n_routed_experts:
                continue
            for w_name in ("down_proj", "gate_proj", "up_proj"):
                stacked = np.stack([experts[bid][f"model.layers.{bid}.mlp.experts.{x}.{w_name}.weight"]
                                    for x in range(hf.n_routed_experts)])
                yield gguf_name_of(f"model.layers.{bid}.mlp.experts.{w_name}.weight"), stacked
            continue
        if name.endswith("kv_b_proj.weight") and not legacy_kv_b:
            nope, v_head = hf.qk_nope_head_dim, hf.v_head_dim
            kv_b = data.reshape(hf.num_key_value_heads, nope + v_head, data.shape[-1])
            k_b, v_b = kv_b[:, :nope], kv_b[:, nope:]
            yield gguf_name_of(name.replace("kv_b_proj", "k_b_proj")), np.ascontiguousarray(k_b.transpose(0, 2, 1))
            yield gguf_name_of(name.replace("kv_b_proj", "v_b_proj")), np.ascontiguousarray(v_b)
            continue
        yield gguf_name_of(name), data


def _add_converted_tensor(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype) -> None:
    """prepare_tensors' choice of type: vectors, norms, biases and the router in F32, every other
    matrix at the outtype (F16 where a row does not divide into blocks)."""
    if data.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name or not name.endswith(".weight"):
        qtype = gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        try:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        except gguf.QuantError:
            writer.add_tensor(name, data.astype(np.float16))


# The converted files the tests use, by name: keyword arguments of write_converted_deepseek2.
CONVERTED_DEEPSEEK2 = {
    # DeepSeek-V3 as the converter writes it today: split k_b/v_b, no MTP block
    "deepseek-v3": dict(hf=DEEPSEEK_V3_HF, seed=31),
    # the same checkpoint with its MTP block kept (nextn_predict_layers 1, blk.4.nextn.*)
    "deepseek-v3-mtp": dict(hf=DEEPSEEK_V3_HF, keep_mtp=True, seed=31),
    # the same checkpoint as the converter wrote it before the split: attn_kv_b only
    "deepseek-v3-kv-b": dict(hf=DEEPSEEK_V3_HF, legacy_kv_b=True, seed=31),
    # DeepSeek-V2-Lite: no Q rank (the converter then writes no q_lora_rank key, which llama.cpp
    # accepts only from a 26- or 27-layer file: V2-Lite has 27), softmax gating, weights not
    # normalised, scale 1, two shared experts, YaRN ×40 with mscale_all_dim 0.707
    "deepseek-v2-lite": dict(hf=HFConfig(num_hidden_layers=27, q_lora_rank=None, scoring_func="softmax",
                                         norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=2,
                                         rope_theta=10000.0, rope_scaling=("yarn", 40.0, 4096, 32.0, 1.0, 0.707, 0.707),
                                         max_position_embeddings=163840), seed=33),
    # Kimi K2 mainline: one group, scale 2.827, YaRN ×32 from 4096 with beta 1/1, 163840 tokens, no MTP
    "kimi-k2": dict(hf=HFConfig(), kimi_vocab=True, seed=32),
}


def write_unsupported_model(path: Path, arch: str = "bert") -> Path:
    """A well-formed GGUF of an architecture we do not run."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_split_copy(source: Path, dest: Path, n_parts: int) -> list[Path]:
    """``source`` rewritten as ``n_parts`` parts the way llama.cpp's converter splits a model
    (gguf's own writer with ``split_max_tensors``: ``DEST-00001-of-0000N.gguf`` ..., the metadata in
    the first part, ``split.*`` keys in every part). Returns the parts in order."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    per_part = -(-len(reader.tensors) // n_parts)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dest), arch, split_max_tensors=per_part)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment") or key.startswith("split."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = [dest.with_name(f"{dest.stem}-{i:05d}-of-{n_parts:05d}.gguf") for i in range(1, n_parts + 1)]
    missing = [part for part in parts if not part.exists()]
    if missing:
        raise RuntimeError(f"the writer did not write {missing[0]} (too few tensors for {n_parts} parts?)")
    return parts


# The tiny models the tests (and benchmarks) use, by name: tests/conftest.py's tiny_model(name).
TINY_CONFIGS = {
    "llama-f32": TinyConfig(arch="llama", qtype="F32"),
    "llama-q8_0": TinyConfig(arch="llama", qtype="Q8_0", seed=1),
    "qwen2-f32": TinyConfig(arch="qwen2", qtype="F32", tied_output=False, seed=2),
    "qwen2-q4_1": TinyConfig(arch="qwen2", qtype="Q4_1", tied_output=False, seed=3),
    "qwen3-q8_0": TinyConfig(arch="qwen3", qtype="Q8_0", seed=4),
    "qwen3-f32": TinyConfig(arch="qwen3", qtype="F32", n_head=2, n_head_kv=1, seed=5),
    "llama-moe-q8_0": TinyConfig(arch="llama", qtype="Q8_0", n_expert=8, n_expert_used=2, seed=6),
    "qwen3moe-q8_0": TinyConfig(arch="qwen3moe", qtype="Q8_0", n_expert=8, n_expert_used=2, seed=7),
    # deepseek2 (DeepSeek-V2/V3, Kimi K2): latent attention, dense leading layers, shared experts
    "deepseek2-f32": TinyConfig(arch="deepseek2", qtype="F32", n_expert=8, n_expert_used=2, n_dense_lead=2,
                                seed=11),  # V2: Q rank, softmax gating, weights not normalised
    "deepseek2-q8_0": TinyConfig(arch="deepseek2", qtype="Q8_0", q_rank=0, n_expert=8, n_expert_used=2,
                                 sigmoid_gating=True, n_groups=4, n_group_used=2, weights_scale=2.5, yarn=True,
                                 seed=12),  # V2-Lite's plain attn_q with V3's routing and YaRN
    "deepseek2-q4_1": TinyConfig(arch="deepseek2", qtype="Q4_1", n_expert=8, n_expert_used=2, sigmoid_gating=True,
                                 n_groups=4, n_group_used=2, seed=13),  # V3 / Kimi K2
    "deepseek2-unsplit-q8_0": TinyConfig(arch="deepseek2", qtype="Q8_0", n_expert=8, n_expert_used=2,
                                         unsplit_kv_b=True, seed=14),  # an older conversion's attn_kv_b
    "deepseek2-echo-f32": TinyConfig(arch="deepseek2", qtype="F32", n_expert=8, n_expert_used=2, sigmoid_gating=True,
                                     n_groups=4, n_group_used=2, tied_output=False, nextn=True, echo=True, seed=15),
    "deepseek2-mtp-q4_1": TinyConfig(arch="deepseek2", qtype="Q4_1", n_expert=8, n_expert_used=2, sigmoid_gating=True,
                                     n_groups=4, n_group_used=2, seed=13, nextn=True),  # V3 with its MTP layer
}

# Not tiny: Kimi K2's per-layer shapes with 4 layers and 16 experts (issue 33 item 4), so each token
# reads the bytes a Kimi layer reads; about 3.7 GB at Q8_0. For benchmarks (bench_plan_vs_measured),
# written on demand: no test writes it.
KIMI_WIDTH = TinyConfig(arch="deepseek2", qtype="Q8_0", n_layer=4, n_embd=7168, n_head=64, n_ff=18432, n_ctx=4096, q_rank=1536,
                        kv_rank=512, qk_nope=128, qk_rope=64, v_head=128, n_ff_exp=2048, n_expert=16, n_expert_used=8,
                        n_dense_lead=1, n_shared=1, sigmoid_gating=True, weights_scale=2.827, seed=21)
# Llama 3.2 1B's shapes (n_embd 2048, 16 layers, 32 heads of which 8 for K/V, FFN 8192) with the
# bundled model's vocabulary and tied output, Q8_0: ~1.1 GB, the "~1B llama-shaped model" issue 33
# checks the planner on beside the Kimi-width one (benchmarks/bench_plan_vs_measured.py --shape).
LLAMA_1B = TinyConfig(arch="llama", qtype="Q8_0", n_layer=16, n_embd=2048, n_head=32, n_head_kv=8, n_ff=8192,
                      n_ctx=4096, seed=23)
# As wide as Kimi K2 (7168) and otherwise thin (two heads of rank-32 latent attention, a 64-wide
# dense FFN): a prompt's crossings cost what a Kimi trunk's do and its compute next to nothing
# (bench_swarm section j: f16 against f32 activations over capped links).
WIDE_THIN = TinyConfig(arch="deepseek2", qtype="Q8_0", n_layer=4, n_embd=7168, n_head=2, n_ff=64, n_ctx=4096, q_rank=32,
                       kv_rank=32, qk_nope=32, qk_rope=32, v_head=32, n_dense_lead=4, n_expert=0, n_shared=0, seed=22)
