"""What an architecture record holds: its RoPE kind, its tensors and its two builders.

A transformer block here is always the pre-norm pair of residuals (kernels.graph.transformer_layer):

    ffn_inp = x + attention(attn_norm(x))
    l_out   = ffn_inp + ffn(ffn_norm(ffn_inp))

An architecture says what ``attention`` and ``ffn`` are (a ``Block``: the builder and the tensors
it reads) and which RoPE mode it uses. The weight loader maps exactly the tensors the record lists,
the graph builder calls the record's builders, and the spec reads its RoPE mode and FFN kind, so
nothing else in kernels/ asks which architecture it is running.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Literal

from ..errors import UnsupportedModelError

if TYPE_CHECKING:
    from ..graph import GraphBuilder
    from ..spec import ModelSpec
    from ..weights import LayerWeights

# Names a tensor's shape is written in (ggml order, ne0 first); the loader resolves them from the
# spec, and "n_ff" (which the metadata does not always give per layer) from the first of the
# layer's tensors that has it: every later tensor must then agree.
DIMENSIONS = frozenset({"n_embd", "n_embd_q", "n_embd_kv", "head_dim", "n_ff", "n_expert", "n_head",
                        # latent attention (kernels.spec.LatentAttention) and shared experts
                        "q_rank", "kv_rank", "kv_a", "qk_nope", "v_head", "n_embd_q_mla", "n_embd_v_mla", "n_embd_kv_b",
                        "n_ff_shexp"})

# (graph builder, the layer's weights, input tensor [n_embd, N], layer index) → output tensor [n_embd, N]
BlockBuilder = Callable[["GraphBuilder", "LayerWeights", int, int], int]


@dataclass(frozen=True)
class LayerTensor:
    """One tensor of every layer: where it lives in the GGUF and where it goes in LayerWeights."""

    field: str  # LayerWeights attribute
    suffix: str  # GGUF name inside "blk.{il}."
    shape: tuple[str, ...]  # DIMENSIONS names, ggml order
    required: bool = True  # False: used when the file has it (a bias, say), skipped otherwise
    matmul_only: bool = False  # feeds nothing but ggml_mul_mat, so it may be repacked (kernels.weights)
    expert: bool = False  # one slab per expert: a stage whose experts live elsewhere leaves it unmapped
    required_if: Callable[["ModelSpec"], bool] | None = None  # required exactly when this holds (a variant's tensor)

    def __post_init__(self) -> None:
        unknown = set(self.shape) - DIMENSIONS
        if unknown:
            raise ValueError(f"tensor {self.suffix}: unknown dimension names {sorted(unknown)}")

    def gguf_name(self, il: int) -> str:
        return f"blk.{il}.{self.suffix}"

    def is_required(self, spec: "ModelSpec") -> bool:
        return self.required_if(spec) if self.required_if is not None else self.required


@dataclass(frozen=True)
class ModelTensor:
    """A tensor outside the layer stack, needed by one part of a slice."""

    field: str  # SliceWeights attribute
    name: str  # GGUF name
    part: Literal["layers", "embedding", "lm_head"]  # the slice needs it when it holds this part
    required: bool = True
    fallback: str | None = None  # GGUF name used in its place when the file lacks it (a tied LM head)
    matmul_only: bool = False


@dataclass(frozen=True)
class Block:
    """One half of a transformer block: the builder and the tensors it reads (its norm included)."""

    build: BlockBuilder
    tensors: tuple[LayerTensor, ...]


@dataclass(frozen=True)
class Architecture:
    """Everything kernels/ knows about one architecture (``general.architecture`` in the GGUF)."""

    name: str
    rope_mode: int  # ggml.ROPE_TYPE_*: llama.cpp's llama_model_rope_type for this architecture
    attention: Block
    dense_ffn: Block | None  # None: every layer is a mixture of experts
    moe_ffn: Block | None  # None: the architecture has no mixture-of-experts layers
    model_tensors: tuple[ModelTensor, ...]
    # Metadata only this architecture has, read into ModelSpec fields: (key reader, the spec read so
    # far) → {field: value}. None: the common keys say everything.
    read_hparams: Callable[[Callable, "ModelSpec"], dict] | None = None
    yarn_log_multiplier: bool = False  # reads rope.scaling.yarn_log_multiplier (DeepSeek's YaRN)

    def feed_forward(self, n_expert: int) -> Block:
        """The FFN of a model with ``n_expert`` experts per layer (0: dense)."""
        block = self.moe_ffn if n_expert else self.dense_ffn
        if block is None and n_expert:
            raise UnsupportedModelError(f"architecture '{self.name}' has no mixture-of-experts layers, "
                                        f"but the model has {n_expert} experts")
        if block is None:
            raise UnsupportedModelError(f"architecture '{self.name}' needs experts, and the model has none "
                                        f"({self.name}.expert_count)")
        return block

    def layer_tensors(self, n_expert: int) -> tuple[LayerTensor, ...]:
        """Every tensor one layer of such a model has, attention half first (a model whose first
        layers are dense: ModelSpec.layer_tensors(il))."""
        return self.attention.tensors + self.feed_forward(n_expert).tensors


def with_required(tensors: tuple[LayerTensor, ...], *fields: str) -> tuple[LayerTensor, ...]:
    """The same tensors, with ``fields`` required (an architecture whose variant always has them)."""
    missing = set(fields) - {t.field for t in tensors}
    if missing:
        raise ValueError(f"no tensors {sorted(missing)} to require")
    return tuple(replace(t, required=True) if t.field in fields else t for t in tensors)
