"""An expert node with no model file fetches exactly its experts (swarmctl/model_files/expert_slices.py).

In one process first: the host's manifest for experts [first, last) of the trunk's layers, the
member's file written chunk by chunk from the host's bytes (each chunk checked against the host's
hash, only the experts' slabs kept), then that file's ExpertEngine against the model file's, bit
for bit. With the real 1 MiB chunks a tiny model's expert tensor is one chunk; with 4 KiB chunks
(the same code, the chunk size patched) the experts' slabs start and end inside chunks, which is
what a real model's do. Then a real swarm whose two expert nodes have no model file.
"""

from __future__ import annotations


import numpy as np
import pytest

import kernels.gguf_file
import swarmctl.model_files.distribution as distribution
from kernels.errors import EngineError
from kernels.experts import EXPERT_TENSORS, ExpertEngine
from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from swarmctl.model_files.distribution import SliceFile, SliceManifest, WrongChunk
from swarmctl.model_files.expert_slices import build_expert_manifest, expert_slice_path
from tests.conftest import N_THREADS
from harness.swarm import Swarm, swarmctl

LAYERS = range(1, 3)  # the tiny models' trunk: the asker keeps layers 0 and 3


def _fetch_in_process(gguf: GGUFFile, folder, first: int, last: int) -> tuple[SliceManifest, SliceFile]:
    """What fetch_file does with the host's bytes, without the wire: every chunk the manifest asks
    for, checked and written."""
    manifest = SliceManifest.from_dict(build_expert_manifest(gguf, LAYERS.start, LAYERS.stop, first, last,
                                                             "ab" * 32).to_dict())
    out = SliceFile(expert_slice_path(folder, manifest.model_hash, LAYERS.start, LAYERS.stop, first, last), manifest)
    for chunk in manifest.chunk_ids():
        i, j = (int(x) for x in chunk.split(":"))
        data = gguf.tensor_bytes(gguf.tensors[manifest.tensors[i].name])
        out.write(i, j * distribution.CHUNK, bytes(data[j * distribution.CHUNK:(j + 1) * distribution.CHUNK]))
    assert out.complete
    return manifest, out


def _tensor_bytes(path) -> int:
    with GGUFFile(path) as gguf:
        return sum(t.n_bytes for t in gguf.tensors.values())


@pytest.fixture(params=[None, 4096], ids=["1MiB-chunks", "4KiB-chunks"])
def chunk(request, monkeypatch):
    if request.param:
        monkeypatch.setattr(kernels.gguf_file, "HASH_CHUNK", request.param)
        monkeypatch.setattr(distribution, "CHUNK", request.param)
    return distribution.CHUNK


