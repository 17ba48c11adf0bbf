"""A GGUF file, memory-mapped: scalar metadata, tensor directory, and zero-copy tensor bytes.

Why not ``gguf.GGUFReader``: it materialises every element of every metadata array as a numpy
memmap view, which takes about 2.3 s on this project's reference machine for SmolLM2's 98k
tokenizer strings, and every trunk process would pay that at start. This reader walks the same
format (and uses the ``gguf`` package's enums and block sizes) but decodes arrays only when
asked, so opening the bundled model takes a few tens of milliseconds. Tensor bytes are never read
here: ``TensorInfo.offset`` is an absolute offset into its part's file, and
``GGUFFile.tensor_address`` the address in that part's read-only memory map, which ggml consumes
directly.

Split models. Published GGUFs of large models come in parts written by llama.cpp's ``gguf-split``
or its converter (``NAME-00001-of-00005.gguf`` ...): the first part carries the metadata, every
part carries ``split.no`` / ``split.count`` / ``split.tensors.count``, and the tensors are spread
over all parts. ``GGUFFile`` takes any part, finds its siblings by that naming rule, and opens
them as one model, each part mapped on its own (no merge, no copy). What it checks: every part is
there, each says it is part ``i`` of the same count, the parts' tensors add up to the first
part's ``split.tensors.count`` with no name twice. What it cannot check: a part of another model
with the same count and tensor names (a different quantization of the same model, say); the
swarm's layer hashes catch that where they are compared.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# llama.cpp's naming rule for split parts (llama_split_path): PREFIX-00001-of-00005.gguf, 1-based.
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
# Tensors are hashed in pieces of this size, so that a piece fetched from anyone is checked alone.
HASH_CHUNK = 1 << 20

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the innermost (contiguous) dimension
    ggml_type: int
    offset: int  # absolute offset of the first byte in its part's file
    n_bytes: int
    part: int = 0  # which part of a split model holds it (0: the first, or the only file)

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type{self.ggml_type}"


@dataclass(frozen=True)
class _LazyArray:
    """An array value not yet decoded: its element type, length and where it starts."""

    element_type: GGUFValueType
    count: int
    offset: int


class _Cursor:
    """Sequential little-endian reads over the mapped header, with truncation turned into ModelFileError."""

    def __init__(self, buf: mmap.mmap, path: Path, offset: int = 0) -> None:
        self.buf = buf
        self.path = path
        self.offset = offset

    def read(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        except struct.error:
            raise ModelFileError(f"{self.path}: GGUF header is truncated") from None
        self.offset += struct.calcsize(fmt)
        return value

    def read_string(self) -> str:
        length = self.read("<Q")
        end = self.offset + length
        if end > len(self.buf):
            raise ModelFileError(f"{self.path}: GGUF header is truncated")
        raw = self.buf[self.offset : end]
        self.offset = end
        return raw.decode("utf-8", errors="replace")

    def skip_value(self, vtype: GGUFValueType) -> None:
        if vtype == GGUFValueType.STRING:
            length = self.read("<Q")
            self.offset += length
        elif vtype == GGUFValueType.ARRAY:
            element_type = GGUFValueType(self.read("<I"))
            count = self.read("<Q")
            self.skip_array(element_type, count)
        else:
            self.offset += struct.calcsize(_SCALAR_FORMATS[vtype])

    def skip_array(self, element_type: GGUFValueType, count: int) -> None:
        if element_type in _SCALAR_FORMATS:
            self.offset += struct.calcsize(_SCALAR_FORMATS[element_type]) * count
        else:
            for _ in range(count):
                self.skip_value(element_type)
        if self.offset > len(self.buf):
            raise ModelFileError(f"{self.path}: GGUF header is truncated")


def split_parts(path: Path) -> list[Path]:
    """The files of the model ``path`` belongs to, by llama.cpp's naming rule: all its parts in
    order when its name says it is one (``NAME-00003-of-00005.gguf``), else ``[path]``."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["no"]) <= count:
        raise ModelFileError(f"{path}: its name says part {int(match['no'])} of {count}")
    return [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class _Part:
    """One file of the model, memory-mapped read-only, with its header parsed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mmap: mmap.mmap | None = None
        self.view: np.ndarray | None = None
        if not path.exists():
            raise ModelFileError(f"model file not found: {path}")
        if not path.is_file():
            raise ModelFileError(f"model path is not a file: {path}")
        try:
            with open(path, "rb") as f:
                if f.read(4) != GGUF_MAGIC:
                    raise ModelFileError(f"{path} is not a GGUF file (bad magic bytes)")
                self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(f"cannot read model file {path}: {e.strerror}") from None
        # A read-only numpy view gives us the map's base address without copying anything.
        self.view = np.frombuffer(self.mmap, dtype=np.uint8)
        self.address: int = self.view.ctypes.data
        self.size: int = len(self.mmap)
        self.metadata: dict[str, Any] = {}
        self.kv_spans: dict[str, tuple[int, int]] = {}  # key → where its entry (key, type, value) lies
        self.tensors: list[tuple[str, tuple[int, ...], int, int, int]] = []  # name, shape, type, offset, bytes
        try:
            self._parse()
        except ValueError as e:  # an enum value outside the format
            self.close()
            raise ModelFileError(f"{path}: corrupt GGUF header ({e})") from None
        except ModelFileError:
            self.close()
            raise

    def split(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return int(value) if isinstance(value, (int, np.integer)) else None

    def _parse(self) -> None:
        assert self.mmap is not None
        cur = _Cursor(self.mmap, self.path, offset=4)
        version = cur.read("<I")
        if version not in (2, 3):
            raise ModelFileError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors = cur.read("<Q")
        n_kv = cur.read("<Q")
        for _ in range(n_kv):
            begin = cur.offset
            key = cur.read_string()
            vtype = GGUFValueType(cur.read("<I"))
            self.metadata[key] = _read_value(cur, vtype)
            self.kv_spans[key] = (begin, cur.offset)
        infos = []
        for _ in range(n_tensors):
            name = cur.read_string()
            n_dims = cur.read("<I")
            if n_dims > 4:
                raise ModelFileError(f"{self.path}: tensor {name} has {n_dims} dimensions")
            shape = tuple(cur.read("<Q") for _ in range(n_dims))
            ggml_type = cur.read("<I")
            rel_offset = cur.read("<Q")
            infos.append((name, shape, ggml_type, rel_offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.offset // alignment) * alignment
        for name, shape, ggml_type, rel_offset in infos:
            n_bytes = _tensor_bytes(shape, ggml_type, self.path, name)
            offset = data_start + rel_offset
            if offset + n_bytes > self.size:
                raise ModelFileError(f"{self.path}: file is truncated (tensor {name} ends past the end)")
            self.tensors.append((name, shape, ggml_type, offset, n_bytes))

    def close(self) -> None:
        # The numpy view pins the map; drop it first so the map can really close.
        self.view = None
        if self.mmap is not None:
            try:
                self.mmap.close()
            except BufferError:
                pass  # someone still holds a memoryview; the map closes when they let go
            self.mmap = None


def _read_value(cur: _Cursor, vtype: GGUFValueType) -> Any:
    if vtype == GGUFValueType.STRING:
        return cur.read_string()
    if vtype == GGUFValueType.ARRAY:
        element_type = GGUFValueType(cur.read("<I"))
        count = cur.read("<Q")
        lazy = _LazyArray(element_type, count, cur.offset)
        cur.skip_array(element_type, count)
        return lazy
    return cur.read(_SCALAR_FORMATS[vtype])


class GGUFFile:
    """An open GGUF model: one file, or every part of a split one. Use as a context manager, or
    call ``close()``. ``path`` is the first part (what llama.cpp is given); ``parts`` all of them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        given = Path(path)
        self._parts: list[_Part] = []
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._open(given)
        except BaseException:
            self.close()
            raise
        self.path: Path = self._parts[0].path
        self.parts: tuple[Path, ...] = tuple(p.path for p in self._parts)
        self.size: int = sum(p.size for p in self._parts)  # bytes of all parts
        self.metadata = dict(self._parts[0].metadata)

    def _open(self, given: Path) -> None:
        paths = split_parts(given)
        if len(paths) == 1:
            part = _Part(given)
            self._parts.append(part)
            count = part.split("split.count")
            if count is not None and count > 1:  # a part renamed away from the naming rule
                raise ModelFileError(f"{given}: part {part.split('split.no') or 0} of a model split in {count} "
                                     f"parts, but its name does not say which (expected NAME-00001-of-"
                                     f"{count:05d}.gguf and its siblings)")
        else:
            for path in paths:
                if not path.exists():
                    raise ModelFileError(f"split model part missing: {path} (part {paths.index(path) + 1} of "
                                         f"{len(paths)}, beside {given.name})")
            self._parts.extend(_Part(p) for p in paths)
            self._check_parts()
        for index, part in enumerate(self._parts):
            for name, shape, ggml_type, offset, n_bytes in part.tensors:
                if name in self.tensors:
                    raise ModelFileError(f"{part.path}: tensor {name} is also in "
                                         f"{self._parts[self.tensors[name].part].path.name}: "
                                         f"parts of different models?")
                self.tensors[name] = TensorInfo(name, shape, ggml_type, offset, n_bytes, index)

    def _check_parts(self) -> None:
        """Each part says it is part i of the same count, and the parts' tensors add up to what
        the first part says the whole model has."""
        count = len(self._parts)
        for index, part in enumerate(self._parts):
            said_count, said_no = part.split("split.count"), part.split("split.no")
            if said_count is None or said_no is None:
                raise ModelFileError(f"{part.path}: named as part {index + 1} of {count}, but carries no "
                                     f"split.count / split.no metadata (not a gguf-split part)")
            if said_count != count:
                raise ModelFileError(f"{part.path}: its split.count is {said_count}, its name says {count}: "
                                     f"parts of different splits?")
            if said_no != index:
                raise ModelFileError(f"{part.path}: its split.no is {said_no}, its name says part {index + 1} "
                                     f"(split.no {index})")
        total = self._parts[0].split("split.tensors.count")
        found = sum(len(part.tensors) for part in self._parts)
        if total is not None and total != found:
            raise ModelFileError(f"{self._parts[0].path}: says the model has {total} tensors, its {count} parts "
                                 f"hold {found}: parts of different models?")
        for part in self._parts[1:]:
            other = part.split("split.tensors.count")
            if other is not None and total is not None and other != total:
                raise ModelFileError(f"{part.path}: says the model has {other} tensors, the first part {total}: "
                                     f"parts of different models?")

    # --- access ---

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value; arrays are decoded on first access (numbers → numpy, strings → list)."""
        value = self.metadata.get(key, default)
        if isinstance(value, _LazyArray):
            value = self._decode_array(value)
            self.metadata[key] = value
        return value

    def array_length(self, key: str) -> int | None:
        value = self.metadata.get(key)
        if isinstance(value, _LazyArray):
            return value.count
        if isinstance(value, (list, np.ndarray)):
            return len(value)
        return None

    def _decode_array(self, lazy: _LazyArray) -> Any:
        buf = self._parts[0].mmap  # metadata is the first part's
        assert buf is not None
        if lazy.element_type in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[lazy.element_type])
            return np.frombuffer(buf, dtype=dtype, count=lazy.count, offset=lazy.offset).copy()
        cur = _Cursor(buf, self.path, lazy.offset)
        return [_read_value(cur, lazy.element_type) for _ in range(lazy.count)]

    def raw_metadata(self, keep: Callable[[str], bool] = lambda key: True) -> tuple[int, bytes]:
        """The metadata entries whose key ``keep`` says, as the file holds them (key, type, value):
        their count and bytes, ready to be the KV section of another GGUF (a slice's, an asker's
        part). A split model's ``split.*`` keys are never included: the new file is one part."""
        first = self._parts[0]
        assert first.mmap is not None
        keys = [key for key in first.kv_spans if keep(key) and key not in SPLIT_KEYS]
        return len(keys), b"".join(first.mmap[slice(*first.kv_spans[key])] for key in keys)

    def _map(self, info: TensorInfo) -> mmap.mmap:
        buf = self._parts[info.part].mmap
        if buf is None:
            raise ValueError(f"{self.path} is closed")
        return buf

    def tensor_bytes(self, info: TensorInfo) -> memoryview:
        """The tensor's bytes in its part's map (no copy). Touching them faults the pages in."""
        return memoryview(self._map(info))[info.offset : info.offset + info.n_bytes]

    def tensor_address(self, info: TensorInfo) -> int:
        """Where the tensor's first byte is mapped in this process (for ggml, zero-copy)."""
        self._map(info)
        return self._parts[info.part].address + info.offset

    def by_part(self, infos: Iterable[TensorInfo]) -> dict[int, list[TensorInfo]]:
        """``infos`` grouped by the part that holds them (a buffer over mapped bytes spans one part)."""
        groups: dict[int, list[TensorInfo]] = {}
        for info in infos:
            groups.setdefault(info.part, []).append(info)
        return groups

    def part_address(self, part: int) -> int:
        return self._parts[part].address

    def release_pages(self, infos: Iterable[TensorInfo]) -> None:
        """Drop this process's pages of the map under the tensors (whole pages only), after their
        bytes were copied elsewhere. The map is read-only and file-backed, so a later read just
        faults the pages in again, from the page cache or the file."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        for info in infos:
            buf = self._parts[info.part].mmap
            start = -(-info.offset // page) * page
            stop = (info.offset + info.n_bytes) // page * page
            if buf is not None and stop > start:
                buf.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def chunk_hashes(self, name: str) -> list[str]:
        """SHA-256 of each ``HASH_CHUNK`` piece of the tensor's bytes (the last may be shorter): a
        fetched chunk is checked on its own, before it is written."""
        data = self.tensor_bytes(self.tensors[name])
        return [hashlib.sha256(data[at:at + HASH_CHUNK]).hexdigest() for at in range(0, len(data), HASH_CHUNK)]

    def tensor_hash(self, name: str, chunk_hashes: list[str] | None = None) -> str:
        """The tensor's hash: of its name, type, shape and its chunks' hashes (``tensor_hash_of``)."""
        info = self.tensors[name]
        return tensor_hash_of(name, info.ggml_type, info.shape,
                              self.chunk_hashes(name) if chunk_hashes is None else chunk_hashes)

    def layer_tensor_names(self, layer: int) -> list[str]:
        prefix = f"blk.{layer}."
        return sorted(name for name in self.tensors if name.startswith(prefix))

    def layer_hash(self, layer: int, tensor_hashes: Mapping[str, str] | None = None) -> str:
        """One layer's hash, from its tensors' hashes (``tensor_hashes`` where known, else read now):
        how members check they hold the same weights."""
        known = tensor_hashes or {}
        return layer_hash_of({name: known.get(name) or self.tensor_hash(name)
                              for name in self.layer_tensor_names(layer)})

    def close(self) -> None:
        for part in self._parts:
            part.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode_kv(key: str, value: Any, vtype: GGUFValueType) -> bytes:
    """One metadata entry as GGUF stores it: a scalar or a string (what a slice adds of its own)."""
    name = key.encode()
    head = struct.pack("<Q", len(name)) + name + struct.pack("<I", int(vtype))
    if vtype == GGUFValueType.STRING:
        text = str(value).encode()
        return head + struct.pack("<Q", len(text)) + text
    return head + struct.pack(_SCALAR_FORMATS[vtype], value)


def write_header(path: Path, n_kv: int, kv: bytes, tensors: Iterable[tuple[str, tuple[int, ...], int, int]],
                 alignment: int = DEFAULT_ALIGNMENT) -> tuple[list[int], int]:
    """Write a GGUF header (version 3) with ``kv`` as its metadata section and ``tensors``
    (name, shape in ggml order, type, bytes) laid out one after another, each aligned; the file
    is sized to hold their data (sparse until written). Returns each tensor's absolute data offset
    and the file's size."""
    tensors = list(tensors)
    infos, rel, rel_offsets = [], 0, []
    for name, shape, ggml_type, n_bytes in tensors:
        raw = name.encode()
        rel_offsets.append(rel)
        infos.append(struct.pack("<Q", len(raw)) + raw + struct.pack("<I", len(shape))
                     + b"".join(struct.pack("<Q", d) for d in shape) + struct.pack("<IQ", ggml_type, rel))
        rel += -(-n_bytes // alignment) * alignment
    header = GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), n_kv) + kv + b"".join(infos)
    data_start = -(-len(header) // alignment) * alignment
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(data_start + rel)
    return [data_start + r for r in rel_offsets], data_start + rel


def tensor_hash_of(name: str, ggml_type: int, shape: Iterable[int], chunk_hashes: list[str]) -> str:
    """A tensor's hash from its name, type, shape (ggml order) and its chunks' hashes in order."""
    digest = hashlib.sha256(f"{name}|{ggml_type}|{tuple(int(d) for d in shape)}|".encode())
    digest.update("".join(chunk_hashes).encode())
    return digest.hexdigest()


def layer_hash_of(tensor_hashes: Mapping[str, str]) -> str:
    """A layer's hash from its tensors' (name → SHA-256), in name order."""
    return hashlib.sha256("".join(f"{name}:{tensor_hashes[name]}\n" for name in sorted(tensor_hashes)).encode()
                          ).hexdigest()


def _tensor_bytes(shape: tuple[int, ...], ggml_type: int, path: Path, name: str) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelFileError(f"{path}: tensor {name} has unknown type {ggml_type}") from None
    n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[0] % block_size:
        raise ModelFileError(f"{path}: tensor {name} row of {shape[0]} is not a multiple of its block size")
    return n_elements // block_size * type_size
