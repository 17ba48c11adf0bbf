"""deepseek2 files as llama.cpp's converter writes them (issue 44 item 5).

Tiny fixtures from harness/tiny_models.write_converted_deepseek2, which runs a tiny Hugging Face
checkpoint through convert_hf_to_gguf.py's DeepseekV2Model steps at the commit llama-cpp-python
0.3.36 vendors: DeepSeek-V3 today (split attn_k_b / attn_v_b), the same checkpoint with its MTP
block kept, and as the converter wrote it before the split (attn_kv_b only); Kimi K2 mainline
(one expert group, scale 2.827, YaRN x32 from 4096 with betas 1/1, a 163840-entry vocabulary with
the kimi-k2 pre-tokenizer, no MTP block); DeepSeek-V2-Lite (no Q rank, softmax, 27 layers). Each opens in our engine and in llama-cpp-python, and
answers the same: bit-identical prefill logits and the oracle rule on greedy decoding.

What the installed llama.cpp does not do with these files, and we follow it:
- it ignores rope.scaling.yarn_beta_fast / yarn_beta_slow for deepseek2 (its loader reads them
  for grok and mistral3 only, and llama-cpp-python passes 32 and 1 anyway): Kimi K2's 1 and 1 are
  run as 32 and 1 (test_kimi_k2s_yarn_betas_are_not_read);
- it refuses a file without q_lora_rank (V2-Lite's conversion) unless the file has 26 or 27 layers
  (test_deepseek_v2_lite_without_a_q_rank_key);
- it never runs the MTP block through llama-cpp-python (the block's tensors are skipped at
  load), so our nextn layer is checked by speculation's exactness, not against the oracle.
The kimi-k2 pre-tokenizer is known to the installed llama.cpp (llama-vocab.cpp,
LLAMA_VOCAB_PRE_TYPE_KIMI_K2); the vocabulary's BPE ranks are a stand-in (the bundled model's),
since Kimi's tiktoken ranks are not here.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from harness.oracle import _is_eog, judge, oracle_greedy, oracle_logits
from harness.swarm import swarmctl
from harness.tiny_models import (_HF_LAYER_NAMES, CONVERTED_DEEPSEEK2, KIMI_K2_VOCAB, gguf_name_of,
                                 write_converted_deepseek2)
from kernels.gguf_file import GGUFFile, write_header
from kernels.oracle_llama import load_llama
from kernels.sampling import SamplingParams
from kernels.slice import SliceEngine
from kernels.spec import GATING_SIGMOID, ModelSpec, SliceSpec
from swarmctl.asker.head_tail import Asker, generate_all
from swarmctl.asker.speculate import MtpDraft, speculation_for
from tests.conftest import N_THREADS, run_split

T = gguf.GGUFValueType
N_CTX = 64  # the oracle's context: logits_all keeps n_ctx x n_vocab floats (42 MB at Kimi's vocabulary)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, bundled_model):
    """converted(name) → that converted file, written on first use; "deepseek-v3-mtp-stripped" is the
    MTP file with its block's tensors taken out (its metadata still counts the block), which
    llama.cpp loads as a trunk-only file."""
    folder, cache = tmp_path_factory.mktemp("converted"), {}

    def get(name: str) -> Path:
        if name not in cache:
            if name == "deepseek-v3-mtp-stripped":
                cache[name] = _without_layer(get("deepseek-v3-mtp"), folder / f"{name}.gguf", "blk.4.")
            else:
                cache[name] = write_converted_deepseek2(folder / f"{name}.gguf", tokenizer_source=bundled_model,
                                                        **CONVERTED_DEEPSEEK2[name])
        return cache[name]

    return get


def _without_layer(source: Path, dest: Path, prefix: str) -> Path:
    """``source`` with the tensors whose names start with ``prefix`` left out, metadata unchanged."""
    with GGUFFile(source) as f:
        n_kv, kv = f.raw_metadata()
        kept = [info for info in f.tensors.values() if not info.name.startswith(prefix)]
        offsets, _ = write_header(dest, n_kv, kv, [(i.name, i.shape, i.ggml_type, i.n_bytes) for i in kept],
                                  int(f.get("general.alignment", 32)))
        with open(dest, "r+b") as out:
            for info, offset in zip(kept, offsets):
                out.seek(offset)
                out.write(f.tensor_bytes(info))
    return dest


def _oracle(path: Path):
    return load_llama(path, n_ctx=N_CTX, n_threads=N_THREADS, n_threads_batch=N_THREADS, logits_all=True)


_SCALARS = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i",
            T.FLOAT32: "<f", T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}


def _fields(path: Path) -> tuple[dict[str, tuple[object, T]], dict[str, tuple[tuple[int, ...], str]]]:
    """key → (value, type as written; an array's value is its length) and tensor → (ggml shape, type
    name). The header read here by hand (gguf's GGUFReader takes seconds over 163840 tokens)."""
    with open(path, "rb") as f:
        buf = f.read()
    at = 8  # magic, version

    def read(fmt: str):
        nonlocal at
        (value,) = struct.unpack_from(fmt, buf, at)
        at += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal at
        n = read("<Q")
        at += n
        return buf[at - n:at].decode()

    def value(vtype: T):
        if vtype == T.STRING:
            return string()
        if vtype != T.ARRAY:
            return read(_SCALARS[vtype])
        element, count = T(read("<I")), read("<Q")
        for _ in range(count):
            value(element)
        return count

    n_tensors, n_kv = read("<Q"), read("<Q")
    keys = {}
    for _ in range(n_kv):
        key, vtype = string(), T(read("<I"))
        keys[key] = (value(vtype), vtype)
    with GGUFFile(path) as f:
        tensors = {name: (info.shape, info.type_name) for name, info in f.tensors.items()}
    assert len(tensors) == n_tensors
    return keys, tensors


def test_the_hf_to_gguf_names_are_gguf_pys():
    """The fixture's name map is the one the converter uses (gguf-py's, installed at the same
    version as the vendored one), wherever the installed gguf-py maps the name at all (it lacks the
    nextn.* names, which the vendored tensor_mapping.py has)."""
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, 8)
    checked = 0
    for hf_part in _HF_LAYER_NAMES:
        suffix = "bias" if hf_part.endswith("e_score_correction") else "weight"
        hf_name = f"model.layers.3.{hf_part}.{suffix}"
        theirs = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if theirs is not None:
            assert gguf_name_of(hf_name) == theirs
            checked += 1
    for hf_name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert gguf_name_of(hf_name) == tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert checked >= 23


