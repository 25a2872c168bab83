"""Build a model from a Hugging Face directory (``config.json`` + safetensors).

The architecture (``config.json`` ``architectures[0]``) is looked up in
`jaxengine.models.registry`, whose entry reads the config, names the module and maps the tensor
names. Registered today: the Llama family (mixture-of-experts relatives included), served by one
module with config switches, Gemma 2 / 3 by `jaxengine.models.gemma.Gemma`, Gemma 4 by
`jaxengine.models.gemma4.Gemma4`:

=================================  ==========================================================
``LlamaForCausalLM``               Llama 2, Llama 3 / 3.1 / 3.2 (``rope_scaling`` type
                                   ``llama3``), SmolLM; ``attention_bias`` puts biases on
                                   q/k/v and o.
``MistralForCausalLM``             Mistral (``sliding_window`` when set).
``Qwen2ForCausalLM``               Qwen2 / Qwen2.5: biases on the q/k/v projections.
``Qwen3ForCausalLM``               Qwen3: per-head q/k RMSNorm before rotary, ``head_dim``.
``Qwen3MoeForCausalLM``            Qwen3-MoE: Qwen3 attention, sparse mixture-of-experts MLPs
                                   on the layers ``decoder_sparse_step`` / ``mlp_only_layers``
                                   select.
``MixtralForCausalLM``             Mixtral: Mistral attention, a mixture of experts on every
                                   layer.
``Gemma2ForCausalLM``              Gemma 2: local/global layers, soft-capped attention and
                                   logits (`jaxengine.models.gemma_checkpoints`).
``Gemma3ForCausalLM``              Gemma 3 text (1B): q/k norms, a local rotary base.
``Gemma3ForConditionalGeneration`` Gemma 3 4B+: its language model (``language_model.``);
                                   the vision tower is not read.
``Gemma4ForCausalLM``              Gemma 4 text (`jaxengine.models.gemma4`): local/global
                                   layers of their own head widths, per-layer inputs,
                                   KV-shared layers, the MoE block.
``Gemma4ForConditionalGeneration`` Gemma 4: its language model (``model.language_model.``);
                                   the vision and audio towers are not read.
=================================  ==========================================================

Tensors are named as in the checkpoint (the entry's ``weight_specs``; for Llama the mapping of
`jaxengine.models.Llama.weight_specs`, which `LLM.load_weights` uses too) and read one at a time
with ``safetensors.safe_open`` (memory-mapped), each converted and moved to the device before the
next: the host never holds a second full copy of the weights (the per-expert tensors of a
mixture-of-experts block are gathered into their stacked leaf on the host, one leaf at a time).
Both ``config.json`` styles are read: transformers 4 (``rope_theta``, ``rope_scaling``) and 5
(``rope_parameters``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxengine.models.interface import Model
from jaxengine.models.layer_scan import scan_config
from jaxengine.models.registry import hf_architecture
from jaxengine.models.weights import (
  abstract_module,
  check_weight_specs,
  replace_leaves,
  state_leaves,
)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Buffers some older checkpoints store that are recomputed here.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
#: safetensors dtype names.
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def is_hf_model_dir(path: str | os.PathLike) -> bool:
  """Whether `path` is a directory with a ``config.json``."""
  return (Path(path) / CONFIG_FILE).is_file()


def read_json(file: Path) -> Any:
  """The parsed JSON file `file` (ValueError naming the file, the line and the column when it is
  not valid JSON: a corrupt or truncated file)."""
  try:
    return json.loads(file.read_text(encoding="utf-8"))
  except json.JSONDecodeError as error:
    raise ValueError(
      f"{file} is not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
    ) from None
  except UnicodeDecodeError as error:
    raise ValueError(f"{file} is not UTF-8 text ({error.reason})") from None


def open_safetensors(file: str | os.PathLike) -> Any:
  """``safe_open(file)`` (numpy, memory-mapped), a context manager of the file's tensors.

  Raises:
    ValueError: naming the file, when it is not a valid safetensors file (a truncated download,
      a corrupt header): safetensors' own error names no file.
  """
  try:
    return safe_open(file, framework="numpy")
  except SafetensorError as error:
    raise ValueError(
      f"{os.fspath(file)} is not a valid safetensors file (corrupt or truncated: {error})"
    ) from None


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The parsed ``config.json`` of a model directory.

  Raises:
    FileNotFoundError: no ``config.json`` in `path`.
    ValueError: the file is not a JSON object.
  """
  file = Path(path) / CONFIG_FILE
  if not file.is_file():
    raise FileNotFoundError(f"no {CONFIG_FILE} in {os.fspath(path)!r}")
  config = read_json(file)
  if not isinstance(config, dict):
    raise ValueError(f"{file} must hold a JSON object")
  return config


