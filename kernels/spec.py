"""Model hyper-parameters read from GGUF metadata, and the slice of layers a node runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .archs import Architecture, Block, LayerTensor, architecture_for
from .cmath import f32, get_mscale, logf
from .errors import ModelFileError, SliceRangeError, UnsupportedModelError
from .gguf_file import GGUFFile

KV_CELL_PAD = 256  # llama.cpp pads the attended KV length to this; we mirror it for identical bits
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's llama_expert_gating_func_type values
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's llama_hparams defaults


@dataclass(frozen=True)
class RopeConfig:
    """Arguments of ggml_rope_ext, resolved the way llama.cpp's context resolves them."""

    mode: int
    n_dims: int
    freq_base: float
    freq_scale: float
    n_ctx_orig: int
    ext_factor: float
    attn_factor: float
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2; llama.cpp's MLA with the absorption
    optimisation). K and V are projected down to one shared latent of ``kv_rank`` values per token
    (plus ``n_rot`` RoPE values); the cache keeps only that latent, and each head's keys and values
    are recovered from it through ``attn_k_b`` / ``attn_v_b`` inside attention."""

    q_rank: int  # Q's low rank (attn_q_a → attn_q_b); 0: one plain attn_q
    kv_rank: int  # the compressed latent's width
    k_head: int  # a head's key width: the no-RoPE part + the RoPE part (192 in DeepSeek-V3)
    v_head: int  # a head's value width (128)
    n_rot: int  # the decoupled RoPE part (64)
    absorbed: bool = True  # split attn_k_b / attn_v_b: the cache holds the latent. False: an older
    # conversion's unsplit attn_kv_b, decompressed into full heads of K and V before the cache

    @property
    def qk_nope(self) -> int:
        return self.k_head - self.n_rot


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # general.architecture; its record is ``arch``
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    norm_eps: float
    attention_scale: float
    rope: RopeConfig
    layer_bytes: tuple[int, ...]  # bytes of each layer's tensors, as stored
    embedding_bytes: int
    lm_head_bytes: int  # output norm + output matrix (the embedding again, when tied)
    tied_embeddings: bool
    n_expert: int = 0  # experts per MoE layer (0: a dense model)
    n_expert_used: int = 0  # experts each token goes to (top-k)
    n_ff_exp: int = 0  # an expert's FFN width
    expert_weights_scale: float = 0.0  # 0 or 1: the router weights are used as they are
    expert_gating: int = GATING_SOFTMAX  # GATING_SOFTMAX or GATING_SIGMOID (llama.cpp's expert_gating_func)
    expert_weights_norm: bool = True  # the top-k weights are divided by their sum
    n_expert_groups: int = 0  # > 1: experts come in groups and only the best n_group_used groups compete
    n_group_used: int = 0
    n_expert_shared: int = 0  # shared experts every token runs through (they stay with the stage)
    n_layer_dense_lead: int = 0  # the first layers have a dense FFN, the rest experts (DeepSeek)
    mla: LatentAttention | None = None  # latent attention: the KV cache holds the latent, no V
    head_dim_v: int = 0  # a value head's width where it differs from a key head's (0: the same)
    n_nextn: int = 0  # multi-token-prediction (nextn) layers after the n_layer (DeepSeek-V3's, GLM's)
    layer_expert_bytes: tuple[int, ...] = ()  # of layer_bytes, each layer's routed experts (empty: none)

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def kv_widths(self) -> tuple[int, int]:
        """(K, V) values per token per layer in the cache. Latent attention keeps no V: its values
        are the first ``kv_rank`` values of each K row, as llama.cpp's MLA cache does."""
        if self.mla and self.mla.absorbed:
            return self.n_embd_kv, 0
        return self.n_embd_kv, self.n_head_kv * (self.head_dim_v or self.head_dim)

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * sum(self.kv_widths)  # f16

    def is_moe_layer(self, il: int) -> bool:
        return self.n_expert > 0 and il >= self.n_layer_dense_lead

    @property
    def moe_layers(self) -> range:
        return range(self.n_layer_dense_lead, self.n_layer) if self.n_expert else range(0)

    def ffn_for(self, il: int) -> Block:
        """Layer ``il``'s feed-forward half: dense, or a mixture of experts."""
        return self.arch.feed_forward(self.n_expert if self.is_moe_layer(il) else 0)

    def layer_tensors(self, il: int) -> tuple[LayerTensor, ...]:
        """Every tensor layer ``il`` has, attention half first."""
        return self.arch.attention.tensors + self.ffn_for(il).tensors

    @property
    def arch(self) -> Architecture:
        """The architecture's record (kernels.archs): its tensors and builders."""
        return architecture_for(self.architecture)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> "ModelSpec":
        arch = gguf.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{gguf.path}: no general.architecture in GGUF metadata")
        record = architecture_for(arch)

        def key(name: str, default=None, *, required: bool = False):
            value = gguf.get(f"{arch}.{name}", default)
            if value is None and required:
                raise ModelFileError(f"{gguf.path}: missing metadata {arch}.{name}")
            return value

        # multi-token-prediction layers (DeepSeek-V3's, GLM's) follow the trunk; llama.cpp leaves them out
        n_nextn = int(key("nextn_predict_layers", 0) or 0)
        n_layer = int(key("block_count", required=True)) - n_nextn
        if n_layer < 1:
            raise ModelFileError(f"{gguf.path}: no layers besides the multi-token-prediction ones")
        n_embd = int(key("embedding_length", required=True))
        n_head = int(key("attention.head_count", required=True))
        n_head_kv = int(key("attention.head_count_kv", n_head))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        n_vocab = key("vocab_size") or gguf.array_length("tokenizer.ggml.tokens")
        if not n_vocab:
            if "token_embd.weight" not in gguf.tensors:
                raise ModelFileError(f"{gguf.path}: cannot tell the vocabulary size")
            n_vocab = gguf.tensors["token_embd.weight"].shape[1]
        n_ctx_train = int(key("context_length", 4096))
        n_expert = int(key("expert_count", 0) or 0)
        record.feed_forward(n_expert)  # refuses experts the architecture has no layers for, or their absence
        rope = _rope_config(gguf, record, head_dim, n_ctx_train)
        attention_scale = float(key("attention.scale", 0.0) or 0.0) or 1.0 / math.sqrt(head_dim)

        layer_bytes, expert_bytes = [0] * n_layer, [0] * n_layer
        for info in gguf.tensors.values():
            il = layer_of(info.name)
            if il is not None and il < n_layer:
                layer_bytes[il] += info.n_bytes
                if "_exps." in info.name:
                    expert_bytes[il] += info.n_bytes
        # A slice file (written by slice distribution) holds some layers and none of the ends.
        is_slice = gguf.get("swarmctl.slice.start") is not None
        if "token_embd.weight" not in gguf.tensors and not is_slice:
            raise ModelFileError(f"{gguf.path}: tensor token_embd.weight is missing")
        embd = gguf.tensors.get("token_embd.weight")
        embedding_bytes = embd.n_bytes if embd else 0
        tied = "output.weight" not in gguf.tensors
        out = gguf.tensors.get("token_embd.weight" if tied else "output.weight")
        norm = gguf.tensors.get("output_norm.weight")
        lm_head_bytes = (out.n_bytes if out else 0) + (norm.n_bytes if norm else 0)

        spec = cls(
            architecture=arch,
            n_layer=n_layer,
            n_nextn=n_nextn,
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length", 0) or key("expert_feed_forward_length", 0) or 0),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            head_dim_v=int(key("attention.value_length", head_dim) or head_dim),
            n_vocab=int(n_vocab),
            n_ctx_train=n_ctx_train,
            norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            attention_scale=attention_scale,
            rope=rope,
            layer_bytes=tuple(layer_bytes),
            layer_expert_bytes=tuple(expert_bytes) if any(expert_bytes) else (),
            embedding_bytes=embedding_bytes,
            lm_head_bytes=lm_head_bytes,
            tied_embeddings=tied,
            n_expert=n_expert,
            n_expert_used=int(key("expert_used_count", 0) or 0),
            n_ff_exp=int(key("expert_feed_forward_length", 0) or 0),
            expert_weights_scale=float(key("expert_weights_scale", 0.0) or 0.0),
            n_expert_groups=int(key("expert_group_count", 0) or 0),
            n_group_used=int(key("expert_group_used_count", 0) or 0),
        )
        if n_expert and spec.n_expert_groups > 1 and not (
                n_expert % spec.n_expert_groups == 0 and 0 < spec.n_group_used < spec.n_expert_groups):
            raise ModelFileError(f"{gguf.path}: {n_expert} experts do not split into {spec.n_expert_groups} groups "
                                 f"of which {spec.n_group_used} are used")
        # What only this architecture has (latent attention, shared experts, its own gating...).
        return replace(spec, **record.read_hparams(key, spec)) if record.read_hparams else spec