@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
def test_kimi_k2_carries_the_converters_keys_tensors_and_types(converted):
    keys, tensors = _fields(converted("kimi-k2"))
    a = "deepseek2."
    expect = {
        # MLA as MQA: one cached "head" of kv_lora_rank + rope (576 at Kimi's size), values kv_lora_rank (512)
        a + "attention.head_count_kv": (1, T.UINT32), a + "attention.key_length": (32 + 16, T.UINT32),
        a + "attention.value_length": (32, T.UINT32), a + "attention.key_length_mla": (32 + 16, T.UINT32),
        a + "attention.value_length_mla": (32, T.UINT32), a + "attention.q_lora_rank": (32, T.UINT32),
        a + "rope.scaling.type": ("yarn", T.STRING), a + "rope.scaling.factor": (32.0, T.FLOAT32),
        a + "rope.scaling.original_context_length": (4096, T.UINT32),
        a + "rope.scaling.yarn_beta_fast": (1.0, T.FLOAT32), a + "rope.scaling.yarn_beta_slow": (1.0, T.FLOAT32),
        a + "rope.freq_base": (50000.0, T.FLOAT32), a + "context_length": (131072, T.UINT32),
        a + "expert_gating_func": (2, T.UINT32), a + "expert_weights_norm": (True, T.BOOL),
        a + "expert_group_count": (1, T.UINT32), a + "expert_group_used_count": (1, T.UINT32),
        a + "leading_dense_block_count": (1, T.UINT32), a + "vocab_size": (KIMI_K2_VOCAB, T.UINT32),
        "tokenizer.ggml.model": ("gpt2", T.STRING), "tokenizer.ggml.pre": ("kimi-k2", T.STRING),
        "tokenizer.ggml.tokens": (KIMI_K2_VOCAB, T.ARRAY), "tokenizer.ggml.bos_token_id": (163584, T.UINT32),
        "general.file_type": (7, T.UINT32),
    }
    for key, want in expect.items():
        assert keys.get(key) == want, key
    scale, log_mul = keys[a + "expert_weights_scale"], keys[a + "rope.scaling.yarn_log_multiplier"]
    assert scale[1] == log_mul[1] == T.FLOAT32 and np.float32(scale[0]) == np.float32(2.827)
    assert np.float32(log_mul[0]) == np.float32(0.1)  # 0.1 x mscale_all_dim
    assert a + "nextn_predict_layers" not in keys and not any("nextn" in n for n in tensors)
    # Kimi K2 mainline has 1096 tensors: 3 + 13 per dense layer + 18 per MoE layer (61 layers, 1 dense)
    assert 3 + 13 * 1 + 18 * 60 == 1096 and len(tensors) == 3 + 13 * 1 + 18 * 3
    assert tensors["blk.1.attn_k_b.weight"] == ((32, 32, 4), "Q8_0")  # [qk_nope, kv_rank, heads]
    assert tensors["blk.1.attn_v_b.weight"] == ((32, 32, 4), "Q8_0")  # [kv_rank, v_head, heads]
    assert tensors["blk.1.ffn_down_exps.weight"] == ((64, 64, 8), "Q8_0")
    assert tensors["output.weight"] == ((64, KIMI_K2_VOCAB), "Q8_0")
    for name, (_, kind) in tensors.items():
        small = name.endswith(("norm.weight", "exp_probs_b.bias", "ffn_gate_inp.weight"))
        assert kind == ("F32" if small else "Q8_0"), name
    with GGUFFile(converted("kimi-k2")) as f:
        spec = ModelSpec.from_gguf(f)
    assert spec.mla.absorbed and (spec.mla.k_head, spec.mla.v_head, spec.mla.n_rot) == (48, 32, 16)
    assert (spec.n_layer, spec.n_nextn, spec.n_layer_dense_lead, spec.n_vocab) == (4, 0, 1, KIMI_K2_VOCAB)
    assert spec.expert_gating == GATING_SIGMOID and spec.expert_weights_norm
    assert spec.rope.freq_scale == pytest.approx(1 / 32) and spec.rope.n_ctx_orig == 4096


