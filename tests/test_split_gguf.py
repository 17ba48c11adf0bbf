"""Split GGUFs: a model published in parts (``NAME-00001-of-00003.gguf`` ...), written here the way
llama.cpp's converter splits (gguf's own writer), opens as one model from any of its parts, each
part mapped on its own; the engine on the parts answers as llama-cpp-python on the same parts;
a missing part, a part of another model or a split count that disagrees is one line naming the
file."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from harness.oracle import judge, oracle_greedy
from harness.swarm import swarmctl
from harness.tiny_models import write_split_copy
from kernels.errors import ModelFileError
from kernels.experts import ExpertEngine
from kernels.gguf_file import GGUFFile, split_parts
from kernels.slice import SliceEngine
from kernels.spec import ModelSpec, SliceSpec
from swarmctl.model_files.models import checked_model, resolve_model
from tests.conftest import N_THREADS, make_oracle, run_split

PROMPT = [1, 504, 3458, 282, 260, 1535, 314, 1147, 30]


@pytest.fixture(scope="module")
def split_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("split")


@pytest.fixture(scope="module")
def llama_parts(tiny_model, split_dir) -> list[Path]:
    return write_split_copy(tiny_model("llama-q8_0"), split_dir / "llama" / "tiny-llama.gguf", 3)


@pytest.fixture(scope="module")
def moe_parts(tiny_model, split_dir) -> list[Path]:
    return write_split_copy(tiny_model("deepseek2-q4_1"), split_dir / "moe" / "tiny-moe.gguf", 4)


def _engine(path: Path, start: int = 0, stop: int | None = None, *, first=True, last=True) -> SliceEngine:
    gguf = GGUFFile(path)
    spec = ModelSpec.from_gguf(gguf)
    return SliceEngine(gguf, SliceSpec(start, spec.n_layer if stop is None else stop, first, last),
                       n_threads=N_THREADS)


# --- opening --------------------------------------------------------------------------------------

def test_any_part_opens_the_whole_model_as_the_unsplit_file(tiny_model, llama_parts):
    whole = GGUFFile(tiny_model("llama-q8_0"))
    try:
        for given in (llama_parts[0], llama_parts[2]):
            with GGUFFile(given) as split:
                assert split.path == llama_parts[0] and split.parts == tuple(llama_parts)
                assert len({info.part for info in split.tensors.values()}) == 3  # spread over every part
                assert split.tensors.keys() == whole.tensors.keys()
                for name, info in whole.tensors.items():
                    mine = split.tensors[name]
                    assert (mine.shape, mine.ggml_type) == (info.shape, info.ggml_type)
                    assert bytes(split.tensor_bytes(mine)) == bytes(whole.tensor_bytes(info))
                assert split.layer_hash(1) == whole.layer_hash(1)
                assert list(split.get("tokenizer.ggml.tokens")) == list(whole.get("tokenizer.ggml.tokens"))
                assert split.get("split.count") == 3
                assert ModelSpec.from_gguf(split) == ModelSpec.from_gguf(whole)
    finally:
        whole.close()


def test_a_part_named_on_the_command_line_resolves_to_the_first(llama_parts):
    assert resolve_model(str(llama_parts[1])) == llama_parts[0]
    assert checked_model(llama_parts[2]) == llama_parts[0]
    assert split_parts(llama_parts[0]) == llama_parts


# --- answers --------------------------------------------------------------------------------------

@pytest.mark.slow  # llama-cpp-python loads the parts
def test_the_engine_on_parts_matches_llama_cpp_on_the_same_parts(tiny_model, llama_parts):
    whole = _engine(tiny_model("llama-q8_0"))
    split_engines = [_engine(llama_parts[1], 0, 2, last=False), _engine(llama_parts[2], 2, None, first=False)]
    llm = make_oracle(llama_parts[0])
    try:
        ours = _greedy(split_engines, 12)
        theirs = oracle_greedy(llm, PROMPT, 12)
        verdict = judge(PROMPT, ours, theirs, lambda tokens: run_split(split_engines, tokens), llm)
        assert verdict.passes, verdict.explain()
        # the same kernels on the same bytes: the parts answer bit for bit as the unsplit file
        assert np.array_equal(run_split(split_engines, PROMPT), run_split([whole], PROMPT))
    finally:
        for engine in [whole, *split_engines]:
            engine.close()
        llm.close()


def _greedy(engines: list[SliceEngine], n: int) -> list[int]:
    tokens = list(PROMPT)
    for _ in range(n):
        tokens.append(int(np.argmax(run_split(engines, tokens)[-1])))
    return tokens[len(PROMPT):]


def test_experts_and_slices_spread_over_parts_compute_as_the_unsplit_file(tiny_model, moe_parts):
    whole_path = tiny_model("deepseek2-q4_1")
    with GGUFFile(whole_path) as whole, GGUFFile(moe_parts[0]) as split:
        spec = ModelSpec.from_gguf(whole)
        layer = next(il for il in range(spec.n_layer) if spec.is_moe_layer(il))
        rng = np.random.default_rng(0)
        x = rng.standard_normal((5, spec.n_embd)).astype(np.float32)
        ids = np.array([0, 3, 5, 7, 2])
        a, b = ExpertEngine(whole, range(spec.n_layer), 0, spec.n_expert), ExpertEngine(split, range(spec.n_layer), 0,
                                                                                           spec.n_expert)
        try:
            assert np.array_equal(a.forward(layer, x, ids), b.forward(layer, x, ids))
        finally:
            a.close()
            b.close()
    one, parts = _engine(whole_path), _engine(moe_parts[3])
    try:
        assert np.array_equal(run_split([one], PROMPT), run_split([parts], PROMPT))
    finally:
        one.close()
        parts.close()


# --- bad parts: one line naming the file ----------------------------------------------------------

def test_a_missing_part_is_one_line_naming_it(llama_parts, tmp_path):
    folder = tmp_path / "missing"
    folder.mkdir()
    for part in (llama_parts[0], llama_parts[2]):
        shutil.copy(part, folder / part.name)
    with pytest.raises(ModelFileError) as err:
        GGUFFile(folder / llama_parts[2].name)
    message = str(err.value)
    assert "\n" not in message and llama_parts[1].name in message and "missing" in message


def test_a_part_of_another_model_is_one_line_naming_it(llama_parts, tiny_model, tmp_path):
    """Part 2 of a three-part llama beside parts 1 and 3 of a deepseek2 split in three under the
    same name. (Two quantizations of one model, split alike, cannot be told apart this way: the
    swarm's layer hashes catch those; kernels/gguf_file.py says so.)"""
    other = write_split_copy(tiny_model("deepseek2-q4_1"), tmp_path / "other" / "tiny-llama.gguf", 3)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(other[0], mixed / other[0].name)
    shutil.copy(llama_parts[1], mixed / other[1].name)
    shutil.copy(other[2], mixed / other[2].name)
    with pytest.raises(ModelFileError) as err:
        GGUFFile(mixed / other[0].name)
    assert "\n" not in str(err.value) and "tiny-llama-0000" in str(err.value)
    assert "different models" in str(err.value)


def test_a_split_count_that_disagrees_is_one_line_naming_the_file(llama_parts, tmp_path):
    """A part whose split.count says 4 under a name that says 3."""
    folder = tmp_path / "count"
    folder.mkdir()
    for part in llama_parts:
        shutil.copy(part, folder / part.name)
    target = folder / llama_parts[1].name
    _patch_u16(target, "split.count", 4)
    with pytest.raises(ModelFileError) as err:
        GGUFFile(folder / llama_parts[0].name)
    assert str(err.value).startswith(str(target)) and "split.count is 4" in str(err.value)


def test_a_renamed_part_says_what_it_is(llama_parts, tmp_path):
    renamed = tmp_path / "model.gguf"
    shutil.copy(llama_parts[0], renamed)
    with pytest.raises(ModelFileError) as err:
        GGUFFile(renamed)
    assert "split in 3 parts" in str(err.value) and "\n" not in str(err.value)


def _patch_u16(path: Path, key: str, value: int) -> None:
    """Overwrite a u16 metadata value in place (the header's layout: key length, key, type, value)."""
    data = bytearray(path.read_bytes())
    needle = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", 2)  # GGUFValueType.UINT16
    at = data.index(needle) + len(needle)
    data[at:at + 2] = struct.pack("<H", value)
    path.write_bytes(bytes(data))


# --- the way a user types it ----------------------------------------------------------------------

def test_ask_on_a_local_swarm_from_a_middle_part_answers_as_llama_cpp_on_the_parts(llama_parts):
    """`swarmctl ask --model PART` (a host and a trunk process over QUIC, each opening the parts)."""
    r = swarmctl(None, "ask", "--model", str(llama_parts[1]), "--raw", "--temperature", "0", "--max-tokens", "8",
                 "--head-layers", "1", "The capital of France is", timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == _oracle_completion(llama_parts[0], "The capital of France is", 8) + "\n"


def _oracle_completion(model: Path, prompt: str, n: int) -> str:
    """llama-cpp-python's greedy completion of ``prompt`` on ``model`` (a split model's first part)."""
    llm = make_oracle(model)
    try:
        return llm.create_completion(prompt, max_tokens=n, temperature=0)["choices"][0]["text"]
    finally:
        llm.close()


def test_an_asker_with_no_model_file_fetches_only_its_part_of_a_split_model(llama_parts, tiny_model, tmp_path):
    """The host and a trunk run the model from its parts; a member joined with no model file asks:
    it fetches its part (embedding, head and tail layers, LM head, metadata) from the host, each
    chunk checked, keeps it, and answers as llama-cpp-python on the parts; a second ask fetches
    nothing."""
    from harness.swarm import Swarm
    from swarmctl.model_files.distribution import asker_tensor_names

    swarm = Swarm(tmp_path)
    try:
        swarm.init("--model", str(llama_parts[1]), "--head-layers", "1")
        swarm.start_host()
        swarm.wait_host()
        swarm.join("trunk-a", "--model", str(llama_parts[2]))
        swarm.join("asker", role="asker")
        swarm.start_trunk("trunk-a", capture=False)
        swarm.wait_complete(1)
        question = ("ask", "--raw", "--temperature", "0", "--max-tokens", "8", "-v", "The capital of France is")
        first = swarmctl(swarm.homes["asker"], *question, timeout=300)
        assert first.returncode == 0, first.stderr
        part = next((swarm.homes["asker"] / "parts").glob("*-asker-1.gguf"))
        with GGUFFile(part) as mine, GGUFFile(llama_parts[0]) as whole:
            wanted = asker_tensor_names(whole, 1)
            assert sorted(mine.tensors) == sorted(wanted)
            assert not any(n.startswith("blk.1.") or n.startswith("blk.2.") for n in mine.tensors)  # trunk layers
            assert all(mine.tensor_hash(n) == whole.tensor_hash(n) for n in wanted)
            part_bytes = sum(whole.tensors[n].n_bytes for n in wanted)
            assert "split.count" not in mine.metadata and mine.get("tokenizer.chat_template") == \
                whole.get("tokenizer.chat_template")
        received = float(first.stderr.split("MB received")[0].rsplit("(", 1)[1])
        assert abs(received * 1e6 - part_bytes) <= 0.02 * part_bytes + 0.05e6  # (rounded to 0.1 MB in the log)
        assert first.stdout == _oracle_completion(llama_parts[0], "The capital of France is", 8) + "\n"
        again = swarmctl(swarm.homes["asker"], *question, timeout=300)
        assert again.returncode == 0 and again.stdout == first.stdout
        assert "MB received" not in again.stderr  # kept in the home: nothing fetched
    finally:
        swarm.close()