@pytest.mark.parametrize("name", ["qwen3moe-q8_0", "deepseek2-f32"])
def test_a_fetched_expert_file_holds_just_its_experts_and_computes_the_same_bits(tiny_model, tmp_path, chunk, name):
    with GGUFFile(tiny_model(name)) as gguf:
        spec = ModelSpec.from_gguf(gguf)
        layer_hashes = [gguf.layer_hash(il) for il in range(spec.n_layer)]
        for first, last in ((0, 3), (3, spec.n_expert)):
            manifest, out = _fetch_in_process(gguf, tmp_path, first, last)
            expert_names = {f"blk.{il}.{s}.weight" for il in LAYERS if spec.is_moe_layer(il) for s in EXPERT_TENSORS}
            assert {t.name for t in manifest.tensors} == expert_names  # nothing but expert tensors
            kept = sum(gguf.tensors[n].n_bytes // spec.n_expert * (last - first) for n in expert_names)
            # what moved: the chunks holding its slabs, at most one chunk more at each end of each tensor
            assert kept <= manifest.n_bytes <= kept + 2 * chunk * len(expert_names)
            path = out.finish(layer_hashes)
            with GGUFFile(path) as fetched:
                assert sum(t.n_bytes for t in fetched.tensors.values()) == kept  # exactly its experts
                mine = ExpertEngine(fetched, LAYERS, first, last, n_threads=N_THREADS)
                full = ExpertEngine(gguf, LAYERS, first, last, n_threads=N_THREADS)
                part = ExpertEngine(fetched, LAYERS, first + 1, last, n_threads=N_THREADS)  # a sub-range too
                try:
                    rng = np.random.default_rng(first)
                    x = rng.standard_normal((6, spec.n_embd)).astype(np.float32)
                    ids = rng.integers(first + 1, last, 6)
                    for il in mine.moe_layers:
                        np.testing.assert_array_equal(mine.forward(il, x, ids), full.forward(il, x, ids))
                        np.testing.assert_array_equal(part.forward(il, x, ids), full.forward(il, x, ids))
                finally:
                    for engine in (mine, full, part):
                        engine.close()


def test_wrong_chunks_and_hashes_that_are_not_the_plans_are_refused(tiny_model, tmp_path, chunk):
    with GGUFFile(tiny_model("qwen3moe-q8_0")) as gguf:
        layer_hashes = [gguf.layer_hash(il) for il in range(ModelSpec.from_gguf(gguf).n_layer)]
        manifest = build_expert_manifest(gguf, LAYERS.start, LAYERS.stop, 2, 5, "cd" * 32)
        out = SliceFile(tmp_path / "x.gguf", manifest)
        i, j = (int(x) for x in manifest.chunk_ids()[0].split(":"))
        data = bytearray(gguf.tensor_bytes(gguf.tensors[manifest.tensors[i].name])[j * chunk:(j + 1) * chunk])
        data[-1] ^= 1
        with pytest.raises(WrongChunk):
            out.write(i, j * chunk, bytes(data))
        assert not out.done

        # a manifest whose chunk hashes are self-consistent but not the model the plan names
        _, out = _fetch_in_process(gguf, tmp_path / "other", 2, 5)
        name = next(iter(out.manifest.other_tensors))
        out.manifest.other_tensors[name] = "0" * 64
        with pytest.raises(EngineError, match="do not match the swarm's hashes"):
            out.finish(layer_hashes)
        assert not list((tmp_path / "other").glob("*.gguf"))


def test_a_host_refuses_expert_ranges_outside_the_model(tiny_model):
    with GGUFFile(tiny_model("qwen3moe-q8_0")) as gguf:
        with pytest.raises(EngineError, match="outside the model's 8"):
            build_expert_manifest(gguf, 1, 3, 4, 9, "ef" * 32)
        with pytest.raises(ValueError, match="experts"):
            SliceManifest.from_dict({**build_expert_manifest(gguf, 1, 3, 0, 4, "ef" * 32).to_dict(),
                                     "experts": [5, 4, 8]})


def test_expert_nodes_with_no_model_file_fetch_their_experts_and_answer_identically(tiny_model, tmp_path):
    """Host, two stage trunks and an asker with the model; two expert nodes with none. Each expert
    node fetches its half of the experts (the chunks holding them: one per tensor in a tiny model),
    keeps exactly its experts' bytes, and the swarm answers as one process does."""
    model = str(tiny_model("qwen3moe-q8_0"))
    s = Swarm(tmp_path)
    nodes = ("experts-a", "experts-b")
    try:
        s.init("--model", model, "--head-layers", "1", "--expert-nodes", "2", "--context", "512")
        s.start_host()
        s.wait_host()
        for name in ("stage-a", "stage-b", "asker"):
            s.join(name, "--model", model)
        for name in nodes:
            s.join(name, "--model", str(tmp_path / "no-such-model.gguf"))
        for name in ("stage-a", "stage-b"):  # (as test_moe's swarm: with one stage, a re-plan may make
            s.start_trunk(name, "--threads", "1", "--memory", "1G", capture=False)  # an expert node a stage)
        for name in nodes:  # the planner gives experts to the members with the most memory
            s.start_trunk(name, "--threads", "1", "--memory", "2G", capture=False)
        s.wait_complete(2, expert_nodes=nodes)

        ask = ("ask", "--raw", "--temperature", "0", "--max-tokens", "16", "Once upon a time")
        answer = swarmctl(s.homes["asker"], *ask, check=True).stdout
        assert answer.strip() and answer == swarmctl(None, *ask, "--transport", "inproc", "--model", model,
                                                     "--head-layers", "1", check=True).stdout
        with GGUFFile(model) as gguf:
            n_expert = ModelSpec.from_gguf(gguf).n_expert
            sizes = [gguf.tensors[f"blk.{il}.{stem}.weight"].n_bytes for il in LAYERS for stem in EXPERT_TENSORS]
        whole = sum(sizes)
        # (plans move as trunks register and prove themselves: the split of the experts may have
        # changed once or twice on the way, each node fetching the experts of each range it was given)
        members = {m["name"]: m for m in s.status()["members"]}
        for name in nodes:
            first, last = members[name]["experts"]
            mine = sum(n // n_expert * (last - first) for n in sizes)
            stats = s.stats_of(name)
            assert stats["role"] == "experts" and stats["expert_rows_served"] > 0
            assert stats["tensor_bytes"] == mine  # exactly its experts are kept and served
            slices = s.homes[name] / "slices"
            assert not list(slices.glob("*.progress"))
            current = list(slices.glob(f"*-experts-{first}-{last}.gguf"))
            assert len(current) == 1 and _tensor_bytes(current[0]) == mine
            # tiny tensors: one chunk holds each whole, so each expert fetch moved them whole (and a
            # trial plan before the expert nodes were placed may have had it fetch a stage's layers)
            expert_files = list(slices.glob("*-experts-*.gguf"))
            others = sum(_tensor_bytes(p) for p in slices.glob("*.gguf") if p not in expert_files)
            assert stats["fetched_bytes"] == whole * len(expert_files) + others
            print(name, "fetched", stats["fetched_bytes"], "bytes:", len(expert_files), "expert files of", whole,
                  "; other slices", others)
            # its fetch as `run` logged it and the host heard it (swarmctl/model_files/fetch_progress.py)
            what = f"experts [{first}, {last}) of layers [1, 3)"
            assert f"{what}: all {whole / 1e6:.1f} MB fetched in" in (tmp_path / f"{name}-trunk.log").read_text()
            fetch = members[name]["fetch"]
            assert fetch["what"] == what and fetch["finished"] and fetch["done"] == fetch["total"] == whole
            assert fetch["bytes_per_s"] > 0
    finally:
        s.close()