def config_from_hf(hf: Mapping[str, Any]) -> Any:
  """Translates a Hugging Face ``config.json`` with its registry entry's config reader.

  For the Llama family (every architecture listed above) see
  `jaxengine.models.llama_checkpoints.config_from_hf`: the fields read and the variants refused.

  Args:
    hf: the parsed ``config.json``.

  Returns:
    The module's config (a `LlamaConfig` for the Llama family).

  Raises:
    ValueError: naming the field and value for an unsupported architecture (and the supported
      ones), rope type, activation, MLP bias, partial rotary embedding or per-layer sliding
      window, a size field that is not an integer, or a missing required field.
  """
  architecture = hf_architecture(hf)
  for field in _INT_FIELDS:
    value = hf.get(field)
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool)):
      raise ValueError(f"config.json: {field} must be an integer, got {value!r}")
  return architecture.read_config(hf)


#: ``config.json``'s size fields, checked to be integers before a config reader converts them
#: (its `int()` of a string would name no field).
_INT_FIELDS = (
  "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
  "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
  "max_position_embeddings", "num_experts", "num_local_experts", "num_experts_per_tok",
  "sliding_window",
)  # fmt: skip


def eos_token_ids(path: str | os.PathLike) -> list[int]:
  """The EOS ids generation stops at: ``generation_config.json``'s, else ``config.json``'s.

  Instruct checkpoints list several (Llama 3.1: ``<|end_of_text|>``, ``<|eom_id|>``,
  ``<|eot_id|>``; Qwen2.5: ``<|im_end|>``, ``<|endoftext|>``), as vLLM reads them.

  Returns:
    The ids in file order (empty when neither file names one).
  """
  file = Path(path) / GENERATION_CONFIG_FILE
  source = read_json(file) if file.is_file() else read_hf_config(path)
  value = source.get("eos_token_id")
  ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
  return [int(i) for i in ids]


def weight_files(path: str | os.PathLike) -> dict[str, str]:
  """Which safetensors file holds each tensor: the index's ``weight_map``, or the single file's.

  Raises:
    FileNotFoundError: neither ``model.safetensors.index.json`` nor ``model.safetensors``, or
      a shard the index names is missing.
    ValueError: an index that is not valid JSON or has no ``weight_map``, or a single file
      that is not a valid safetensors file (corrupt or truncated), naming the file.
  """
  path = Path(path)
  index = path / INDEX_FILE
  if index.is_file():
    contents = read_json(index)
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    if not isinstance(weight_map, dict):
      raise ValueError(f"{index} has no weight_map object")
    for file in sorted(set(weight_map.values())):
      if not (path / file).is_file():
        raise FileNotFoundError(f"{INDEX_FILE} names {file!r}, which is not in {str(path)!r}")
    return {name: str(path / file) for name, file in weight_map.items()}
  single = path / SINGLE_FILE
  if not single.is_file():
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r}")
  with open_safetensors(single) as f:
    return dict.fromkeys(f.keys(), str(single))


def checkpoint_dtype(path: str | os.PathLike) -> str:
  """The safetensors dtype (``"BF16"``, ``"F16"``, ``"F32"``) of the token embedding
  (``model.embed_tokens.weight``, under a prefix in a multimodal checkpoint)."""
  name = "model.embed_tokens.weight"
  files = weight_files(path)
  if name not in files:
    name = next((n for n in sorted(files) if n.endswith("." + name)), name)
  if name not in files:
    raise ValueError(f"the checkpoint in {os.fspath(path)!r} has no {name!r}")
  with open_safetensors(files[name]) as f:
    return f.get_slice(name).get_dtype()


def auto_dtype(path: str | os.PathLike):
  """``dtype="auto"``: float32 on CPU; on accelerators the checkpoint's dtype.

  A float16 checkpoint runs in bfloat16 on accelerators (the engine computes in float32 or
  bfloat16; TPUs have no fast float16 and bfloat16 has float32's range).
  """
  if jax.default_backend() == "cpu":
    return jnp.float32
  return jnp.float32 if checkpoint_dtype(path) in ("F32", "F64") else jnp.bfloat16


