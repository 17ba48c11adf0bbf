"""A slice's weights, handed to ggml zero-copy from the GGUF memory map, or copied to a device.

Only the slice's own tensors become ggml tensors; on the CPU each one points into the map, so the
pages a slice touches are exactly the bytes it serves. On a device with memory of its own (a GPU;
``Backend.upload_buffer_type``) every tensor is copied into one device buffer instead, and its
mapped pages are released once copied. Quantized tensors stay quantized.
GGUF names are translated to field names here, once, never inside the math: the architecture's
record (kernels.archs) lists the tensors, which of them are required, and their shapes.

``kernels`` (``plain`` by default; kernels.backend.KERNELS): under ``repack`` (or ``amx``) the
weights the CPU's extra buffer types take (kernels/weight_bufts.py: every matrix that feeds
nothing but ``ggml_mul_mat``, and the routed experts, which feed ``ggml_mul_mat_id``) are copied
into them, repacked for faster matmuls, as llama.cpp does by default; everything else stays
mapped. A tied LM head stays mapped in a slice that also looks up embeddings in it (llama.cpp
repacks a duplicate there: in that one case the two agree closely, not bit for bit). The repacked
copy replaces the mapped pages, which are released.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import ggml
from .archs import LayerTensor
from .backend import Backend, cpu_device
from .errors import UnsupportedModelError
from .gguf_file import GGUFFile, TensorInfo
from .spec import ModelSpec, SliceSpec
from .weight_bufts import Candidate, ExtraCopies, choose

@dataclass
class LayerWeights:
    """One transformer block. Each field is a ggml tensor address, or None when the model lacks it.
    The fields are the union of the records' LayerTensor fields (kernels.archs)."""

    attn_norm: int
    wo: int  # [n_head * head_dim, n_embd]
    ffn_norm: int
    wq: int | None = None  # [n_embd, n_head * head_dim]
    wk: int | None = None  # [n_embd, n_head_kv * head_dim]
    wv: int | None = None  # [n_embd, n_head_kv * head_dim]
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
    ffn_exp_probs_b: int | None = None  # [n_expert]: routing bias, for choosing experts only (DeepSeek-V3)
    ffn_gate_shexp: int | None = None  # shared experts [n_embd, n_ff_shexp]
    ffn_up_shexp: int | None = None
    ffn_down_shexp: int | None = None  # [n_ff_shexp, n_embd]
    # latent attention (deepseek2): Q through a low rank (or plain wq), K/V through one latent
    wq_a: int | None = None  # [n_embd, q_rank]
    q_a_norm: int | None = None  # [q_rank]
    wq_b: int | None = None  # [q_rank, n_head * k_head]
    wkv_a_mqa: int | None = None  # [n_embd, kv_rank + n_rot]
    kv_a_norm: int | None = None  # [kv_rank]
    wk_b: int | None = None  # [qk_nope, kv_rank, n_head]: absorbed into Q
    wv_b: int | None = None  # [kv_rank, v_head, n_head]: turns attended latents into values
    wkv_b: int | None = None  # [kv_rank, n_head * (qk_nope + v_head)]: an older conversion's unsplit form

    @property
    def is_moe(self) -> bool:
        return self.ffn_gate_inp is not None


@dataclass
class NextnWeights:
    """A multi-token-prediction layer's own tensors, besides its block's (DeepSeek-V3, GLM): the
    token's embedding and the hidden state are normed, joined and projected to one row, and the
    block's output goes through its own norm and head."""

    eh_proj: int  # [2 * n_embd, n_embd]: [enorm(embedding); hnorm(hidden)] → the block's input
    enorm: int  # [n_embd]
    hnorm: int  # [n_embd]
    head_norm: int  # [n_embd]: shared_head_norm, else the model's output norm
    embd: int  # [n_embd, n_vocab]: its own embed_tokens, else the model's token embedding
    head: int  # [n_embd, n_vocab]: shared_head_head, else the model's output matrix (or the embedding, tied)


# field → the GGUF names it may have, in order ("{il}": the nextn layer); the first present is used
NEXTN_TENSORS = (
    ("eh_proj", ("blk.{il}.nextn.eh_proj.weight",)),
    ("enorm", ("blk.{il}.nextn.enorm.weight",)),
    ("hnorm", ("blk.{il}.nextn.hnorm.weight",)),
    ("head_norm", ("blk.{il}.nextn.shared_head_norm.weight", "output_norm.weight")),
    ("embd", ("blk.{il}.nextn.embed_tokens.weight", "token_embd.weight")),
    ("head", ("blk.{il}.nextn.shared_head_head.weight", "output.weight", "token_embd.weight")),
)


