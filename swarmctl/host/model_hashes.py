"""The host's hashes of the model: one SHA-256 per 1 MiB chunk of each tensor, each tensor's hash
made of its chunks', each layer's of its tensors' (kernels/gguf_file.py), read from the file once and
kept in the home. The chunk hashes let a member check each chunk it fetches on its own, from
whoever sent it (swarmctl/model_files/distribution.py).

A restart on an unchanged file reads nothing of it: the hashes are stored under the identity of
the model's files (each part's device, inode, size and modification time), and a file whose
identity changed is hashed again. A first hash reads every tensor on every core (hashlib lets
go of the GIL for large buffers) and logs its progress with an estimate of the time left.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from kernels.gguf_file import HASH_CHUNK, GGUFFile, layer_hash_of, tensor_hash_of

log = logging.getLogger("swarmctl.host")

CACHE_FORMAT = 2
CACHE_FOLDER = "model-hashes"
PROGRESS_EVERY_S = 2.0


@dataclass(frozen=True)
class FileIdentity:
    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> "FileIdentity":
        st = os.stat(path)
        return cls(str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class ModelHashes:
    chunks: dict[str, list[str]]  # tensor name → SHA-256 of each of its chunks (GGUFFile.chunk_hashes)
    tensors: dict[str, str]  # tensor name → SHA-256 of its name, type, shape and chunk hashes
    layers: list[str]  # layer → SHA-256 of its tensors' hashes (layer_hash_of)
    model_hash: str  # SHA-256 of the layer hashes: names the model in plans and slice files

    @classmethod
    def from_chunks(cls, gguf: GGUFFile, n_layer: int, chunks: dict[str, list[str]]) -> "ModelHashes":
        tensors = {name: tensor_hash_of(name, gguf.tensors[name].ggml_type, gguf.tensors[name].shape, chunks[name])
                   for name in chunks}
        layers = [layer_hash_of({name: tensors[name] for name in gguf.layer_tensor_names(il)})
                  for il in range(n_layer)]
        return cls(chunks, tensors, layers, hashlib.sha256("".join(layers).encode()).hexdigest())


def identity_key(identities: list[FileIdentity]) -> str:
    return hashlib.sha256(json.dumps([asdict(i) for i in identities]).encode()).hexdigest()[:32]


def model_hashes(gguf: GGUFFile, n_layer: int, cache_folder: Path, *,
                 threads: int | None = None, progress: Callable[[int, int, float], None] | None = None
                 ) -> tuple[ModelHashes, bool]:
    """The model's hashes, from the cache when its files are unchanged (then True), else read and
    stored. A cache entry that does not parse, or does not cover the model's tensors, is hashed
    again (and said so): it never stands in for a hash it does not hold."""
    identities = [FileIdentity.of(path) for path in gguf.parts]
    entry = cache_folder / f"{identity_key(identities)}.json"
    cached = _read(entry, identities, gguf)
    if cached is not None:
        return ModelHashes.from_chunks(gguf, n_layer, cached), True
    chunks = hash_every_tensor(gguf, threads=threads, progress=progress or _log_progress(gguf))
    if [FileIdentity.of(path) for path in gguf.parts] != identities:
        log.warning("the model file changed while it was hashed; the hashes are not kept")
    else:
        _write(entry, identities, chunks)
    return ModelHashes.from_chunks(gguf, n_layer, chunks), False


def hash_every_tensor(gguf: GGUFFile, *, threads: int | None = None,
                      progress: Callable[[int, int, float], None] | None = None) -> dict[str, list[str]]:
    """Every tensor's chunk hashes, on ``threads`` threads (default: every core); ``progress(done_bytes,
    total_bytes, elapsed_s)`` every few seconds and at the end."""
    names = sorted(gguf.tensors, key=lambda n: -gguf.tensors[n].n_bytes)  # the big ones first: even shares
    total = sum(gguf.tensors[n].n_bytes for n in names)
    done, started, last = 0, time.monotonic(), 0.0
    out: dict[str, list[str]] = {}
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        for name, digest in zip(names, pool.map(gguf.chunk_hashes, names)):
            out[name] = digest
            done += gguf.tensors[name].n_bytes
            now = time.monotonic()
            if progress is not None and (now - last >= PROGRESS_EVERY_S or done == total):
                progress(done, total, now - started)
                last = now
    return out


def _log_progress(gguf: GGUFFile) -> Callable[[int, int, float], None]:
    def say(done: int, total: int, elapsed: float) -> None:
        left = elapsed * (total - done) / done if done else 0.0
        log.info("hashing %s: %.1f of %.1f GB (%.0f %%), %.0f s so far, about %.0f s left", gguf.path.name,
                 done / 1e9, total / 1e9, 100 * done / max(total, 1), elapsed, left)
    return say


def _read(entry: Path, identities: list[FileIdentity], gguf: GGUFFile) -> dict[str, list[str]] | None:
    if not entry.exists():
        return None
    try:
        data = json.loads(entry.read_text())
        if data.get("format") != CACHE_FORMAT or data.get("files") != [asdict(i) for i in identities]:
            raise ValueError("it was made for other files")
        chunks = data["chunks"]
        if not isinstance(chunks, dict) or set(chunks) != set(gguf.tensors) or not all(
                isinstance(v, list) and len(v) == -(-gguf.tensors[name].n_bytes // HASH_CHUNK)
                and all(isinstance(h, str) and len(h) == 64 for h in v) for name, v in chunks.items()):
            raise ValueError("its tensors are not the model's")
    except (ValueError, KeyError, TypeError, OSError) as e:
        log.warning("the stored hashes in %s cannot be used (%s); hashing the model again", entry, e)
        return None
    return chunks


def _write(entry: Path, identities: list[FileIdentity], chunks: dict[str, list[str]]) -> None:
    """Written whole under a temporary name, then renamed: a crash leaves the old entry or none."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = entry.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": CACHE_FORMAT, "files": [asdict(i) for i in identities], "chunks": chunks}, f)
        os.replace(tmp, entry)
    except OSError as e:  # a full disk: the host runs on, and hashes again next start
        log.warning("cannot keep the model's hashes in %s (%s); the next start hashes again", entry.parent,
                    e.strerror)
