"""Loading what an engine serves: a model named by path or hub id (or given built), its
tokenizer, EOS ids and sampling defaults, with the checks that come before any weight is read.

`jaxengine.LLM` and `LLMEngine.from_engine_args` (vLLM's `EngineArgs`) load through
`load_model`; `LLMEngine` itself takes the built model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax

from jaxengine import parallel
from jaxengine.compilation_cache import enable_compilation_cache
from jaxengine.engine.generation_config import generation_defaults
from jaxengine.engine_config import EngineConfig, check_max_model_len
from jaxengine.models import Model, check_model
from jaxengine.models.attention_backends import attention_backend
from jaxengine.models.gguf_loader import default_model_path, open_gguf, read_config
from jaxengine.models.hub import load_resolved, resolve_model
from jaxengine.models.safetensors_loader import (
  config_from_hf,
  eos_token_ids,
  read_hf_config,
  weight_files,
)
from jaxengine.tokenizer import Tokenizer
from jaxengine.worker.placement import num_attention_heads
from jaxengine.worker.routed_experts import moe_shape


class LoadedModel(NamedTuple):
  """What `load_model` gives an engine.

  Attributes:
    model: the built model, weights loaded.
    tokenizer: the given tokenizer or the checkpoint's; None for a directory without
      ``tokenizer.json`` or a built model given without one.
    eos_token_ids: for a Hugging Face directory the tokenizer's EOS id followed by the
      generation config's; None: the engine's default (the tokenizer's or the model's).
    generation_defaults: `SamplingParams` keywords from ``generation_config.json``
      (`jaxengine.engine.generation_config`; empty for a GGUF file or a built model).
    compilation_cache_dir: the persistent compilation cache's directory, None when off.
  """

  model: Model
  tokenizer: Tokenizer | None
  eos_token_ids: list[int] | None
  generation_defaults: dict[str, Any]
  compilation_cache_dir: Path | None


def load_model(
  model: str | os.PathLike | Model | None,
  tokenizer: Tokenizer | str | os.PathLike | None,
  config: EngineConfig,
) -> LoadedModel:
  """Loads (or checks) the model an engine of `config` serves, as `jaxengine.LLM` documents it.

  A built model is checked first, then JAX's persistent compilation cache is turned on (before
  anything compiles: loading does), then a path or hub id is loaded (None: the default GGUF
  file) after the checks that need no weights (a Pallas backend off its platform, a
  `tensor_parallel_size` that does not divide the heads, `max_model_len` above the
  checkpoint's limit).

  `tokenizer` may be a `Tokenizer` or, as vLLM's `tokenizer=`, the path of a Hugging Face
  directory holding ``tokenizer.json`` (read before anything else loads).

  Raises:
    FileNotFoundError, ValueError: as `jaxengine.LLM`.
    TypeError: a `tokenizer` that is neither a `Tokenizer` nor a path.
  """
  if isinstance(tokenizer, (str, os.PathLike)):
    tokenizer = Tokenizer.from_pretrained(tokenizer)
  elif tokenizer is not None and not isinstance(tokenizer, Tokenizer):
    raise TypeError(
      f"tokenizer must be a jaxengine.Tokenizer or a tokenizer directory's path, got "
      f"{type(tokenizer).__name__}"
    )
  t = config.tensor_parallel_size
  if model is not None and not isinstance(model, (str, os.PathLike)):
    check_model(model)  # before the process-wide compilation cache is turned on
    if config.enable_return_routed_experts:
      moe_shape(model)
  if isinstance(model, Model) and num_attention_heads(model) is not None:
    parallel.check_heads(cast(int, num_attention_heads(model)), t)
  # Before anything compiles (loading a model does): every executable then goes to the cache.
  cache_dir = enable_compilation_cache(config.compilation_cache)
  if not (model is None or isinstance(model, (str, os.PathLike))):
    return LoadedModel(cast(Model, model), tokenizer, None, {}, cache_dir)
  if config.attention_backend is not None:  # a Pallas kernel off its platform: before loading
    attention_backend(config.attention_backend).check_platform(jax.default_backend())
  built, tokenizer, eos, defaults = _load_checkpoint(
    model,
    tokenizer,
    config.dtype,
    revision=config.revision,
    download_dir=config.download_dir,
    tp=t,
    max_model_len=config.max_model_len,
    routed_experts=config.enable_return_routed_experts,
    scan_layers=config.scan_layers,
  )
  return LoadedModel(built, tokenizer, eos, defaults, cache_dir)


def _load_checkpoint(
  name: str | os.PathLike | None,
  tokenizer: Tokenizer | None,
  dtype,
  *,
  revision: str | None,
  download_dir: str | None,
  tp: int = 1,
  max_model_len: int | None = None,
  routed_experts: bool = False,
  scan_layers: bool | None = False,
) -> tuple[Model, Tokenizer | None, list[int] | None, dict[str, Any]]:
  """Builds the model a path or hub id names (None: the default GGUF file).

  `max_model_len` above the config's `max_position_embeddings`, and `routed_experts`
  (``enable_return_routed_experts``) of a model without MoE layers, are refused from the
  config, before any weight is read (the runner checks the model again). `scan_layers`
  (`EngineConfig.scan_layers`) builds the model with its layers stacked, so no unrolled copy is
  made (`jaxengine.models.layer_scan.scan_config`).

  Returns:
    ``(model, tokenizer, EOS ids, sampling defaults)``: the given tokenizer or the checkpoint's
    (None for a directory without ``tokenizer.json``); for a Hugging Face directory the
    tokenizer's EOS id followed by the generation config's, else None (the engine's default);
    the generation config's sampling defaults (`jaxengine.engine.generation_config`; empty for GGUF).
  """
  resolved = None
  if name is not None:
    resolved = resolve_model(name, revision=revision, download_dir=download_dir)
  if resolved is None or resolved.kind == "gguf":
    path = None if resolved is None else resolved.path
    config = read_config(open_gguf(path if path is not None else default_model_path()))
    heads = getattr(config, "num_attention_heads", None)
    if tp > 1 and isinstance(heads, int):  # refused before any tensor is read, as below
      parallel.check_heads(heads, tp)
    check_max_model_len(max_model_len, config.max_position_embeddings)
    if routed_experts:
      moe_shape(config)
    model = load_resolved(resolved, dtype, scan_layers)
    return model, Tokenizer.from_gguf(path) if tokenizer is None else tokenizer, None, {}
  directory = resolved.path
  config_path = os.path.join(directory, "config.json")
  if tp > 1 and os.path.isfile(config_path):  # refused before any tensor is read
    with open(config_path) as f:
      heads = json.load(f).get("num_attention_heads")
    if isinstance(heads, int):
      parallel.check_heads(heads, tp)
  if os.path.isfile(config_path):
    # An unsupported variant, then missing weight files, are named before the length check.
    hf_config = config_from_hf(read_hf_config(directory))
    limit = getattr(hf_config, "max_position_embeddings", None)
    weight_files(directory)
    if isinstance(limit, int):
      check_max_model_len(max_model_len, limit)
    if routed_experts:
      moe_shape(hf_config)
  model = load_resolved(resolved, dtype, scan_layers)
  if tokenizer is None and os.path.isfile(os.path.join(directory, "tokenizer.json")):
    tokenizer = Tokenizer.from_pretrained(directory)
  primary = None if tokenizer is None else tokenizer.eos_token_id
  eos = list(dict.fromkeys(([] if primary is None else [primary]) + eos_token_ids(directory)))
  return model, tokenizer, eos or None, generation_defaults(directory)
