"""A slice's weights, handed to ggml zero-copy from the GGUF memory map.

Only the slice's own tensors become ggml tensors; each one points into the map, so the pages a
slice touches are exactly the bytes it serves. Quantized tensors stay quantized.
GGUF names are translated to field names here, once, never inside the math.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from . import ggml
from .backend import Backend
from .errors import UnsupportedModelError
from .gguf_file import GGUFFile, TensorInfo
from .spec import ModelSpec, SliceSpec

# field name → GGUF tensor name inside "blk.{il}."
_LAYER_TENSOR_NAMES = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "wo": "attn_output.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "bo": "attn_output.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
    "ffn_gate_inp": "ffn_gate_inp.weight",
    "ffn_gate_exps": "ffn_gate_exps.weight",
    "ffn_up_exps": "ffn_up_exps.weight",
    "ffn_down_exps": "ffn_down_exps.weight",
}
_REQUIRED_DENSE = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_EXPERT_FIELDS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_REQUIRED_MOE = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps",
                 "ffn_up_exps", "ffn_down_exps")


@dataclass
class LayerWeights:
    """One transformer block. Each field is a ggml tensor address, or None when the model lacks it."""

    attn_norm: int
    wq: int  # [n_embd, n_head * head_dim]
    wk: int  # [n_embd, n_head_kv * head_dim]
    wv: int  # [n_embd, n_head_kv * head_dim]
    wo: int  # [n_head * head_dim, n_embd]
    ffn_norm: int
    bq: int | None = None
    bk: int | None = None
    bv: int | None = None
    bo: int | None = None
    q_norm: int | None = None  # [head_dim] (qwen3)
    k_norm: int | None = None
    ffn_gate: int | None = None  # [n_embd, n_ff]
    ffn_up: int | None = None  # [n_embd, n_ff]
    ffn_down: int | None = None  # [n_ff, n_embd]
    ffn_gate_inp: int | None = None  # router [n_embd, n_expert]
    ffn_gate_exps: int | None = None  # [n_embd, n_ff, n_expert]
    ffn_up_exps: int | None = None
    ffn_down_exps: int | None = None  # [n_ff, n_embd, n_expert]

    @property
    def is_moe(self) -> bool:
        return self.ffn_gate_inp is not None


class SliceWeights:
    """The ggml tensors of one slice. Context manager: frees the ggml context and buffer."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec, slice_spec: SliceSpec, backend: Backend, *,
                 with_experts: bool = True) -> None:
        """``with_experts=False``: a stage whose experts live on other nodes maps the router but not
        the experts' weights (usually most of a MoE layer's bytes)."""
        slice_spec.check(spec)
        self.with_experts = with_experts
        self.slice = slice_spec
        self.layers: dict[int, LayerWeights] = {}
        self.tok_embd: int | None = None  # [n_embd, n_vocab]
        self.output_norm: int | None = None
        self.output: int | None = None  # [n_embd, n_vocab]; the embedding again when tied
        self.output_b: int | None = None
        self.rope_freqs: int | None = None  # [head_dim / 2] (llama 3)
        self._ctx = 0
        self._buffer = 0

        wanted = self._tensor_names(gguf, spec, slice_spec)
        infos = [gguf.tensors[name] for name in dict.fromkeys(wanted.values())]
        self.tensor_names: tuple[str, ...] = tuple(info.name for info in infos)
        self.n_bytes = sum(info.n_bytes for info in infos)
        self._ctx = ggml.new_context(len(infos) + 1)
        lo = min(info.offset for info in infos)
        hi = max(info.offset + info.n_bytes for info in infos)
        self._buffer = backend.weights_buffer(gguf.address + lo, hi - lo)
        # Keep the map open as long as ggml points into it.
        self._gguf = gguf
        by_name = {info.name: self._map_tensor(info, gguf.address + info.offset) for info in infos}
        self._assign(wanted, by_name)

    def _tensor_names(self, gguf: GGUFFile, spec: ModelSpec, s: SliceSpec) -> dict[tuple[str, int], str]:
        """(field, layer) → GGUF tensor name, for every tensor this slice needs; layer -1 = global."""
        names: dict[tuple[str, int], str] = {}
        for il in s.layers:
            for field_name, suffix in _LAYER_TENSOR_NAMES.items():
                name = f"blk.{il}.{suffix}"
                if name in gguf.tensors:
                    names[(field_name, il)] = name
            required = _REQUIRED_MOE if (("ffn_gate_inp", il) in names) else _REQUIRED_DENSE
            _check_layer_shapes(gguf, spec, il, {f: n for (f, l), n in names.items() if l == il})
            if not self.with_experts:
                for field_name in _EXPERT_FIELDS:
                    names.pop((field_name, il), None)
                required = tuple(f for f in required if f not in _EXPERT_FIELDS)
            for field_name in required:
                if (field_name, il) not in names:
                    raise UnsupportedModelError(
                        f"tensor blk.{il}.{_LAYER_TENSOR_NAMES[field_name]} is missing from the model"
                    )
        if s.stop > s.start and "rope_freqs.weight" in gguf.tensors:
            names[("rope_freqs", -1)] = "rope_freqs.weight"
        if s.has_embedding:
            names[("tok_embd", -1)] = "token_embd.weight"
        if s.has_lm_head:
            if "output_norm.weight" not in gguf.tensors:
                raise UnsupportedModelError("tensor output_norm.weight is missing from the model")
            names[("output_norm", -1)] = "output_norm.weight"
            names[("output", -1)] = "token_embd.weight" if spec.tied_embeddings else "output.weight"
            if "output.bias" in gguf.tensors:
                names[("output_b", -1)] = "output.bias"
        return names

    def _map_tensor(self, info: TensorInfo, address: int) -> int:
        tensor = _new_tensor(self._ctx, info)
        ggml.set_name(tensor, info.name.encode())
        status = ggml.backend_tensor_alloc(self._buffer, tensor, address)
        if status != ggml.STATUS_SUCCESS:
            raise RuntimeError(f"cannot place tensor {info.name} (ggml status {status})")
        return tensor

    def _assign(self, wanted: dict[tuple[str, int], str], by_name: dict[str, int]) -> None:
        per_layer: dict[int, dict[str, int]] = {}
        for (field_name, il), name in wanted.items():
            if il < 0:
                setattr(self, field_name, by_name[name])
            else:
                per_layer.setdefault(il, {})[field_name] = by_name[name]
        known = {f.name for f in fields(LayerWeights)}
        for il, tensors in per_layer.items():
            self.layers[il] = LayerWeights(**{k: v for k, v in tensors.items() if k in known})

    def close(self) -> None:
        if self._buffer:
            ggml.backend_buffer_free(self._buffer)
            self._buffer = 0
        if self._ctx:
            ggml.free(self._ctx)
            self._ctx = 0

    def __enter__(self) -> "SliceWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_layer_shapes(gguf: GGUFFile, spec: ModelSpec, il: int, names: dict[str, str]) -> None:
    """Refuse a layout the graph builders would feed to ggml wrongly (ggml aborts on a bad shape)."""
    e, q, kv = spec.n_embd, spec.n_embd_q, spec.n_embd_kv
    expected = {"attn_norm": (e,), "wq": (e, q), "wk": (e, kv), "wv": (e, kv), "wo": (q, e), "ffn_norm": (e,),
                "bq": (q,), "bk": (kv,), "bv": (kv,), "bo": (e,),
                "q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,)}
    for field_name, shape in expected.items():
        name = names.get(field_name)
        if name is not None and gguf.tensors[name].shape != shape:
            raise UnsupportedModelError(
                f"tensor {name} has shape {list(gguf.tensors[name].shape)}, expected {list(shape)}"
            )
    if "ffn_gate_inp" in names:
        n_ff = gguf.tensors[names["ffn_up_exps"]].shape[1]
        x = spec.n_expert
        moe = {"ffn_gate_inp": (e, x), "ffn_gate_exps": (e, n_ff, x), "ffn_up_exps": (e, n_ff, x),
               "ffn_down_exps": (n_ff, e, x)}
        for field_name, shape in moe.items():
            if gguf.tensors[names[field_name]].shape != shape:
                raise UnsupportedModelError(f"tensor {names[field_name]} has shape "
                                            f"{list(gguf.tensors[names[field_name]].shape)}, expected {list(shape)}")
        if not 0 < spec.n_expert_used <= spec.n_expert:
            raise UnsupportedModelError(f"{spec.n_expert_used} experts used per token of {spec.n_expert}")
    if "ffn_gate" in names:
        n_ff = gguf.tensors[names["ffn_up"]].shape[1]
        for field_name, shape in (("ffn_gate", (e, n_ff)), ("ffn_up", (e, n_ff)), ("ffn_down", (n_ff, e))):
            if gguf.tensors[names[field_name]].shape != shape:
                raise UnsupportedModelError(f"tensor {names[field_name]} has an unexpected shape")


def _new_tensor(ctx: int, info: TensorInfo) -> int:
    shape = info.shape or (1,)
    if len(shape) == 1:
        return ggml.new_tensor_1d(ctx, info.ggml_type, *shape)
    if len(shape) == 2:
        return ggml.new_tensor_2d(ctx, info.ggml_type, *shape)
    if len(shape) == 3:
        return ggml.new_tensor_3d(ctx, info.ggml_type, *shape)
    return ggml.new_tensor_4d(ctx, info.ggml_type, *shape)