def load_safetensors(
  path: str | os.PathLike, dtype=jnp.float32, scan_layers: bool | None = False
) -> tuple[Model, Any]:
  """Loads a Hugging Face model directory into the module its registry entry names.

  The architecture (``config.json``'s ``architectures[0]``) picks the `ModelArchitecture` of
  `jaxengine.models.registry`: its config reader, its module and its tensor names (a `Llama`
  and a `LlamaConfig` for every architecture listed above). The model is built abstractly
  (`nnx.eval_shape`: no random weights), every expected name is checked against the files' names
  first, then each tensor is read from the memory-mapped files, converted to its parameter's
  layout and dtype on the host and moved to the device before the next one is read.

  Args:
    path: the directory (``config.json`` plus ``model.safetensors`` or sharded files with
      ``model.safetensors.index.json``).
    dtype: model dtype, ``jnp.float32`` or ``jnp.bfloat16`` (norm scales stay float32); tensors
      are cast from the checkpoint's dtype on the host.
    scan_layers: build the model with stacked layers (`jaxengine.models.layer_scan.scan_config`:
      True, False (default), or None for the platform's default), each layer's tensors read
      into its row of the stack.

  Returns:
    ``(model, config)``.

  Raises:
    FileNotFoundError: missing ``config.json`` or weight files.
    ValueError: a file that is corrupt or truncated (a JSON file that does not parse, with the
      line and column; a safetensors file or shard whose header does not parse or whose data
      it does not cover), naming the file, before any tensor is moved; unsupported
      architecture or rope type (see `config_from_hf`); a tensor the model
      needs is missing, or the files hold one it does not know (names listed); a tensor has the
      wrong shape or a non-floating dtype (named, with its file).
  """
  hf = read_hf_config(path)
  architecture = hf_architecture(hf)
  config = scan_config(architecture.read_config(hf), scan_layers)
  files = weight_files(path)
  abstract = abstract_module(architecture.module, config, dtype)
  graphdef, state = nnx.split(abstract)
  leaves = state_leaves(state)
  specs = check_weight_specs(architecture.weight_specs(config), state)
  known = {spec.name for spec in specs}
  missing = [s.name for s in specs if s.path is not None and s.name not in files]
  unknown = [
    n
    for n in files
    if n not in known
    and not n.endswith(_IGNORED_SUFFIXES)
    and not n.startswith(architecture.ignored_prefixes)
  ]
  for problem, names in (("lacks", missing), ("has tensors the model does not know:", unknown)):
    if names:
      listed = ", ".join(repr(n) for n in names[:5])
      more = f" and {len(names) - 5} more" if len(names) > 5 else ""
      raise ValueError(f"the checkpoint in {os.fspath(path)!r} {problem} {listed}{more}")

  arrays = {}
  # A stacked leaf (one tensor per row: the experts of a mixture-of-experts block) is filled on
  # the host and moved once its last row is read.
  rows_left = collections.Counter(
    s.path for s in specs if s.path is not None and s.layer is not None
  )
  stacks: dict[Any, np.ndarray] = {}
  with contextlib.ExitStack() as stack:
    handles = {
      file: stack.enter_context(open_safetensors(file))  # all checked before any tensor moves
      for file in sorted(set(files.values()))
    }
    for spec in specs:
      if spec.path is None:
        continue
      handle, file = handles[files[spec.name]], files[spec.name]
      dtype_name = handle.get_slice(spec.name).get_dtype()
      if dtype_name not in _FLOAT_DTYPES:
        raise ValueError(f"{spec.name} in {file}: dtype {dtype_name} is not floating")
      tensor = handle.get_tensor(spec.name)  # one tensor on the host at a time
      if tuple(tensor.shape) != spec.shape:
        raise ValueError(f"{spec.name} in {file}: expected shape {spec.shape}, got {tensor.shape}")
      leaf = leaves[spec.path]
      if spec.layer is None:
        arrays[spec.path] = jnp.asarray(spec.to_param(tensor, leaf.shape).astype(leaf.dtype))
        continue
      if spec.path not in stacks:
        stacks[spec.path] = np.zeros(leaf.shape, leaf.dtype)
      stacks[spec.path][spec.index] = spec.to_param(tensor, spec.row_shape(leaf.shape))
      rows_left[spec.path] -= 1
      if not rows_left[spec.path]:
        arrays[spec.path] = jnp.asarray(stacks.pop(spec.path))
  return cast(Model, nnx.merge(graphdef, replace_leaves(state, arrays))), config
