"""A GGUF file's metadata and tensor table, read in one pass over its header.

``gguf.GGUFReader`` builds a memory-mapped numpy view for every part of every metadata field
(hundreds of thousands for a tokenizer's vocabulary and merges) and took 2-4 s of a first
``Engine()`` on the default model; this reader walks the header with ``struct`` and reads
arrays of numbers with one ``np.frombuffer`` each. It offers what the loaders use:
``get_field(key)`` (``.types``, ``.contents()``), ``tensors`` (``name``, ``shape`` fastest
dimension first, ``tensor_type``, ``data`` as a view of the mapped file in the same dtype and
shape ``GGUFReader`` gives) and ``path``. Tensor data is never copied here: the file is mapped
copy-on-write, so the views are writable arrays whose writes (agentx makes none) would stay in
this process and never reach the file.

Layout (little-endian; GGUF v2 and v3)::

    "GGUF" u32 version | u64 tensor count | u64 field count
    field:  string key | u32 type | value          (array: u32 item type | u64 count | items)
    tensor: string name | u32 dims | u64 x dims | u32 ggml type | u64 offset
    padding to general.alignment (default 32) | tensor data
    string: u64 length | utf-8 bytes
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFFile", "GGUFField", "GGUFTensor"]

_MAGIC = b"GGUF"
# scalar value types: struct format
_SCALARS = {
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
# the numpy dtype of tensor data that is not block-quantized
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True, slots=True)
class GGUFField:
    """One metadata field: ``types`` as ``GGUFReader`` gives them ([ARRAY, item type] for an
    array), and its decoded value."""

    name: str
    types: list[GGUFValueType]
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: np.ndarray  # (n_dims,) uint64, fastest-varying first
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # read-only view of the mapped file


class _Cursor:
    """Sequential little-endian reads from a buffer."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (length,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + length
        if self.pos > len(self.buf):
            raise ValueError("string runs past the end of the file")
        return str(self.buf[start : self.pos], "utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, out = self.buf, self.pos, []
        unpack, append = struct.unpack_from, out.append
        for _ in range(count):
            (length,) = unpack("<Q", buf, pos)
            append(str(buf[pos + 8 : pos + 8 + length], "utf-8", errors="replace"))
            pos += 8 + length
        if pos > len(buf):
            raise ValueError("string array runs past the end of the file")
        self.pos = pos
        return out

    def numbers(self, fmt: str, count: int) -> list[Any]:
        dtype = np.dtype(fmt)
        end = self.pos + dtype.itemsize * count
        if end > len(self.buf):
            raise ValueError("array runs past the end of the file")
        values = np.frombuffer(self.buf[self.pos : end], dtype=dtype).tolist()
        self.pos = end
        return values


class GGUFFile:
    """A GGUF file, memory-mapped. Raises ValueError for a file that is not GGUF or whose header
    is cut short, OSError when it cannot be read."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        buf = memoryview(self._map)
        try:
            self.fields, self.tensors = _parse(buf)
        except struct.error as exc:
            raise ValueError(f"truncated GGUF header: {exc}") from exc
        self._by_name = {field.name: field for field in self.fields}

    def get_field(self, key: str) -> GGUFField | None:
        return self._by_name.get(key)


def _parse(buf: memoryview) -> tuple[list[GGUFField], list[GGUFTensor]]:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise ValueError("GGUF magic number not found")
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    num_tensors, num_fields = cur.unpack("<Q"), cur.unpack("<Q")
    fields = [_field(cur) for _ in range(num_fields)]
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
    alignment = next((f.value for f in fields if f.name == "general.alignment"), 32)
    start = -(-cur.pos // alignment) * alignment
    array = np.frombuffer(buf, dtype=np.uint8)
    tensors = [_tensor(array, start, *info) for info in infos]
    return fields, tensors


def _field(cur: _Cursor) -> GGUFField:
    name = cur.string()
    kind = GGUFValueType(cur.unpack("<I"))
    if kind == GGUFValueType.STRING:
        return GGUFField(name, [kind], cur.string())
    if kind != GGUFValueType.ARRAY:
        return GGUFField(name, [kind], cur.unpack(_SCALARS[kind]))
    item = GGUFValueType(cur.unpack("<I"))
    count = cur.unpack("<Q")
    if item == GGUFValueType.STRING:
        return GGUFField(name, [kind, item], cur.strings(count))
    if item == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF field {name!r}: nested arrays are not supported")
    values = cur.numbers(_SCALARS[item], count)
    if item == GGUFValueType.BOOL:
        values = [bool(v) for v in values]
    return GGUFField(name, [kind, item], values)


def _tensor(
    array: np.ndarray,
    start: int,
    name: str,
    dims: list[int],
    kind: GGMLQuantizationType,
    offset: int,
) -> GGUFTensor:
    block_size, type_size = GGML_QUANT_SIZES[kind]
    num_elements = int(np.prod(dims, dtype=np.int64))
    num_bytes = num_elements // block_size * type_size
    begin = start + offset
    if begin + num_bytes > array.size:
        raise ValueError(f"GGUF tensor {name!r} runs past the end of the file")
    raw = array[begin : begin + num_bytes]
    shape = list(reversed(dims))  # numpy order: slowest first
    dtype = _PLAIN_DTYPES.get(kind)
    if dtype is not None:
        data = raw.view(dtype).reshape(shape)
    else:  # block-quantized: rows of bytes, as gguf.quants.dequantize expects
        shape[-1] = shape[-1] // block_size * type_size
        data = raw.reshape(shape)
    return GGUFTensor(name, np.array(dims, dtype=np.uint64), kind, data)