def _nextn_tensor_names(gguf: GGUFFile, il: int) -> dict[tuple[str, int], str]:
    names = {}
    for field_name, choices in NEXTN_TENSORS:
        found = [n.format(il=il) for n in choices if n.format(il=il) in gguf.tensors]
        if not found:
            raise UnsupportedModelError(f"tensor {choices[0].format(il=il)} is missing from the model")
        names[("nextn." + field_name, -1)] = found[0]
    return names


class SliceWeights:
    """The ggml tensors of one slice. Context manager: frees the ggml context and buffer."""

    def __init__(self, gguf: GGUFFile, spec: ModelSpec, slice_spec: SliceSpec, backend: Backend, *,
                 with_experts: bool = True, kernels: str = "plain") -> None:
        """``with_experts=False``: a stage whose experts live on other nodes maps the router but not
        the experts' weights (usually most of a MoE layer's bytes). ``kernels``: see the module
        notes; ``self.repacked`` names the tensors it repacked (none where the CPU has no layout)."""
        self.kernels = kernels
        slice_spec.check(spec)
        self.with_experts = with_experts
        self.slice = slice_spec
        self.layers: dict[int, LayerWeights] = {}
        self.tok_embd: int | None = None  # [n_embd, n_vocab]
        self.output_norm: int | None = None
        self.output: int | None = None  # [n_embd, n_vocab]; the embedding again when tied
        self.output_b: int | None = None
        self.rope_freqs: int | None = None  # [head_dim / 2] (llama 3)
        self.nextn: NextnWeights | None = None  # a nextn slice's own tensors (SliceSpec.nextn)
        self.kept_in_host: tuple[str, ...] = ()  # meant for the device, too large for it (_beyond_device)
        self._ctx = 0
        self._buffers: list[int] = []  # over the mapped bytes, one per part of the file (zero-copy)
        self._copy_ctx = 0
        self._copy_buffer = 0
        self._extra = ExtraCopies()  # the repacked weights (kernels/weight_bufts.py)

        wanted = self._tensor_names(gguf, spec, slice_spec)
        infos = [gguf.tensors[name] for name in dict.fromkeys(wanted.values())]
        self.tensor_names: tuple[str, ...] = tuple(info.name for info in infos)
        self.n_bytes = sum(info.n_bytes for info in infos)
        upload_buft = backend.upload_buffer_type()
        if upload_buft is not None:  # a device with memory of its own: its tensors are copied there
            layer_of = {name: il if il >= 0 else None for (_, il), name in wanted.items()}
            routed = {name for (field_name, _), name in wanted.items() if field_name in _expert_fields(spec)}
            to_copy = [info for info in infos if backend.on_device(layer_of[info.name], expert=info.name in routed)]
            kept = _beyond_device(backend, to_copy)
            self.kept_in_host = tuple(sorted(kept))
            if kept:  # the scheduler then runs their matmuls on the CPU (backend.scheduler_for)
                to_copy = [info for info in to_copy if info.name not in kept]
                backend.weights_kept_on_cpu = True
            copy_buft = upload_buft
        else:
            to_copy = []
        repacking: list[Candidate] = []
        bufts = backend.weight_buffer_types(kernels)
        if bufts:
            repacking = _candidates(wanted, spec, gguf)
            chosen = choose(repacking, bufts, cpu_device(), max(1, spec.n_expert_used))
            repacking = [c for c in repacking if c.name in chosen]
        self.repacked: tuple[str, ...] = tuple(c.name for c in repacking)
        self.uploaded: tuple[str, ...] = tuple(info.name for info in to_copy)
        copied = set(self.repacked) | set(self.uploaded)
        mapped = [info for info in infos if info.name not in copied]
        self._ctx = ggml.new_context(len(mapped) + 1)
        # Keep the map open as long as ggml points into it.
        self._gguf = gguf
        by_name: dict[str, int] = {}
        # One buffer over the mapped bytes of each part that holds some (a split model's parts are
        # mapped apart).
        for part, infos_in_part in gguf.by_part(mapped).items():
            lo = min(info.offset for info in infos_in_part)
            hi = max(info.offset + info.n_bytes for info in infos_in_part)
            buffer = backend.weights_buffer(gguf.part_address(part) + lo, hi - lo)
            self._buffers.append(buffer)
            by_name.update((info.name, self._map_tensor(buffer, info, gguf.tensor_address(info)))
                           for info in infos_in_part)
        if to_copy:
            by_name.update(self._copy(to_copy, gguf, copy_buft))
        if repacking:
            self._extra.copy(gguf, repacking, chosen)
            by_name.update(self._extra.tensors)
        self._assign(wanted, by_name)

    @property
    def repacked_into(self) -> dict[str, str]:
        """Tensor name → the extra buffer type it was repacked into (CPU_REPACK, AMX, ...)."""
        return dict(self._extra.placed)

    @property
    def copied_bytes(self) -> int:
        """Bytes of the buffers the weights were copied into (device memory, or repacked layouts)."""
        uploaded = ggml.backend_buffer_get_size(self._copy_buffer) if self._copy_buffer else 0
        return uploaded + self._extra.n_bytes

    def _copy(self, infos: list[TensorInfo], gguf: GGUFFile, buft: int) -> dict[str, int]:
        """Copy ``infos`` into one buffer of type ``buft`` (a device's memory). The mapped pages
        are dropped once copied."""
        self._copy_ctx = ggml.new_context(len(infos) + 1)
        tensors = {}
        for info in infos:
            tensors[info.name] = _new_tensor(self._copy_ctx, info)
            ggml.set_name(tensors[info.name], info.name.encode())
        self._copy_buffer = ggml.backend_alloc_ctx_tensors_from_buft(self._copy_ctx, buft)
        if not self._copy_buffer:
            raise MemoryError(f"cannot allocate {sum(i.n_bytes for i in infos) / 1e6:.0f} MB for the weights "
                              f"({ggml.backend_buft_name(buft).decode()})")
        ggml.backend_buffer_set_usage(self._copy_buffer, ggml.BUFFER_USAGE_WEIGHTS)
        for info in infos:
            ggml.backend_tensor_set(tensors[info.name], gguf.tensor_address(info), 0, info.n_bytes)
            gguf.release_pages([info])  # the copy replaces the mapped bytes
        return tensors

    def _tensor_names(self, gguf: GGUFFile, spec: ModelSpec, s: SliceSpec) -> dict[tuple[str, int], str]:
        """(field, layer) → GGUF tensor name, for every tensor this slice needs; layer -1 = global.
        Exactly the tensors the architecture's record lists, in its order."""
        names: dict[tuple[str, int], str] = {}
        if s.stop > s.start and spec.n_expert and not 0 < spec.n_expert_used <= spec.n_expert:
            raise UnsupportedModelError(f"{spec.n_expert_used} experts used per token of {spec.n_expert}")
        for il in s.layers:
            tensors = spec.layer_tensors(il)
            present = {t.field: t.gguf_name(il) for t in tensors if t.gguf_name(il) in gguf.tensors}
            for t in tensors:
                if t.is_required(spec) and t.field not in present and (self.with_experts or not t.expert):
                    raise UnsupportedModelError(f"tensor {t.gguf_name(il)} is missing from the model")
            _check_layer_shapes(gguf, spec, tensors, present)
            # A stage whose experts live on other nodes leaves their slabs unmapped.
            names.update(((t.field, il), present[t.field]) for t in tensors
                         if t.field in present and (self.with_experts or not t.expert))
        if s.nextn:
            names.update(_nextn_tensor_names(gguf, s.start))
        holds = {"layers": s.stop > s.start, "embedding": s.has_embedding, "lm_head": s.has_lm_head}
        for t in spec.arch.model_tensors:
            if not holds[t.part]:
                continue
            name = t.name if t.name in gguf.tensors or t.fallback is None else t.fallback
            if name in gguf.tensors:
                names[(t.field, -1)] = name
            elif t.required:
                raise UnsupportedModelError(f"tensor {t.name} is missing from the model")
        return names

    def _map_tensor(self, buffer: int, info: TensorInfo, address: int) -> int:
        tensor = _new_tensor(self._ctx, info)
        ggml.set_name(tensor, info.name.encode())
        status = ggml.backend_tensor_alloc(buffer, tensor, address)
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
        for il, tensors in per_layer.items():
            self.layers[il] = LayerWeights(**tensors)
        nextn = {field_name[len("nextn."):]: by_name[name] for (field_name, il), name in wanted.items()
                 if field_name.startswith("nextn.")}
        if nextn:
            self.nextn = NextnWeights(**nextn)

    def close(self) -> None:
        for buffer in self._buffers:
            ggml.backend_buffer_free(buffer)
        self._buffers = []
        if self._copy_buffer:
            ggml.backend_buffer_free(self._copy_buffer)
            self._copy_buffer = 0
        self._extra.close()
        for ctx in ("_ctx", "_copy_ctx"):
            if getattr(self, ctx):
                ggml.free(getattr(self, ctx))
                setattr(self, ctx, 0)

    def __enter__(self) -> "SliceWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_layer_shapes(gguf: GGUFFile, spec: ModelSpec, tensors: tuple[LayerTensor, ...],
                        present: dict[str, str]) -> None:
    """Refuse a layout the graph builders would feed to ggml wrongly (ggml aborts on a bad shape).
    Dimensions come from the spec; one the metadata does not fix (an FFN's width) is read from the
    first of the layer's tensors that has it, and every later tensor must agree."""
    dims: dict[str, int] = {"n_embd": spec.n_embd, "n_embd_q": spec.n_embd_q, "n_embd_kv": spec.n_embd_kv,
                            "head_dim": spec.head_dim, "n_expert": spec.n_expert, "n_head": spec.n_head}
    if spec.mla:
        m = spec.mla
        dims.update(q_rank=m.q_rank, kv_rank=m.kv_rank, kv_a=m.kv_rank + m.n_rot, qk_nope=m.qk_nope,
                    v_head=m.v_head, n_embd_q_mla=spec.n_head * m.k_head, n_embd_v_mla=spec.n_head * m.v_head,
                    n_embd_kv_b=spec.n_head * (m.qk_nope + m.v_head))
    for t in tensors:
        name = present.get(t.field)
        if name is None:
            continue
        shape = tuple(gguf.tensors[name].shape)
        if len(shape) == len(t.shape):
            for dim, n in zip(t.shape, shape):
                dims.setdefault(dim, n)
        expected = tuple(dims.get(dim, dim) for dim in t.shape)  # a dimension never read shows by name
        if shape != expected:
            raise UnsupportedModelError(f"tensor {name} has shape {_dims(shape)}, expected {_dims(expected)}")


