"""Issue 33 item 2: the Kimi K2 and DeepSeek-V3 layouts at the quantizations people run, summed over
the tensor list a real GGUF holds with ggml's own block sizes, and llama-quantize's mixes against
the file sizes published for them. No weights, no processes but one CLI run."""

from __future__ import annotations

import subprocess
import sys
from math import prod
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from kernels import ggml
from kernels.errors import EngineError
from plans.layout import MLA_MOE_LAYOUTS, layout_by_name
from plans.quant import BLOCKS, deepseek2_tensors

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "plans" / "examples" / "kimi-thirty-gpus.json"


def ggml_row_bytes(ggml_type: str, n: int) -> int:
    """One row's bytes, from the installed ggml's type traits (not from plans/quant.py's table)."""
    t = GGMLQuantizationType[ggml_type].value
    assert n % ggml.blck_size(t) == 0, (ggml_type, n)
    return n // ggml.blck_size(t) * ggml.type_size(t)


def test_the_block_sizes_are_ggmls_own():
    for name, (block, size) in BLOCKS.items():
        t = GGMLQuantizationType[name].value
        assert (ggml.blck_size(t), ggml.type_size(t)) == (block, size), name


# the type llama-quantize --pure gives attn_k_b, whose 128-long rows no 256-weight block divides
K_B = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q8_0": "Q8_0", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL"}


@pytest.mark.parametrize("model", ["kimi-k2", "deepseek-v3"])
@pytest.mark.parametrize("q", list(K_B))
def test_a_uniform_layout_is_the_sum_of_ggml_row_sizes_over_the_tensor_list(model, q):
    layout = layout_by_name(f"{model}-{q.lower()}")
    dims = MLA_MOE_LAYOUTS[f"{model}-{q.lower()}"]
    per_layer, embedding, head = [0] * 61, 0, 0
    for t in deepseek2_tensors(**dims):
        if len(t.shape) == 1 or "ffn_gate_inp" in t.name:  # norms, routing bias, router: F32 as converted
            ggml_type = "F32"
        else:
            ggml_type = K_B[q] if "attn_k_b" in t.name else q
        size = ggml_row_bytes(ggml_type, t.shape[0]) * prod(t.shape[1:])
        if t.name == "token_embd.weight":
            embedding += size
        elif t.layer is None:
            head += size
        else:
            per_layer[t.layer] += size
    assert layout.layer_bytes == tuple(per_layer)
    assert (layout.embedding_bytes, layout.lm_head_bytes) == (embedding, head)
    # (the tensor list itself is checked against the published parameter counts in test_kimi_plan.py)
    assert layout.total_bytes == sum(per_layer) + embedding + head


# What llama-quantize's file types make of these models, against the sizes published for files made
# with it (GB = 1e9 bytes): mradermacher's static DeepSeek-V3 quants and bartowski's DeepSeek-V3-0324
# (both made with the unsplit attn_kv_b of early 2025 conversions), unsloth's Kimi K2 Q8_0 ("1.09TB").
PUBLISHED = [("deepseek-v3-q2_k-mix", 244.1), ("deepseek-v3-q3_k_m", 319.3), ("deepseek-v3-q4_k_m", 404.5),
             ("deepseek-v3-q8_0", 713.29), ("kimi-k2-q8_0", 1090.0)]


@pytest.mark.parametrize("name, published_gb", PUBLISHED)
def test_llama_quantizes_mixes_match_the_published_file_sizes(name, published_gb):
    tolerance = 0.01 if name == "kimi-k2-q8_0" else 0.001  # "1.09 TB" is rounded to 10 GB
    assert layout_by_name(name).total_bytes / 1e9 == pytest.approx(published_gb, rel=tolerance)


def test_the_mixes_give_the_tensors_llama_quantize_gives_them():
    uniform, mix = layout_by_name("kimi-k2-q2_k"), layout_by_name("kimi-k2-q2_k-mix")
    moe = 30
    expert = 7168 * 2048 * 384  # one of a MoE layer's three routed-expert tensors
    # Q2_K's mix puts every ffn_down (the routed experts' included) and attn_output at Q3_K
    assert mix.expert_bytes[moe] - uniform.expert_bytes[moe] == expert * (110 - 84) // 256
    assert mix.attention_bytes[moe] - uniform.attention_bytes[moe] == 64 * 128 * 7168 * (110 - 84) // 256
    # and the output matrix at Q6_K, the token embedding at the file's Q2_K
    assert mix.lm_head_bytes - uniform.lm_head_bytes == 7168 * 163840 * (210 - 84) // 256
    assert mix.embedding_bytes == uniform.embedding_bytes
    # Q4_K_M: ffn_down at Q6_K on the layers use_more_bits picks (the first 7, the last 8, every third)
    q4, q4m = layout_by_name("kimi-k2-q4_k"), layout_by_name("kimi-k2-q4_k_m")
    more = [il for il in range(1, 61) if q4m.expert_bytes[il] > q4.expert_bytes[il]]
    assert more == [il for il in range(1, 61) if il < 7 or il >= 53 or (il - 7) % 3 == 2]
    assert q4m.attention_bytes == q4.attention_bytes
    # Q8_0's file type keeps every tensor at Q8_0: no mix to tell apart
    assert "kimi-k2-q8_0-mix" not in MLA_MOE_LAYOUTS
    sizes = [layout_by_name(f"kimi-k2-{q}").total_bytes for q in ("iq2_xxs", "iq2_xs", "q2_k", "q3_k", "q4_k", "q8_0")]
    assert sizes == sorted(sizes)


def test_every_quantization_plans_the_thirty_gpus_and_an_unknown_name_is_one_line(capsys):
    from swarmctl.cli import main

    for name in MLA_MOE_LAYOUTS:
        if not name.startswith("kimi-k2"):
            continue
        rc = main(["plan", "--layout", name, "--nodes", str(EXAMPLE), "--head-layers", "1"])
        out, err = capsys.readouterr()
        if name == "kimi-k2-q8_0":  # 1.09 TB on cards and RAM that offer 1.09 TB less the KV caches
            assert rc != 0 and len(err.strip().splitlines()) == 1 and "GB missing" in err
        else:
            assert rc == 0 and out.startswith(f"plan for {name}: 61 layers") and "tokens/s" in out, err
    with pytest.raises(EngineError, match="unknown layout 'kimi-k2-q4_k_s'.*kimi-k2-q4_k_m.*kimi-k2-iq2_xs-mix"):
        layout_by_name("kimi-k2-q4_k_s")
    r = subprocess.run([sys.executable, "-m", "swarmctl", "plan", "--layout", "kimi-k2-q4_k_s", "--nodes",
                        str(EXAMPLE)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert all(name in r.stderr for name in MLA_MOE_LAYOUTS)
