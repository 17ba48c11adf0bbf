"""The architecture records (kernels.archs): what each supported architecture holds, and the
one-line errors the spec and the weight loader give when a model does not fit its record.

No model is loaded into llama.cpp here: the tiny models are only mapped by SliceWeights."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kernels import ggml
from kernels.archs import ARCHITECTURES, LayerTensor, architecture_for
from kernels.archs.llama import llama_attention
from kernels.archs.record import with_required
from kernels.backend import Backend
from kernels.errors import UnsupportedModelError
from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec, SliceSpec
from kernels.weights import LayerWeights, SliceWeights, _check_layer_shapes
from swarmctl.model_files.models import default_model_path
from harness.tiny_models import TinyConfig, write_tiny_model

SUPPORTED = ("llama", "qwen2", "qwen3", "qwen3moe", "deepseek2")


def _tiny(tmp_path: Path, name: str, **config) -> Path:
    return write_tiny_model(tmp_path / f"{name}.gguf", TinyConfig(**config), default_model_path())


def _fields(tensors) -> dict[str, LayerTensor]:
    return {t.field: t for t in tensors}


# --- the records themselves ---------------------------------------------------------------------

@pytest.mark.parametrize("name", SUPPORTED)
def test_each_supported_architecture_resolves_to_its_record(name):
    arch = architecture_for(name)
    assert arch.name == name
    assert arch.rope_mode == (ggml.ROPE_TYPE_NORM if name in ("llama", "deepseek2") else ggml.ROPE_TYPE_NEOX)


def test_the_supported_set_is_exactly_the_records():
    assert tuple(ARCHITECTURES) == SUPPORTED


def test_an_unsupported_architecture_is_one_line_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as err:
        architecture_for("bert")
    assert str(err.value) == "architecture 'bert' is not supported (supported: llama, qwen2, qwen3, qwen3moe, deepseek2)"


def test_required_and_optional_tensors_per_architecture():
    llama, qwen2, qwen3 = (_fields(architecture_for(n).layer_tensors(0)) for n in ("llama", "qwen2", "qwen3"))
    for name in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"):
        assert llama[name].required and qwen2[name].required and qwen3[name].required
    assert not any(llama[b].required for b in ("bq", "bk", "bv", "bo"))  # used where the file has them
    assert all(qwen2[b].required for b in ("bq", "bk", "bv")) and not qwen2["bo"].required
    assert "q_norm" not in llama and "q_norm" not in qwen2
    assert qwen3["q_norm"].required and qwen3["k_norm"].required
    assert qwen3["q_norm"].shape == ("head_dim",)


def test_model_tensors_required_optional_and_the_tied_head():
    heads = {t.field: t for t in architecture_for("llama").model_tensors}
    assert heads["tok_embd"].required and heads["output_norm"].required
    assert not heads["rope_freqs"].required and not heads["output_b"].required
    assert heads["output"].fallback == "token_embd.weight"  # a tied LM head


def test_qwen3_attention_is_llamas_builder_not_a_copy():
    for name in SUPPORTED:
        if name != "deepseek2":  # latent attention is its own builder
            assert architecture_for(name).attention.build is llama_attention


def test_feed_forward_kind_follows_the_expert_count():
    llama, qwen3, qwen3moe = (architecture_for(n) for n in ("llama", "qwen3", "qwen3moe"))
    assert "ffn_gate" in _fields(llama.feed_forward(0).tensors)
    moe = _fields(llama.feed_forward(8).tensors)
    assert "ffn_gate_inp" in moe and moe["ffn_up_exps"].expert and not moe["ffn_gate_inp"].expert
    assert qwen3moe.feed_forward(8) is llama.feed_forward(8)  # the same MoE block
    with pytest.raises(UnsupportedModelError, match="'qwen3' has no mixture-of-experts layers"):
        qwen3.feed_forward(8)
    with pytest.raises(UnsupportedModelError, match="'qwen3moe' needs experts"):
        qwen3moe.feed_forward(0)


def test_every_record_field_has_a_place_in_the_weights():
    layer_fields = {f.name for f in fields(LayerWeights)}
    for arch in ARCHITECTURES.values():
        for n_expert in (0, 8):
            try:
                tensors = arch.layer_tensors(n_expert)
            except UnsupportedModelError:
                continue
            assert {t.field for t in tensors} <= layer_fields, arch.name


def test_matmul_only_marks_projections_not_norms_or_experts():
    tensors = _fields(architecture_for("qwen3moe").layer_tensors(8))
    assert {f for f, t in tensors.items() if t.matmul_only} == {"wq", "wk", "wv", "wo"}
    dense = _fields(architecture_for("llama").layer_tensors(0))
    assert {f for f, t in dense.items() if t.matmul_only} == {"wq", "wk", "wv", "wo", "ffn_gate", "ffn_up", "ffn_down"}


def test_record_building_blocks_refuse_mistakes():
    with pytest.raises(ValueError, match="unknown dimension"):
        LayerTensor("x", "x.weight", ("n_embd", "width"))
    with pytest.raises(ValueError, match="no tensors"):
        with_required(architecture_for("llama").attention.tensors, "q_norm")


# --- shapes: dimensions from the spec, an FFN's width from the first tensor that has it ----------

def _shape_check(shapes: dict[str, tuple[int, ...]], n_expert: int = 0) -> None:
    spec = SimpleNamespace(n_embd=8, n_embd_q=8, n_embd_kv=4, head_dim=2, n_expert=n_expert, n_head=4, mla=None)
    tensors = architecture_for("llama").layer_tensors(n_expert)
    present = {t.field: t.gguf_name(0) for t in tensors if t.field in shapes}
    gguf = SimpleNamespace(tensors={present[f]: SimpleNamespace(shape=s) for f, s in shapes.items()})
    _check_layer_shapes(gguf, spec, tensors, present)


DENSE = {"attn_norm": (8,), "wq": (8, 8), "wk": (8, 4), "wv": (8, 4), "wo": (8, 8), "ffn_norm": (8,),
         "ffn_gate": (8, 24), "ffn_up": (8, 24), "ffn_down": (24, 8)}


def test_shapes_that_fit_pass():
    _shape_check(DENSE)
    _shape_check({**DENSE, "bq": (8,), "bk": (4,)})
    moe = {k: v for k, v in DENSE.items() if not k.startswith("ffn_") or k == "ffn_norm"}
    _shape_check({**moe, "ffn_gate_inp": (8, 4), "ffn_gate_exps": (8, 16, 4), "ffn_up_exps": (8, 16, 4),
                  "ffn_down_exps": (16, 8, 4)}, n_expert=4)


@pytest.mark.parametrize("field, shape, message", [
    ("wk", (8, 8), r"tensor blk\.0\.attn_k\.weight has shape \[8, 8\], expected \[8, 4\]"),
    ("bk", (8,), r"tensor blk\.0\.attn_k\.bias has shape \[8\], expected \[4\]"),
    ("ffn_down", (16, 8), r"tensor blk\.0\.ffn_down\.weight has shape \[16, 8\], expected \[24, 8\]"),
    ("ffn_gate", (8,), r"tensor blk\.0\.ffn_gate\.weight has shape \[8\], expected \[8, n_ff\]"),
])
def test_a_misshapen_tensor_is_refused_in_one_line(field, shape, message):
    with pytest.raises(UnsupportedModelError, match=message):
        _shape_check({**DENSE, field: shape})


# --- tiny models against their records ----------------------------------------------------------

def _load(path: Path, slice_spec: SliceSpec | None = None, **kwargs) -> tuple[str, ...]:
    """The GGUF tensor names SliceWeights maps for ``slice_spec`` (default: the whole model)."""
    with GGUFFile(path) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        backend = Backend(1)
        try:
            with SliceWeights(gguf, spec, slice_spec or SliceSpec(0, spec.n_layer, True, True), backend,
                              **kwargs) as weights:
                for t in spec.arch.model_tensors:
                    assert hasattr(weights, t.field)
                return weights.tensor_names
        finally:
            backend.close()


@pytest.mark.parametrize("name, config", [
    ("qwen3", dict(arch="qwen3", omit=("blk.1.attn_q_norm.weight",))),
    ("qwen2", dict(arch="qwen2", tied_output=False, omit=("blk.2.attn_v.bias",))),
    ("llama", dict(arch="llama", omit=("blk.0.ffn_up.weight",))),
    ("moe", dict(arch="qwen3moe", n_expert=4, omit=("blk.3.ffn_gate_inp.weight",))),
    ("head", dict(arch="llama", omit=("output_norm.weight",))),
])
def test_a_model_missing_a_required_tensor_is_refused_in_one_line(tmp_path, name, config):
    path = _tiny(tmp_path, name, **config)
    missing = config["omit"][0]
    with pytest.raises(UnsupportedModelError) as err:
        _load(path)
    assert str(err.value) == f"tensor {missing} is missing from the model"


def test_optional_tensors_are_mapped_where_present_and_skipped_where_not(tmp_path):
    qwen2 = _load(_tiny(tmp_path, "qwen2", arch="qwen2", tied_output=False))
    assert "blk.0.attn_q.bias" in qwen2 and "output.bias" in qwen2 and "output.weight" in qwen2
    llama = _load(_tiny(tmp_path, "llama", arch="llama"))  # no biases, a tied head
    assert not any(".bias" in n for n in llama) and "output.weight" not in llama
    assert "token_embd.weight" in llama


def test_a_stage_without_its_experts_needs_none_of_them(tmp_path):
    path = _tiny(tmp_path, "moe", arch="qwen3moe", n_expert=4, omit=("blk.1.ffn_up_exps.weight",))
    names = _load(path, SliceSpec(1, 3), with_experts=False)
    assert "blk.1.ffn_gate_inp.weight" in names and not any("_exps" in n for n in names)


def test_experts_in_an_architecture_without_them_are_refused_by_the_spec(tmp_path):
    path = _tiny(tmp_path, "qwen3x", arch="qwen3", n_expert=4)
    with GGUFFile(path) as gguf, pytest.raises(UnsupportedModelError) as err:
        ModelSpec.from_gguf(gguf)
    assert str(err.value) == "architecture 'qwen3' has no mixture-of-experts layers, but the model has 4 experts"


def test_a_record_with_experts_maps_the_whole_mixture(tmp_path):
    names = _load(_tiny(tmp_path, "llama-moe", arch="llama", n_expert=4), SliceSpec(0, 1))
    assert names == ("blk.0.attn_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                     "blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.0.ffn_norm.weight",
                     "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                     "blk.0.ffn_down_exps.weight")


# --- deepseek2: latent attention's variants, dense leading layers, shared experts ---------------

DEEPSEEK2 = dict(arch="deepseek2", n_expert=4, n_expert_used=2)


def test_deepseek2_spec_reads_latent_attention_and_routing(tmp_path):
    path = _tiny(tmp_path, "ds", **DEEPSEEK2, n_dense_lead=2, sigmoid_gating=True, n_groups=2, n_group_used=1)
    with GGUFFile(path) as gguf:
        spec = ModelSpec.from_gguf(gguf)
    assert (spec.mla.q_rank, spec.mla.kv_rank, spec.mla.k_head, spec.mla.v_head, spec.mla.n_rot) == (32, 32, 48, 32, 16)
    # the cache holds the latent and the RoPE part: one K row of 48 f16 values, no V
    assert spec.kv_widths == (48, 0) and spec.kv_bytes_per_token_per_layer == 96
    assert [spec.is_moe_layer(il) for il in range(4)] == [False, False, True, True]
    assert list(spec.moe_layers) == [2, 3] and spec.n_expert_shared == 1
    assert spec.expert_weights_norm and spec.expert_gating == 2 and (spec.n_expert_groups, spec.n_group_used) == (2, 1)
    assert spec.attention_scale == pytest.approx(48 ** -0.5)  # 1/sqrt(the key's width), not the cached row's


def test_deepseek2_layers_map_their_own_ffn_and_q_variant(tmp_path):
    with_rank = _load(_tiny(tmp_path, "rank", **DEEPSEEK2))
    assert "blk.0.attn_q_a.weight" in with_rank and "blk.0.attn_q.weight" not in with_rank
    assert "blk.0.ffn_gate.weight" in with_rank and not any(n.startswith("blk.0.ffn_") and "exp" in n for n in with_rank)
    assert {"blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_shexp.weight"} <= set(with_rank)
    plain = _load(_tiny(tmp_path, "plain", **DEEPSEEK2, q_rank=0))
    assert "blk.0.attn_q.weight" in plain and not any("attn_q_a" in n for n in plain)
    # a stage whose experts live elsewhere keeps the router and the shared experts
    unsplit = _load(_tiny(tmp_path, "unsplit", **DEEPSEEK2, unsplit_kv_b=True))
    assert "blk.0.attn_kv_b.weight" in unsplit and not any("attn_k_b" in n or "attn_v_b" in n for n in unsplit)
    stage = _load(_tiny(tmp_path, "rank", **DEEPSEEK2), SliceSpec(1, 3), with_experts=False)
    assert "blk.1.ffn_gate_inp.weight" in stage and "blk.1.ffn_down_shexp.weight" in stage
    assert not any("_exps" in n for n in stage)


@pytest.mark.parametrize("name, config, missing", [
    ("q_b", dict(omit=("blk.1.attn_q_b.weight",)), "blk.1.attn_q_b.weight"),
    ("q", dict(q_rank=0, omit=("blk.2.attn_q.weight",)), "blk.2.attn_q.weight"),
    ("shexp", dict(omit=("blk.3.ffn_up_shexp.weight",)), "blk.3.ffn_up_shexp.weight"),
    ("v_b", dict(omit=("blk.0.attn_v_b.weight",)), "blk.0.attn_v_b.weight"),
    ("kv_b", dict(unsplit_kv_b=True, omit=("blk.1.attn_kv_b.weight",)), "blk.1.attn_kv_b.weight"),
])
def test_a_deepseek2_missing_a_tensor_of_its_variant_is_refused_in_one_line(tmp_path, name, config, missing):
    with pytest.raises(UnsupportedModelError) as err:
        _load(_tiny(tmp_path, name, **DEEPSEEK2, **config))
    assert str(err.value) == f"tensor {missing} is missing from the model"


def test_a_deepseek2_whose_heads_do_not_fit_its_latent_is_refused_in_one_line(tmp_path):
    import gguf as gguf_lib

    path = tmp_path / "legacy.gguf"
    writer = gguf_lib.GGUFWriter(str(path), "deepseek2")
    for key, value in (("block_count", 2), ("embedding_length", 8), ("attention.head_count", 2),
                       ("attention.kv_lora_rank", 4)):
        writer.add_uint32(f"deepseek2.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with GGUFFile(path) as gguf, pytest.raises(UnsupportedModelError) as err:
        ModelSpec.from_gguf(gguf)
    # (no key_length_mla: the unsplit form, whose rope part must be smaller than a key head)
    assert "does not fit kv_lora_rank 4" in str(err.value) and "\n" not in str(err.value)


def test_multi_token_prediction_layers_are_left_out_of_the_trunk(tmp_path):
    """A GGUF whose last block is DeepSeek-V3's multi-token-prediction layer (nextn_predict_layers):
    llama.cpp's n_layer excludes it, and so does ours; its tensors are never mapped."""
    path = _tiny(tmp_path, "mtp", **DEEPSEEK2, extra_keys=(("nextn_predict_layers", 1),))
    with GGUFFile(path) as gguf:
        spec = ModelSpec.from_gguf(gguf)
    assert spec.n_layer == 3 and len(spec.layer_bytes) == 3
    assert not any(name.startswith("blk.3.") for name in _load(path))