@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
def test_deepseek_v3_with_mtp_and_before_the_split(converted):
    """The MTP block kept: block_count counts it, nextn_predict_layers says 1, blk.4 holds a whole
    MoE block plus its nextn.* tensors. Before the split: attn_kv_b [kv_rank, heads x (nope + v)],
    full heads as KV heads, key/value lengths of full heads, no *_mla keys."""
    keys, tensors = _fields(converted("deepseek-v3-mtp"))
    assert keys["deepseek2.block_count"] == (5, T.UINT32) and keys["deepseek2.nextn_predict_layers"] == (1, T.UINT32)
    for part in ("eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_norm", "shared_head_head"):
        assert f"blk.4.nextn.{part}.weight" in tensors
    assert len([n for n in tensors if n.startswith("blk.4.")]) == 18 + 6
    assert tensors["blk.4.nextn.embed_tokens.weight"] == ((64, 49152), "Q8_0")
    with GGUFFile(converted("deepseek-v3-mtp")) as f:
        assert (ModelSpec.from_gguf(f).n_layer, ModelSpec.from_gguf(f).n_nextn) == (4, 1)

    keys, tensors = _fields(converted("deepseek-v3-kv-b"))
    assert keys["deepseek2.attention.head_count_kv"] == (4, T.UINT32)
    assert keys["deepseek2.attention.key_length"] == (48, T.UINT32)
    assert keys["deepseek2.attention.value_length"] == (32, T.UINT32)
    assert not any(k.endswith("_mla") for k in keys) and not any(".attn_k_b." in n or ".attn_v_b." in n for n in tensors)
    assert tensors["blk.0.attn_kv_b.weight"] == ((32, 4 * (32 + 32)), "Q8_0")
    assert keys["deepseek2.expert_group_count"] == (4, T.UINT32)
    assert keys["deepseek2.rope.scaling.factor"] == (40.0, T.FLOAT32)


