"""Build a `Llama` from a Hugging Face model directory (``config.json`` + safetensors).

Supported architectures (``config.json`` ``architectures[0]``), all served by the one
Llama-family module with config switches:

=========================  ==================================================================
``LlamaForCausalLM``       Llama 2, Llama 3 / 3.1 / 3.2 (``rope_scaling`` type ``llama3``),
                           SmolLM; ``attention_bias`` puts biases on q/k/v and o.
``MistralForCausalLM``     Mistral (``sliding_window`` when set).
``Qwen2ForCausalLM``       Qwen2 / Qwen2.5: biases on the q/k/v projections.
``Qwen3ForCausalLM``       Qwen3: per-head q/k RMSNorm before rotary, explicit ``head_dim``.
=========================  ==================================================================

Tensors are named as in the checkpoint (`jaxengine.models.Llama.weight_specs`, the same mapping
`LLM.load_weights` uses) and read one at a time with ``safetensors.safe_open`` (memory-mapped),
each converted and moved to the device before the next: the host never holds a second full copy
of the weights. Both ``config.json`` styles are read: transformers 4
(``rope_theta``, ``rope_scaling``) and 5 (``rope_parameters``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from jaxengine.models.llama import Llama, Llama3RopeScaling, LlamaConfig
from jaxengine.models.weights import model_weight_specs, replace_leaves, state_leaves

#: ``architectures[0]`` -> the family's ``model_type``.
SUPPORTED_ARCHITECTURES = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
}
#: Rope types implemented (``rope_type`` or the older ``type`` key); None means default.
SUPPORTED_ROPE_TYPES = ("default", "llama3")
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


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  """The parsed ``config.json`` of a model directory.

  Raises:
    FileNotFoundError: no ``config.json`` in `path`.
    ValueError: the file is not a JSON object.
  """
  file = Path(path) / CONFIG_FILE
  if not file.is_file():
    raise FileNotFoundError(f"no {CONFIG_FILE} in {os.fspath(path)!r}")
  try:
    config = json.loads(file.read_text())
  except json.JSONDecodeError as error:
    raise ValueError(f"{file} is not valid JSON ({error})") from error
  if not isinstance(config, dict):
    raise ValueError(f"{file} must hold a JSON object")
  return config


def _first_id(value) -> int | None:
  """An id or the first of a list of ids (Llama 3.1 lists several EOS ids), or None."""
  if isinstance(value, (list, tuple)):
    return int(value[0]) if value else None
  return None if value is None else int(value)


def _rope(hf: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
  """``(rope_theta, scaling)`` from either config style; ValueError for other rope types."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type")) or "default"
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
      f"unsupported rope type {rope_type!r} (rope_scaling / rope_parameters); supported: "
      f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )
  if rope_type == "default":
    return float(theta), None
  try:
    scaling = Llama3RopeScaling(
      factor=float(params["factor"]),
      low_freq_factor=float(params["low_freq_factor"]),
      high_freq_factor=float(params["high_freq_factor"]),
      original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
  except KeyError as error:
    raise ValueError(f"rope type 'llama3' needs {error.args[0]!r} in rope_scaling") from None
  return float(theta), scaling


def config_from_hf(hf: Mapping[str, Any]) -> LlamaConfig:
  """Translates a Hugging Face ``config.json`` into a `LlamaConfig`.

  Reads ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads`` (default: the attention heads), ``head_dim``
  (default ``hidden_size / num_attention_heads``), ``rms_norm_eps``, ``rope_theta`` or
  ``rope_parameters``, ``rope_scaling`` (type ``llama3``), ``max_position_embeddings``,
  ``tie_word_embeddings`` (default False, as transformers' classes of these families),
  ``bos_token_id``/``eos_token_id`` (the first of a list), and per family: ``attention_bias``
  (Llama, Qwen3), q/k/v biases (Qwen2), q/k norms (Qwen3), ``sliding_window`` (Mistral).

  Args:
    hf: the parsed ``config.json``.

  Returns:
    The `LlamaConfig`.

  Raises:
    ValueError: naming the field and value for an unsupported architecture, rope type,
      activation, MLP bias, partial rotary embedding or per-layer sliding window, or a missing
      required field.
  """
  architectures = hf.get("architectures") or []
  architecture = str(architectures[0]) if architectures else None
  if architecture is None:  # configs written without it still name their model_type
    by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
    architecture = by_type.get(str(hf.get("model_type")))
  family = SUPPORTED_ARCHITECTURES.get(architecture or "")
  if family is None:
    named = architectures[0] if architectures else f"model_type={hf.get('model_type')!r}"
    raise ValueError(
      f"unsupported architecture {named!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
  activation = hf.get("hidden_act", "silu")
  if activation != "silu":
    raise ValueError(f"unsupported hidden_act {activation!r}; only 'silu' (SwiGLU) is implemented")
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias=True is not supported")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported")
  if family in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
    raise ValueError(
      f"use_sliding_window=True (sliding-window attention on some layers of {architecture}) is "
      "not supported"
    )
  layer_types = hf.get("layer_types") or []
  if any(t != "full_attention" for t in layer_types):
    raise ValueError(f"layer_types {sorted(set(layer_types))} are not supported (full_attention)")
  rope_theta, rope_scaling = _rope(hf)
  try:
    hidden_size = int(hf["hidden_size"])
    num_heads = int(hf["num_attention_heads"])
    fields = dict(
      vocab_size=int(hf["vocab_size"]),
      hidden_size=hidden_size,
      intermediate_size=int(hf["intermediate_size"]),
      num_hidden_layers=int(hf["num_hidden_layers"]),
      num_attention_heads=num_heads,
    )
  except KeyError as error:
    raise ValueError(f"config.json lacks {error.args[0]!r}") from None
  attention_bias = bool(hf.get("attention_bias", False))
  sliding_window = hf.get("sliding_window") if family == "mistral" else None
  return LlamaConfig(
    **fields,
    num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
    head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
    rope_theta=rope_theta,
    rope_scaling=rope_scaling,
    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
    bos_token_id=_first_id(hf.get("bos_token_id")),
    eos_token_id=_first_id(hf.get("eos_token_id")),
    # Qwen2 always has q/k/v biases and no output bias; Llama and Qwen3 use one switch for all.
    attention_bias=family == "qwen2" or (family != "mistral" and attention_bias),
    attention_output_bias=family in ("llama", "qwen3") and attention_bias,
    qk_norm=family == "qwen3",
    sliding_window=int(sliding_window) if sliding_window else None,
  )


def eos_token_ids(path: str | os.PathLike) -> list[int]:
  """The EOS ids generation stops at: ``generation_config.json``'s, else ``config.json``'s.

  Instruct checkpoints list several (Llama 3.1: ``<|end_of_text|>``, ``<|eom_id|>``,
  ``<|eot_id|>``; Qwen2.5: ``<|im_end|>``, ``<|endoftext|>``), as vLLM reads them.

  Returns:
    The ids in file order (empty when neither file names one).
  """
  file = Path(path) / GENERATION_CONFIG_FILE
  source = json.loads(file.read_text()) if file.is_file() else read_hf_config(path)
  value = source.get("eos_token_id")
  ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
  return [int(i) for i in ids]


def weight_files(path: str | os.PathLike) -> dict[str, str]:
  """Which safetensors file holds each tensor: the index's ``weight_map``, or the single file's.

  Raises:
    FileNotFoundError: neither ``model.safetensors.index.json`` nor ``model.safetensors``, or
      a shard the index names is missing.
  """
  path = Path(path)
  index = path / INDEX_FILE
  if index.is_file():
    weight_map = json.loads(index.read_text())["weight_map"]
    for file in sorted(set(weight_map.values())):
      if not (path / file).is_file():
        raise FileNotFoundError(f"{INDEX_FILE} names {file!r}, which is not in {str(path)!r}")
    return {name: str(path / file) for name, file in weight_map.items()}
  single = path / SINGLE_FILE
  if not single.is_file():
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(path)!r}")
  with safe_open(single, framework="numpy") as f:
    return dict.fromkeys(f.keys(), str(single))