def layer_of(tensor_name: str) -> int | None:
    """'blk.12.attn_q.weight' → 12; tensors outside the layer stack → None."""
    if not tensor_name.startswith("blk."):
        return None
    index = tensor_name.split(".", 2)[1]
    return int(index) if index.isdigit() else None


def _rope_config(gguf: GGUFFile, arch: Architecture, head_dim: int, n_ctx_train: int) -> RopeConfig:
    """RoPE's arguments as llama.cpp's context resolves them (llama-context.cpp), in float32."""
    def key(name: str, default):
        value = gguf.get(f"{arch.name}.rope.{name}", default)
        return default if value is None else value

    scaling_type = str(key("scaling.type", "none"))
    factor = float(key("scaling.factor", 0.0))
    # llama.cpp: a scaling type of "none" never scales; otherwise freq_scale = 1 / factor.
    freq_scale = f32(1.0) / f32(factor) if scaling_type != "none" and factor > 0 else f32(1.0)
    yarn = scaling_type == "yarn"
    log_mul = f32(float(key("scaling.yarn_log_multiplier", 0.0)))
    if yarn and log_mul and not arch.yarn_log_multiplier:
        raise UnsupportedModelError(f"YaRN with a log multiplier is not supported for '{arch.name}'")
    attn_factor = f32(1.0)
    if yarn:
        scale = f32(1.0) / freq_scale
        if log_mul:
            # DeepSeek's converter writes 0.1 × mscale_all_dim; llama.cpp divides the 0.1 back out,
            # and with mscale = mscale_all_dim the two get_mscale factors cancel.
            mscale_all = log_mul / f32(0.1)
            attn_factor = get_mscale(scale, mscale_all) / get_mscale(scale, mscale_all)
        else:
            attn_factor = get_mscale(scale, f32(1.0))
        attn_factor = attn_factor * (f32(1.0) / (f32(1.0) + f32(0.1) * logf(scale)))
    attn_factor = attn_factor * f32(float(key("scaling.attn_factor", 1.0)))
    return RopeConfig(
        mode=arch.rope_mode,
        n_dims=int(key("dimension_count", head_dim)),
        freq_base=float(key("freq_base", 10000.0)),
        freq_scale=float(freq_scale),
        n_ctx_orig=int(key("scaling.original_context_length", n_ctx_train)),
        ext_factor=1.0 if yarn else 0.0,
        attn_factor=float(attn_factor),
        # llama.cpp's YaRN betas, whatever the file says: the loaders of the architectures we run
        # do not read rope.scaling.yarn_beta_fast/slow (only grok's and mistral3's do), and
        # llama-cpp-python passes 32 and 1 anyway. Kimi K2's files say 1 and 1 (its config.json's).
        beta_fast=YARN_BETA_FAST,
        beta_slow=YARN_BETA_SLOW,
    )