@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
def test_deepseek_v2_lite_without_a_q_rank_key(converted, tmp_path, bundled_model):
    """V2-Lite's q_lora_rank is null, so the converter writes no q_lora_rank key; with softmax
    scoring and norm_topk_prob false: gating 1 and no expert_weights_norm key; mscale_all_dim 0.707
    gives a log multiplier of 0.0707. llama.cpp reads a file without the key only when it has 26 or
    27 layers (its is_lite guess; V2-Lite has 27): the same file cut to 4 layers it refuses, which
    our engine runs (nothing to compare it with)."""
    keys, tensors = _fields(converted("deepseek-v2-lite"))
    a = "deepseek2."
    assert a + "attention.q_lora_rank" not in keys and a + "expert_weights_norm" not in keys
    assert "blk.0.attn_q.weight" in tensors and not any(".attn_q_a." in n for n in tensors)
    assert keys[a + "expert_gating_func"] == (1, T.UINT32) and keys[a + "expert_shared_count"] == (2, T.UINT32)
    assert keys[a + "expert_weights_scale"] == (1.0, T.FLOAT32) and keys[a + "block_count"] == (27, T.UINT32)
    assert np.float32(keys[a + "rope.scaling.yarn_log_multiplier"][0]) == np.float32(0.1 * 0.707)
    from dataclasses import replace

    args = CONVERTED_DEEPSEEK2["deepseek-v2-lite"]
    short = write_converted_deepseek2(tmp_path / "lite-4.gguf", tokenizer_source=bundled_model,
                                      **dict(args, hf=replace(args["hf"], num_hidden_layers=4)))
    with pytest.raises(ValueError, match="Failed to load model"):
        _oracle(short)
    with GGUFFile(short) as f, SliceEngine(f, SliceSpec(0, 4, True, True), n_threads=N_THREADS,
                                           max_context=N_CTX) as engine:
        assert np.isfinite(run_split([engine], [1, 504, 3000])).all()


@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-kv-b", "deepseek-v3-mtp", "deepseek-v3-mtp-stripped",
                                  "deepseek-v2-lite", "kimi-k2"])
def test_a_converted_file_answers_as_llama_cpp(converted, name):
    """Prefill logits are llama-cpp-python's exact bits; greedy decoding passes the oracle rule."""
    path = converted(name)
    llm = _oracle(path)
    try:
        with GGUFFile(path) as f:
            spec = ModelSpec.from_gguf(f)
            with SliceEngine(f, SliceSpec(0, spec.n_layer, True, True), n_threads=N_THREADS,
                             max_context=N_CTX) as engine:
                tokens = [1, 504, 3000, 200, 17, 900, 33]
                np.testing.assert_array_equal(run_split([engine], tokens), oracle_logits(llm, tokens))
                prompt = [int(t) for t in llm.tokenize(b"The capital of France is", add_bos=True)]
                theirs = oracle_greedy(llm, prompt, 12)
                ours = _greedy(engine, llm, prompt, 12)
                verdict = judge(prompt, ours, theirs, lambda t: run_split([engine], t), llm)
        assert verdict.passes, f"{name}: {verdict.explain()}"
    finally:
        llm.close()


def _greedy(engine: SliceEngine, llm, prompt: list[int], n: int) -> list[int]:
    rid, out = secrets.token_bytes(16), []
    try:
        logits = engine.forward(rid, start_pos=0, tokens=prompt)
        while len(out) < n:
            token = int(np.argmax(logits[-1]))
            if _is_eog(llm, token):
                break
            out.append(token)
            logits = engine.forward(rid, start_pos=len(prompt) + len(out) - 1, tokens=[token])
        return out
    finally:
        engine.release(rid)


