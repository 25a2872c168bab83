"""A fast read of a GGUF file's header: its metadata values and tensor table, as the GGUF index
of `jaxengine.models.gguf_loader` stores them.

`gguf.GGUFReader` turns every metadata value into NumPy views (a few per string), so a
49k-token vocabulary and its merges take it seconds (SmolLM2-135M: about 3 s of a cold start's
load on a quiet 2-core VM). The same header read here with `struct` over a memory map takes about
0.1 s and gives exactly the values ``field.contents()`` gives (a scalar as a Python number, bool
or str; an array as a list of them) and the tensors the reader lists (type, shape fastest
dimension first, the byte offset of their data and that data's dtype and NumPy shape).

Only the little-endian layout of GGUF versions 2 and 3 without arrays of arrays is read here;
`scan_gguf` raises `UnsupportedHeader` for any other file, and the caller falls back to the
reader.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

#: struct formats of the scalar value types (little-endian).
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

#: NumPy dtypes of the scalar value types (arrays of numbers are read in one piece).
_ARRAY_DTYPES = {kind: np.dtype(fmt) for kind, fmt in _SCALARS.items()}

#: The reader's element dtype of an unquantized tensor type (other types: bytes).
_TENSOR_DTYPES = {
  GGMLQuantizationType.F16: np.float16,
  GGMLQuantizationType.F32: np.float32,
  GGMLQuantizationType.F64: np.float64,
  GGMLQuantizationType.I8: np.int8,
  GGMLQuantizationType.I16: np.int16,
  GGMLQuantizationType.I32: np.int32,
  GGMLQuantizationType.I64: np.int64,
}


class UnsupportedHeader(ValueError):
  """A file `scan_gguf` does not read (not GGUF, another version or byte order, a value type
  it does not know, or truncated): the caller lets `gguf.GGUFReader` judge it."""


class _Cursor:
  """Reads little-endian values from a buffer, moving forward."""

  def __init__(self, buffer: Any) -> None:
    self.buffer = buffer
    self.offset = 0

  def unpack(self, fmt: str) -> Any:
    (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
    self.offset += struct.calcsize(fmt)
    return value

  def string(self) -> str:
    length = self.unpack("<Q")
    end = self.offset + length
    if end > len(self.buffer):
      raise UnsupportedHeader(f"a string of {length} bytes past the end of the file")
    text = str(self.buffer[self.offset : end], encoding="utf-8")
    self.offset = end
    return text

  def value(self, kind: int) -> Any:
    """One value of GGUF value type `kind` (an array as a list)."""
    if kind == GGUFValueType.STRING:
      return self.string()
    if kind == GGUFValueType.ARRAY:
      item_kind, count = self.unpack("<I"), self.unpack("<Q")
      if item_kind == GGUFValueType.STRING:
        return [self.string() for _ in range(count)]
      if item_kind == GGUFValueType.ARRAY:  # the reader flattens these: left to it
        raise UnsupportedHeader("an array of arrays")
      dtype = _ARRAY_DTYPES.get(GGUFValueType(item_kind)) if item_kind in _valid_kinds else None
      if dtype is None:
        raise UnsupportedHeader(f"array item type {item_kind}")
      end = self.offset + count * dtype.itemsize
      if end > len(self.buffer):
        raise UnsupportedHeader(f"an array of {count} items past the end of the file")
      values = np.frombuffer(self.buffer, dtype, count, self.offset).tolist()
      self.offset = end
      return values
    if kind not in _valid_kinds or GGUFValueType(kind) not in _SCALARS:
      raise UnsupportedHeader(f"value type {kind}")
    return self.unpack(_SCALARS[GGUFValueType(kind)])


_valid_kinds = {int(kind) for kind in GGUFValueType}


def scan_gguf(path: str) -> dict[str, Any]:
  """Reads the header of the GGUF file at `path`.

  Args:
    path: a ``.gguf`` file.

  Returns:
    ``{"fields": {key: value}, "tensors": [{"name", "type", "shape", "offset", "dtype",
    "data_shape"}]}``: each metadata value as ``gguf.GGUFReader``'s ``field.contents()`` gives
    it, in file order after the reader's ``GGUF.version``, ``GGUF.tensor_count`` and
    ``GGUF.kv_count``; each tensor's GGML type (int), GGUF shape (fastest dimension first), the
    absolute byte offset of its data, and the dtype string and NumPy shape of the reader's view
    of that data.

  Raises:
    UnsupportedHeader: a file this does not read (see the module docstring).
  """
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
    try:
      with memoryview(buffer) as view:
        return _scan(view)
    except (struct.error, UnicodeDecodeError, ValueError) as error:
      raise UnsupportedHeader(str(error)) from error


def _scan(buffer: memoryview) -> dict[str, Any]:
  cursor = _Cursor(buffer)
  if bytes(buffer[:4]) != GGUF_MAGIC:
    raise UnsupportedHeader("no GGUF magic")
  cursor.offset = 4
  version = cursor.unpack("<I")
  if version not in (2, 3):
    raise UnsupportedHeader(f"version {version}")
  num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
  # The reader's first three fields describe the header itself.
  fields: dict[str, Any] = {
    "GGUF.version": version,
    "GGUF.tensor_count": num_tensors,
    "GGUF.kv_count": num_fields,
  }
  kinds: dict[str, int] = {}
  for _ in range(num_fields):
    key = cursor.string()
    kinds[key] = kind = cursor.unpack("<I")
    fields[key] = cursor.value(kind)
  infos = []
  for _ in range(num_tensors):
    name = cursor.string()
    num_dims = cursor.unpack("<I")
    shape = [cursor.unpack("<Q") for _ in range(num_dims)]
    infos.append((name, shape, cursor.unpack("<I"), cursor.unpack("<Q")))
  alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
  if "general.alignment" in fields and kinds["general.alignment"] != GGUFValueType.UINT32:
    raise UnsupportedHeader("general.alignment is not a uint32")
  if alignment <= 0 or alignment & (alignment - 1):
    raise UnsupportedHeader(f"alignment {alignment}")
  start = -(-cursor.offset // alignment) * alignment
  tensors = []
  for name, shape, raw_type, offset in infos:
    tensor_type = GGMLQuantizationType(raw_type)
    num_elements = int(np.prod(shape, dtype=np.int64))
    np_shape = tuple(reversed(shape))
    dtype = _TENSOR_DTYPES.get(tensor_type)
    if dtype is None:
      block_size, type_size = GGML_QUANT_SIZES[tensor_type]
      nbytes = num_elements * type_size // block_size
      dtype, np_shape = np.uint8, quant_shape_to_byte_shape(np_shape, tensor_type)
    else:
      nbytes = num_elements * np.dtype(dtype).itemsize
    if start + offset + nbytes > len(buffer):
      raise UnsupportedHeader(f"tensor {name!r} ends past the end of the file")
    tensors.append(
      {
        "name": name,
        "type": int(tensor_type),
        "shape": shape,
        "offset": start + offset,
        "dtype": np.dtype(dtype).str,
        "data_shape": list(np_shape),
      }
    )
  if len({t["name"] for t in tensors}) != len(tensors):
    raise UnsupportedHeader("duplicated tensor names")
  return {"fields": fields, "tensors": tensors}