def checkpoint_dtype(path: str | os.PathLike) -> str:
  """The safetensors dtype (``"BF16"``, ``"F16"``, ``"F32"``) of the token embedding."""
  name = "model.embed_tokens.weight"
  files = weight_files(path)
  if name not in files:
    raise ValueError(f"the checkpoint in {os.fspath(path)!r} has no {name!r}")
  with safe_open(files[name], framework="numpy") as f:
    return f.get_slice(name).get_dtype()


def auto_dtype(path: str | os.PathLike):
  """``dtype="auto"``: float32 on CPU; on accelerators the checkpoint's dtype.

  A float16 checkpoint runs in bfloat16 on accelerators (the engine computes in float32 or
  bfloat16; TPUs have no fast float16 and bfloat16 has float32's range).
  """
  if jax.default_backend() == "cpu":
    return jnp.float32
  return jnp.float32 if checkpoint_dtype(path) in ("F32", "F64") else jnp.bfloat16


def load_safetensors(path: str | os.PathLike, dtype=jnp.float32) -> tuple[Llama, LlamaConfig]:
  """Loads a Hugging Face Llama-family model directory into a `Llama`.

  The model is built abstractly (`nnx.eval_shape`: no random weights), every expected name is
  checked against the files' names first, then each tensor is read from the memory-mapped files,
  converted to its parameter's layout and dtype on the host and moved to the device before the
  next one is read.

  Args:
    path: the directory (``config.json`` plus ``model.safetensors`` or sharded files with
      ``model.safetensors.index.json``).
    dtype: model dtype, ``jnp.float32`` or ``jnp.bfloat16`` (norm scales stay float32); tensors
      are cast from the checkpoint's dtype on the host.

  Returns:
    ``(model, config)``.

  Raises:
    FileNotFoundError: missing ``config.json`` or weight files.
    ValueError: unsupported architecture or rope type (see `config_from_hf`); a tensor the model
      needs is missing, or the files hold one it does not know (names listed); a tensor has the
      wrong shape or a non-floating dtype (named, with its file).
  """
  config = config_from_hf(read_hf_config(path))
  files = weight_files(path)
  abstract = nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  leaves = state_leaves(state)
  specs = model_weight_specs(abstract, state)
  known = {spec.name for spec in specs}
  missing = [s.name for s in specs if s.path is not None and s.name not in files]
  unknown = [n for n in files if n not in known and not n.endswith(_IGNORED_SUFFIXES)]
  for problem, names in (("lacks", missing), ("has tensors the model does not know:", unknown)):
    if names:
      listed = ", ".join(repr(n) for n in names[:5])
      more = f" and {len(names) - 5} more" if len(names) > 5 else ""
      raise ValueError(f"the checkpoint in {os.fspath(path)!r} {problem} {listed}{more}")

  arrays = {}
  with contextlib.ExitStack() as stack:
    handles = {
      file: stack.enter_context(safe_open(file, framework="numpy"))
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
      arrays[spec.path] = jnp.asarray(spec.to_param(tensor, leaf.shape).astype(leaf.dtype))
  return nnx.merge(graphdef, replace_leaves(state, arrays)), config
