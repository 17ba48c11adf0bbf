"""A slice's weights, handed to ggml zero-copy from the GGUF memory map.

Only the slice's own tensors become ggml tensors; each one points into the map, so the pages a
slice touches are exactly the bytes it serves. Quantized tensors stay quantized.
GGUF names are translated to field names here, once, never inside the math.

``repack=True`` copies the matrices that ggml's CPU_REPACK buffer type has a layout for (Q4_0,
Q4_K, IQ4_NL, ... on AVX2 / NEON CPUs; see ``Backend.repack_buffer_type``) into that buffer, which
interleaves their blocks for faster matmuls, as llama.cpp does by default; everything else stays
mapped. Only tensors that feed nothing but ``ggml_mul_mat`` are candidates: the repacked layout
is meaningless to any other operator. So a tied LM head stays mapped in a slice that also looks
up embeddings in it (llama.cpp repacks a duplicate there: in that one case the two agree closely,
not bit for bit). The repacked copy replaces the mapped pages, which are released.
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
# Fields whose tensor only ever feeds ggml_mul_mat as its weight (kernels.graph); "output" too,
# unless the slice also looks rows up in it (tied embeddings with the embedding in the slice).
_MATMUL_ONLY = ("wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down", "output")
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
                 with_experts: bool = True, repack: bool = False) -> None:
        """``with_experts=False``: a stage whose experts live on other nodes maps the router but not
        the experts' weights (usually most of a MoE layer's bytes). ``repack=True``: see the module
        notes; ``self.repacked`` names the tensors it repacked (none where the CPU has no layout)."""
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
        self._repack_ctx = 0
        self._repack_buffer = 0

        wanted = self._tensor_names(gguf, spec, slice_spec)
        infos = [gguf.tensors[name] for name in dict.fromkeys(wanted.values())]
        self.tensor_names: tuple[str, ...] = tuple(info.name for info in infos)
        self.n_bytes = sum(info.n_bytes for info in infos)
        buft = backend.repack_buffer_type() if repack else None
        to_repack = _repackable(_matmul_only(wanted), gguf, buft) if buft else []
        self.repacked: tuple[str, ...] = tuple(info.name for info in to_repack)
        mapped = [info for info in infos if info.name not in self.repacked]
        self._ctx = ggml.new_context(len(mapped) + 1)
        # Keep the map open as long as ggml points into it.
        self._gguf = gguf
        by_name: dict[str, int] = {}
        if mapped:
            lo = min(info.offset for info in mapped)
            hi = max(info.offset + info.n_bytes for info in mapped)
            self._buffer = backend.weights_buffer(gguf.address + lo, hi - lo)
            by_name.update((info.name, self._map_tensor(info, gguf.address + info.offset)) for info in mapped)
        if to_repack:
            by_name.update(self._repack(to_repack, gguf, buft))
        self._assign(wanted, by_name)

    def _repack(self, infos: list[TensorInfo], gguf: GGUFFile, buft: int) -> dict[str, int]:
        """Copy ``infos`` into one buffer of type ``buft``, which repacks them as they arrive."""
        self._repack_ctx = ggml.new_context(len(infos) + 1)
        tensors = {}
        for info in infos:
            tensors[info.name] = _new_tensor(self._repack_ctx, info)
            ggml.set_name(tensors[info.name], info.name.encode())
        self._repack_buffer = ggml.backend_alloc_ctx_tensors_from_buft(self._repack_ctx, buft)
        if not self._repack_buffer:
            raise MemoryError("cannot allocate the buffer for repacked weights")
        ggml.backend_buffer_set_usage(self._repack_buffer, ggml.BUFFER_USAGE_WEIGHTS)
        for info in infos:
            if not ggml.tensor_view(tensors[info.name]).extra:  # no layout: ggml would abort on the copy
                raise RuntimeError(f"ggml has no repacked layout for {info.name}")
            ggml.backend_tensor_set(tensors[info.name], gguf.address + info.offset, 0, info.n_bytes)
            gguf.release_pages([(info.offset, info.n_bytes)])  # the copy replaces the mapped bytes
        return tensors

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
        for buffer in ("_buffer", "_repack_buffer"):
            if getattr(self, buffer):
                ggml.backend_buffer_free(getattr(self, buffer))
                setattr(self, buffer, 0)
        for ctx in ("_ctx", "_repack_ctx"):
            if getattr(self, ctx):
                ggml.free(getattr(self, ctx))
                setattr(self, ctx, 0)

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


def _matmul_only(wanted: dict[tuple[str, int], str]) -> list[str]:
    """GGUF names of the slice's tensors that feed nothing but ggml_mul_mat."""
    other_uses = {name for (field_name, _), name in wanted.items() if field_name not in _MATMUL_ONLY}
    return list(dict.fromkeys(name for (field_name, _), name in wanted.items()
                              if field_name in _MATMUL_ONLY and name not in other_uses))


def _repackable(names: list[str], gguf: GGUFFile, buft: int) -> list[TensorInfo]:
    """The 2-D tensors among ``names`` for which ``buft`` has a repacked layout on this CPU.

    Asks ggml itself: a probe tensor of each type and shape is placed in a buffer of that type
    (address space only; nothing is written), whose ``init_tensor`` records the layout it would
    use in ``tensor->extra``, or nothing."""
    infos = [gguf.tensors[name] for name in names if len(gguf.tensors[name].shape) == 2]
    kinds = list(dict.fromkeys((info.ggml_type, info.shape) for info in infos))
    if not kinds:
        return []
    ctx = ggml.new_context(len(kinds) + 1)
    buffer = 0
    try:
        probes = {kind: ggml.new_tensor_2d(ctx, kind[0], *kind[1]) for kind in kinds}
        buffer = ggml.backend_alloc_ctx_tensors_from_buft(ctx, buft)
        if not buffer:
            return []
        ok = {kind for kind, probe in probes.items() if ggml.tensor_view(probe).extra}
    finally:
        if buffer:
            ggml.backend_buffer_free(buffer)
        ggml.free(ctx)
    return [info for info in infos if (info.ggml_type, info.shape) in ok]


def _new_tensor(ctx: int, info: TensorInfo) -> int:
    shape = info.shape or (1,)
    if len(shape) == 1:
        return ggml.new_tensor_1d(ctx, info.ggml_type, *shape)
    if len(shape) == 2:
        return ggml.new_tensor_2d(ctx, info.ggml_type, *shape)
    if len(shape) == 3:
        return ggml.new_tensor_3d(ctx, info.ggml_type, *shape)
    return ggml.new_tensor_4d(ctx, info.ggml_type, *shape)
