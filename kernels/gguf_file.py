"""A GGUF file, memory-mapped: scalar metadata, tensor directory, and zero-copy tensor bytes.

Why not ``gguf.GGUFReader``: it materialises every element of every metadata array as a numpy
memmap view, which takes about 2.3 s on this project's reference machine for SmolLM2's 98k
tokenizer strings, and every trunk process would pay that at start. This reader walks the same
format (and uses the ``gguf`` package's enums and block sizes) but decodes arrays only when
asked, so opening the bundled model takes a few tens of milliseconds. Tensor bytes are never read
here: ``TensorInfo.offset`` is an absolute file offset into ``GGUFFile.address``, the base of the
read-only memory map that ggml consumes directly.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

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
    offset: int  # absolute offset of the first byte in the file
    n_bytes: int

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


class GGUFFile:
    """An open GGUF file. Use as a context manager, or call ``close()``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        self._view: np.ndarray | None = None
        if not self.path.exists():
            raise ModelFileError(f"model file not found: {self.path}")
        if not self.path.is_file():
            raise ModelFileError(f"model path is not a file: {self.path}")
        try:
            with open(self.path, "rb") as f:
                if f.read(4) != GGUF_MAGIC:
                    raise ModelFileError(f"{self.path} is not a GGUF file (bad magic bytes)")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise ModelFileError(f"cannot read model file {self.path}: {e.strerror}") from None
        # A read-only numpy view gives us the map's base address without copying anything.
        self._view = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address: int = self._view.ctypes.data
        self.size: int = len(self._mmap)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse()
        except ValueError as e:  # an enum value outside the format
            raise ModelFileError(f"{self.path}: corrupt GGUF header ({e})") from None

    # --- parsing ---

    def _parse(self) -> None:
        assert self._mmap is not None
        cur = _Cursor(self._mmap, self.path, offset=4)
        version = cur.read("<I")
        if version not in (2, 3):
            raise ModelFileError(f"{self.path}: unsupported GGUF version {version}")
        n_tensors = cur.read("<Q")
        n_kv = cur.read("<Q")
        for _ in range(n_kv):
            key = cur.read_string()
            vtype = GGUFValueType(cur.read("<I"))
            self.metadata[key] = self._read_value(cur, vtype)
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
            self.tensors[name] = TensorInfo(name, shape, ggml_type, offset, n_bytes)

    def _read_value(self, cur: _Cursor, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return cur.read_string()
        if vtype == GGUFValueType.ARRAY:
            element_type = GGUFValueType(cur.read("<I"))
            count = cur.read("<Q")
            lazy = _LazyArray(element_type, count, cur.offset)
            cur.skip_array(element_type, count)
            return lazy
        return cur.read(_SCALAR_FORMATS[vtype])

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
        assert self._mmap is not None
        if lazy.element_type in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[lazy.element_type])
            return np.frombuffer(self._mmap, dtype=dtype, count=lazy.count, offset=lazy.offset).copy()
        cur = _Cursor(self._mmap, self.path, lazy.offset)
        return [self._read_value(cur, lazy.element_type) for _ in range(lazy.count)]

    def tensor_bytes(self, info: TensorInfo) -> memoryview:
        """The tensor's bytes in the map (no copy). Touching them faults the pages in."""
        assert self._mmap is not None
        return memoryview(self._mmap)[info.offset : info.offset + info.n_bytes]

    def release_pages(self, spans: Iterable[tuple[int, int]]) -> None:
        """Drop this process's pages of the map in the (offset, n_bytes) spans (whole pages only),
        after their bytes were copied elsewhere. The map is read-only and file-backed, so a later
        read just faults the pages in again, from the page cache or the file."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        for offset, n_bytes in spans:
            start = -(-offset // page) * page
            stop = (offset + n_bytes) // page * page
            if stop > start:
                self._mmap.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def hash_tensors(self, names: Iterable[str]) -> str:
        """SHA-256 over (name, type, shape, bytes) of the named tensors, in the order given."""
        digest = hashlib.sha256()
        for name in names:
            info = self.tensors[name]
            digest.update(f"{name}|{info.ggml_type}|{info.shape}|".encode())
            digest.update(self.tensor_bytes(info))
        return digest.hexdigest()

    def layer_tensor_names(self, layer: int) -> list[str]:
        prefix = f"blk.{layer}."
        return sorted(name for name in self.tensors if name.startswith(prefix))

    def layer_hash(self, layer: int) -> str:
        """SHA-256 over one layer's tensors: how members check they hold the same weights."""
        return self.hash_tensors(self.layer_tensor_names(layer))

    def close(self) -> None:
        # The numpy view pins the map; drop it first so the map can really close.
        self._view = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # someone still holds a memoryview; the map closes when they let go
            self._mmap = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tensor_bytes(shape: tuple[int, ...], ggml_type: int, path: Path, name: str) -> int:
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ModelFileError(f"{path}: tensor {name} has unknown type {ggml_type}") from None
    n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[0] % block_size:
        raise ModelFileError(f"{path}: tensor {name} row of {shape[0]} is not a multiple of its block size")
    return n_elements // block_size * type_size