@dataclass(frozen=True)
class SliceSpec:
    """What one node runs: layers [start, stop), plus the embedding and/or the LM head; or, with
    ``nextn``, the model's multi-token-prediction layer (``SliceSpec.nextn_of``): one more block
    after the last, fed a token's embedding and the final hidden state of the position before it,
    with its own LM head (speculative drafts at the asker, swarmctl/asker/speculate.py)."""

    start: int
    stop: int
    has_embedding: bool = False
    has_lm_head: bool = False
    nextn: bool = False

    @classmethod
    def nextn_of(cls, spec: "ModelSpec") -> "SliceSpec":
        return cls(spec.n_layer, spec.n_layer + 1, nextn=True)

    def check(self, spec: ModelSpec) -> None:
        if self.nextn:
            if not spec.n_nextn:
                raise SliceRangeError("the model has no multi-token-prediction (nextn) layer")
            if (self.start, self.stop) != (spec.n_layer, spec.n_layer + 1) or self.has_embedding or self.has_lm_head:
                raise SliceRangeError(f"the nextn slice is layer {spec.n_layer} alone")
            return
        if not (0 <= self.start <= self.stop <= spec.n_layer):
            raise SliceRangeError(
                f"layer range [{self.start}, {self.stop}) is outside the model's {spec.n_layer} layers"
            )
        if self.start == self.stop and not (self.has_embedding or self.has_lm_head):
            raise SliceRangeError(f"layer range [{self.start}, {self.stop}) is empty")
        if self.has_embedding and self.start != 0:
            raise SliceRangeError("a slice with the embedding must start at layer 0")
        if self.has_lm_head and self.stop != spec.n_layer:
            raise SliceRangeError(f"a slice with the LM head must end at layer {spec.n_layer}")

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def describe(self) -> str:
        if self.nextn:
            return f"nextn layer {self.start}"
        parts = ["embedding"] if self.has_embedding else []
        if self.stop > self.start:
            parts.append(f"layers [{self.start}, {self.stop})")
        if self.has_lm_head:
            parts.append("LM head")
        return " + ".join(parts)
