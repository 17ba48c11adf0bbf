"""The host reads the model once: tensor hashes kept in the home under the files' identity, layer
hashes derived from them, a changed file hashed again, a damaged cache never trusted."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from harness.tiny_models import write_split_copy
from kernels.gguf_file import GGUFFile
from kernels.spec import ModelSpec
from swarmctl.host.model_hashes import hash_every_tensor, model_hashes


@pytest.fixture
def model(tiny_model, tmp_path) -> Path:
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_model("llama-q8_0"), path)
    return path


def _hashes(path: Path, cache: Path):
    with GGUFFile(path) as gguf:
        return model_hashes(gguf, ModelSpec.from_gguf(gguf).n_layer, cache)


def _no_reading(monkeypatch):
    def refuse(self, name):
        raise AssertionError(f"read {name} again")
    monkeypatch.setattr(GGUFFile, "chunk_hashes", refuse)


def test_a_restart_on_the_same_file_reads_no_tensor(model, tmp_path, monkeypatch):
    cache = tmp_path / "home" / "model-hashes"
    first, from_cache = _hashes(model, cache)
    assert not from_cache
    with GGUFFile(model) as gguf:  # the derived layer hashes are GGUFFile's own
        assert first.layers == [gguf.layer_hash(i) for i in range(len(first.layers))]
        assert set(first.tensors) == set(gguf.tensors)
    entry = next(cache.iterdir())
    assert entry.stat().st_mode & 0o777 == 0o600
    _no_reading(monkeypatch)
    again, from_cache = _hashes(model, cache)
    assert from_cache and again == first


def test_a_changed_file_is_hashed_again(model, tmp_path):
    cache = tmp_path / "model-hashes"
    first, _ = _hashes(model, cache)
    with GGUFFile(model) as gguf:  # flip a byte of layer 1's first tensor
        info = gguf.tensors[gguf.layer_tensor_names(1)[0]]
    with open(model, "r+b") as f:
        f.seek(info.offset)
        byte = f.read(1)
        f.seek(info.offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    changed, from_cache = _hashes(model, cache)
    assert not from_cache
    assert changed.layers[1] != first.layers[1] and changed.layers[0] == first.layers[0]
    assert changed.model_hash != first.model_hash


def test_a_damaged_or_foreign_cache_entry_is_not_trusted(model, tmp_path, caplog):
    cache = tmp_path / "model-hashes"
    first, _ = _hashes(model, cache)
    entry = next(cache.iterdir())
    data = json.loads(entry.read_text())
    name = next(iter(data["chunks"]))
    data["chunks"].pop(name)  # one tensor short
    entry.write_text(json.dumps(data))
    again, from_cache = _hashes(model, cache)
    assert not from_cache and again == first
    assert "cannot be used" in caplog.text
    entry.write_text("{not json")
    again, from_cache = _hashes(model, cache)
    assert not from_cache and again == first


def test_a_split_model_is_one_identity_of_all_its_parts(model, tmp_path, monkeypatch):
    parts = write_split_copy(model, tmp_path / "split" / "m.gguf", 3)
    cache = tmp_path / "model-hashes"
    whole, _ = _hashes(model, cache)
    split, from_cache = _hashes(parts[1], cache)
    assert not from_cache and split == whole  # same tensors, same hashes, whatever the files
    os.utime(parts[2], ns=(1, 1))  # a part touched: hashed again
    _, from_cache = _hashes(parts[0], cache)
    assert not from_cache


def test_every_tensor_on_several_threads_is_the_same_as_one(model):
    with GGUFFile(model) as gguf:
        seen = []
        many = hash_every_tensor(gguf, threads=4, progress=lambda d, t, e: seen.append((d, t)))
        assert many == hash_every_tensor(gguf, threads=1)
        assert seen and seen[-1][0] == seen[-1][1] == sum(i.n_bytes for i in gguf.tensors.values())