def _dims(shape: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def _matmul_only(wanted: dict[tuple[str, int], str], matmul_fields: set[str]) -> list[str]:
    """GGUF names of the slice's tensors that feed nothing but ggml_mul_mat."""
    other_uses = {name for (field_name, _), name in wanted.items() if field_name not in matmul_fields}
    return list(dict.fromkeys(name for (field_name, _), name in wanted.items()
                              if field_name in matmul_fields and name not in other_uses))


def _expert_fields(spec: ModelSpec) -> set[str]:
    """Fields of a layer's routed experts (one slab per expert), which a device may leave in RAM."""
    return {t.field for t in spec.arch.moe_ffn.tensors if t.expert} if spec.arch.moe_ffn else set()


def _matmul_fields(spec: ModelSpec) -> set[str]:
    """Fields whose tensor only ever feeds ggml_mul_mat as its weight, as the record marks them
    ("output" too: unless the slice also looks rows up in it, as a tied LM head with the embedding)."""
    tensors = (*spec.arch.attention.tensors, *(spec.arch.dense_ffn.tensors if spec.arch.dense_ffn else ()),
               *(spec.arch.moe_ffn.tensors if spec.arch.moe_ffn else ()), *spec.arch.model_tensors)
    return {t.field for t in tensors if t.matmul_only}


def _candidates(wanted: dict[tuple[str, int], str], spec: ModelSpec, gguf: GGUFFile) -> list[Candidate]:
    """The slice's weights an extra buffer type might take: the matrices that feed nothing but
    ggml_mul_mat, and the routed experts (ggml_mul_mat_id)."""
    experts = _expert_fields(spec)
    expert_names = {name for (field_name, _), name in wanted.items() if field_name in experts}
    names = _matmul_only(wanted, _matmul_fields(spec) | experts)
    return [Candidate(gguf.tensors[name], name, experts=name in expert_names) for name in names]


def _beyond_device(backend: Backend, infos: list[TensorInfo]) -> set[str]:
    """The tensors of ``infos`` the device's backend says it cannot hold (ggml_backend_supports_op
    on the weight itself: ggml-vulkan refuses one larger than the device's largest storage buffer,
    128 MiB on lavapipe, where a Kimi-width dense FFN matrix is 140 MB). They stay in host memory,
    as llama.cpp's loader keeps them; uploaded, ggml's scheduler aborted on the first graph."""
    if not infos:
        return set()
    ctx = ggml.new_context(len(infos) + 1)
    try:
        refused = set()
        for info in infos:
            tensor = _new_tensor(ctx, info)
            ggml.set_name(tensor, info.name.encode())
            if not ggml.backend_supports_op(backend.handle, tensor):
                refused.add(info.name)
        return refused
    finally:
        ggml.free(ctx)


def _new_tensor(ctx: int, info: TensorInfo) -> int:
    shape = info.shape or (1,)
    if len(shape) == 1:
        return ggml.new_tensor_1d(ctx, info.ggml_type, *shape)
    if len(shape) == 2:
        return ggml.new_tensor_2d(ctx, info.ggml_type, *shape)
    if len(shape) == 3:
        return ggml.new_tensor_3d(ctx, info.ggml_type, *shape)
    return ggml.new_tensor_4d(ctx, info.ggml_type, *shape)
