"""Model hyper-parameters read from GGUF metadata, and the slice of layers a node runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .archs import Architecture, Block, architecture_for
from .errors import ModelFileError, SliceRangeError, UnsupportedModelError
from .gguf_file import GGUFFile

KV_CELL_PAD = 256  # llama.cpp pads the attended KV length to this; we mirror it for identical bits


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

    @property
    def n_embd_q(self) -> int:
        return self.n_head * self.head_dim

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.n_embd_kv * 2  # K and V, f16

    @property
    def arch(self) -> Architecture:
        """The architecture's record (kernels.archs): its tensors and builders."""
        return architecture_for(self.architecture)

    @property
    def ffn(self) -> Block:
        """This model's feed-forward half: dense, or a mixture of experts when it has experts."""
        return self.arch.feed_forward(self.n_expert)

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

        n_layer = int(key("block_count", required=True))
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
        rope = _rope_config(gguf, arch, record.rope_mode, head_dim, n_ctx_train)
        attention_scale = float(key("attention.scale", 0.0) or 0.0) or 1.0 / math.sqrt(head_dim)

        layer_bytes = [0] * n_layer
        for info in gguf.tensors.values():
            il = layer_of(info.name)
            if il is not None and il < n_layer:
                layer_bytes[il] += info.n_bytes
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

        return cls(
            architecture=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length", 0) or key("expert_feed_forward_length", 0) or 0),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=int(n_vocab),
            n_ctx_train=n_ctx_train,
            norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            attention_scale=attention_scale,
            rope=rope,
            layer_bytes=tuple(layer_bytes),
            embedding_bytes=embedding_bytes,
            lm_head_bytes=lm_head_bytes,
            tied_embeddings=tied,
            n_expert=n_expert,
            n_expert_used=int(key("expert_used_count", 0) or 0),
            n_ff_exp=int(key("expert_feed_forward_length", 0) or 0),
            expert_weights_scale=float(key("expert_weights_scale", 0.0) or 0.0),
        )


def layer_of(tensor_name: str) -> int | None:
    """'blk.12.attn_q.weight' → 12; tensors outside the layer stack → None."""
    if not tensor_name.startswith("blk."):
        return None
    index = tensor_name.split(".", 2)[1]
    return int(index) if index.isdigit() else None


def _rope_config(gguf: GGUFFile, arch: str, mode: int, head_dim: int, n_ctx_train: int) -> RopeConfig:
    def key(name: str, default):
        value = gguf.get(f"{arch}.rope.{name}", default)
        return default if value is None else value

    scaling_type = str(key("scaling.type", "none"))
    factor = float(key("scaling.factor", 0.0))
    # llama.cpp: a scaling type of "none" never scales; otherwise freq_scale = 1 / factor.
    freq_scale = 1.0 / factor if scaling_type != "none" and factor > 0 else 1.0
    ext_factor = 1.0 if scaling_type == "yarn" else 0.0
    # For YaRN llama.cpp multiplies by get_mscale(f) and then by its reciprocal (llama-context.cpp),
    # so with no yarn_log_multiplier the net attention factor is the model's rope attn_factor.
    if scaling_type == "yarn" and float(key("scaling.yarn_log_multiplier", 0.0)):
        raise UnsupportedModelError("YaRN with a log multiplier (DeepSeek-style) is not supported")
    attn_factor = float(key("scaling.attn_factor", 1.0))
    return RopeConfig(
        mode=mode,
        n_dims=int(key("dimension_count", head_dim)),
        freq_base=float(key("freq_base", 10000.0)),
        freq_scale=freq_scale,
        n_ctx_orig=int(key("scaling.original_context_length", n_ctx_train)),
        ext_factor=ext_factor,
        attn_factor=attn_factor,
        beta_fast=float(key("scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(key("scaling.yarn_beta_slow", 1.0)),
    )


@dataclass(frozen=True)
class SliceSpec:
    """What one node runs: layers [start, stop), plus the embedding and/or the LM head."""

    start: int
    stop: int
    has_embedding: bool = False
    has_lm_head: bool = False

    def check(self, spec: ModelSpec) -> None:
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
        parts = ["embedding"] if self.has_embedding else []
        if self.stop > self.start:
            parts.append(f"layers [{self.start}, {self.stop})")
        if self.has_lm_head:
            parts.append("LM head")
        return " + ".join(parts)
