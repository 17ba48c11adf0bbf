"""Tiny random-weight GGUF models written with ``gguf.GGUFWriter``, for tests.

They carry the bundled model's tokenizer (vocabulary, merges, chat template) so that
llama-cpp-python loads them and stays the oracle. Architectures: llama, qwen2 (Q/K/V biases,
separate output matrix with a bias), qwen3 (per-head Q/K norms), llama-MoE, qwen3moe and deepseek2
(latent attention with or without a Q rank, dense leading layers, shared experts, softmax or
sigmoid gating, a routing bias, expert groups, YaRN); F32 or a quantized type.
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
        writer.add_token_merges(src.get("tokenizer.ggml.merges"))
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