@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
def test_kimi_k2s_yarn_betas_are_not_read(converted, tmp_path, bundled_model):
    """Kimi K2's files say yarn_beta_fast 1 and yarn_beta_slow 1; llama.cpp runs deepseek2 with 32 and
    1 whatever they say, and so do we: a copy of the file saying 32 gives the same bits in both."""
    from dataclasses import replace

    from harness.tiny_models import HFConfig

    args = dict(CONVERTED_DEEPSEEK2["kimi-k2"], hf=replace(HFConfig(), rope_scaling=("yarn", 32.0, 4096, 32.0, 1.0,
                                                                                         1.0, 1.0)))
    other = write_converted_deepseek2(tmp_path / "betas-32.gguf", tokenizer_source=bundled_model, **args)
    tokens = [1, 504, 3000, 200, 17, 900, 33]
    rows = []
    for path in (converted("kimi-k2"), other):
        llm = _oracle(path)
        try:
            with GGUFFile(path) as f, SliceEngine(f, SliceSpec(0, 4, True, True), n_threads=N_THREADS,
                                                  max_context=N_CTX) as engine:
                rows.append((run_split([engine], tokens), oracle_logits(llm, tokens)))
        finally:
            llm.close()
    (ours_1, theirs_1), (ours_32, theirs_32) = rows
    np.testing.assert_array_equal(theirs_1, theirs_32)
    np.testing.assert_array_equal(ours_1, ours_32)


@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
def test_the_split_and_the_pre_split_files_are_one_model(tmp_path, bundled_model):
    """One checkpoint converted with k_b / v_b and with the older attn_kv_b (F32, so both layouts
    hold the same numbers): the same model, by our engine and by llama.cpp, to float rounding.
    This is what shows the fixture splits and transposes kv_b as the converter does."""
    logits = {}
    for legacy in (False, True):
        args = dict(CONVERTED_DEEPSEEK2["deepseek-v3"], legacy_kv_b=legacy, outtype="F32")
        path = write_converted_deepseek2(tmp_path / f"v3-{legacy}.gguf", tokenizer_source=bundled_model, **args)
        llm = _oracle(path)
        try:
            with GGUFFile(path) as f, SliceEngine(f, SliceSpec(0, 4, True, True), n_threads=N_THREADS,
                                                  max_context=N_CTX) as engine:
                tokens = [1, 504, 3000, 200, 17, 900, 33, 4000, 12]
                logits[legacy] = (run_split([engine], tokens), oracle_logits(llm, tokens))
        finally:
            llm.close()
    for i in (0, 1):  # ours, llama.cpp's
        split, unsplit = logits[False][i], logits[True][i]
        cos = (split * unsplit).sum(1) / (np.linalg.norm(split, axis=1) * np.linalg.norm(unsplit, axis=1))
        assert cos.min() > 0.99999 and np.abs(split - unsplit).max() < 0.05, (i, cos.min())
        assert (split.argmax(1) == unsplit.argmax(1)).all()


@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
def test_speculate_mtp_runs_the_converted_mtp_block_and_changes_nothing(converted):
    """--speculate mtp on the DeepSeek-V3 file with its MTP block (own embed_tokens and
    shared_head_head, as the checkpoint has them): greedy output equals plain decoding."""
    path = converted("deepseek-v3-mtp")
    asker = Asker(path, 2, n_threads=N_THREADS, max_context=128)  # every layer at the asker
    draft = MtpDraft(path, n_threads=N_THREADS, max_context=128)
    prompt = asker.tokenizer.encode_prompt("One, two, three,")
    greedy = SamplingParams(temperature=0)
    try:
        async def runs():
            plain = await generate_all(asker, prompt, None, max_tokens=16, sampling=greedy, ignore_eos=True)
            spec = await generate_all(asker, prompt, None, max_tokens=16, sampling=greedy, ignore_eos=True,
                                      speculation=speculation_for("mtp", draft))
            return plain, spec

        plain, spec = asyncio.run(runs())
    finally:
        draft.close()
        asker.close()
    assert len(plain.tokens) == 16 and spec.tokens == plain.tokens and spec.drafted > 0


@pytest.mark.parametrize("name, says", [
    ("kimi-k2", "has no multi-token-prediction (nextn) layer; "),
    ("deepseek-v3-mtp-stripped", "has no multi-token-prediction (nextn) layer: its metadata counts 1 but "
                                 "blk.4.nextn.eh_proj.weight is not in the file"),
])
@pytest.mark.slow  # files written, models loaded into llama.cpp: seconds
def test_speculate_mtp_on_a_file_without_an_mtp_block_is_one_line(converted, name, says):
    path = converted(name)
    result = swarmctl(None, "ask", "--transport", "inproc", "--model", str(path), "--head-layers", "1",
                      "--speculate", "mtp", "hi")
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert says in lines[0] and path.name in lines[0] and "Traceback" not in result.stderr
