"""LoRA adapters on the host, laid out for the device slots: read from a PEFT directory
(`load_peft_adapter`) or made from arrays a trainer holds (`lora_adapter_from_arrays`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.lora.peft_experts import (
  LEGACY_EXPERT_MODULES,
  expert_pairs,
  is_expert_tensor,
  module_name,
  parameter_targets,
)
from jaxengine.models.lora import LORA_TARGETS

#: ``...layers.{i}.{self_attn|linear_attn|mlp}.{target}.lora_{A|B}.weight`` in PEFT's saved
#: tensor names (``linear_attn``: a Qwen3.5 Gated DeltaNet layer; ``mlp.shared_expert.{target}``:
#: a Qwen3.5 mixture of experts' shared expert). The routed experts' tensors are read by
#: `jaxengine.lora.peft_experts`.
_TENSOR_NAME = re.compile(
  r"layers\.(\d+)\.(?:self_attn|linear_attn|mlp)\.((?:shared_expert\.)?\w+)\.lora_([AB])"
  r"(?:\.\w+)?\.weight$"
)

#: The modules of a multimodal checkpoint (Gemma 3's vision tower and projector, Gemma 4's vision
#: and audio towers and their embedders) that a text-only
#: engine never runs: an adapter's tensors under them change nothing it computes, so they are
#: left out (PEFT wraps every module of a target's name, the vision tower's ``q_proj`` too).
_NOT_RUN = re.compile(
  r"\.(?:vision_tower|multi_modal_projector|audio_tower|embed_vision|embed_audio)\."
)

#: `adapter_config.json` settings this engine does not run, with the value that is fine.
_UNSUPPORTED = {
  "use_dora": False,
  "bias": "none",
  "modules_to_save": None,
}


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
  """A PEFT adapter on the host, laid out for the device slots.

  Attributes:
    lora_int_id: the id it was loaded under.
    rank: its rank ``r`` (<= ``max_lora_rank``).
    scale: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), folded into ``b``.
    weights: ``(layer, target)`` -> ``(A [in, r], B [r, out])`` float32, ``B`` times `scale`
      (projections the adapter leaves alone are absent): NumPy host arrays, or JAX arrays on
      the device for an adapter made in memory from JAX arrays (`lora_adapter_from_arrays`).
  """

  lora_int_id: int
  rank: int
  scale: float
  weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def load_peft_adapter(
  path: str | os.PathLike,
  lora_int_id: int,
  *,
  max_lora_rank: int,
  num_layers: int,
  target_shapes: Mapping[str, tuple[int, ...]],
  layer_shapes: Mapping[tuple[int, str], tuple[int, ...]] | None = None,
) -> LoRAAdapter:
  """Reads and checks a PEFT LoRA directory.

  Args:
    path: the directory (``adapter_config.json``, ``adapter_model.safetensors``).
    lora_int_id: the id to record.
    max_lora_rank: the largest rank the engine's slots hold.
    num_layers: the base model's decoder layers.
    target_shapes: ``(in, out)`` of every projection the model lets adapters target.
    layer_shapes: None, or ``(layer, target)`` -> its ``(in, out)`` where a layer's differs
      from `target_shapes` (Gemma 4's).

  Raises:
    ValueError: (naming the path and the field; raised while reading the files, before anything
      changes) a missing directory, config or weights file; an ``adapter_config.json`` that is
      not valid JSON (with the line and column) or a corrupt or truncated
      ``adapter_model.safetensors`` (naming the file); a rank above `max_lora_rank`, a target
      module outside `target_shapes`, a setting the engine does not run (DoRA, biases,
      per-module ranks, modules_to_save), or a tensor of an unknown name or shape; an adapter
      made for a different base model (its layers beyond the model's, its projections'
      sizes not the model's, or none of its target modules the model's), naming what it has
      against what the model has, and its ``base_model_name_or_path`` when the config gives
      one.
  """
  where = os.fspath(path)
  config = _read_config(where)
  rank = config.get("r")
  if not isinstance(rank, int) or rank < 1:
    raise ValueError(f"lora_path={where!r}: r must be a positive int, got {rank!r}")
  alpha = config.get("lora_alpha", rank)
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
    raise ValueError(f"lora_path={where!r}: lora_alpha must be a number, got {alpha!r}")
  if rank > max_lora_rank:
    raise ValueError(f"lora_path={where!r}: rank r={rank} exceeds max_lora_rank={max_lora_rank}")
  for name, fine in _UNSUPPORTED.items():
    value = config.get(name, fine)
    if value != fine and not (fine == {} and not value):
      raise ValueError(f"lora_path={where!r}: {name}={value!r} is not supported")
  other_model = _other_model(where, config.get("base_model_name_or_path"))
  parameters = parameter_targets(config.get("target_parameters"), where, target_shapes)
  targets = _target_modules(
    config.get("target_modules"), where, other_model, target_shapes, bool(parameters)
  )
  ranks = _Ranks(where, rank, alpha, bool(config.get("use_rslora")), config)
  scale = ranks.scale(rank, alpha)
  tensors = {k: t for k, t in _read_tensors(where).items() if not _NOT_RUN.search(k)}
  experts = {k: t for k, t in tensors.items() if is_expert_tensor(k)}
  others = {k: t for k, t in tensors.items() if k not in experts}
  shapes_of = lambda layer, target: (layer_shapes or {}).get((layer, target), target_shapes[target])
  weights = _pairs(where, others, other_model, targets, ranks, num_layers, target_shapes, shapes_of)
  if experts:
    shapes = target_shapes
    weights.update(expert_pairs(where, experts, other_model, ranks, num_layers, shapes))
  largest = max([rank, *(a.shape[-1] for a, _ in weights.values())])
  if largest > max_lora_rank:
    raise ValueError(
      f"lora_path={where!r}: rank {largest} (r={rank}, rank_pattern "
      f"{config.get('rank_pattern') or {}}) exceeds max_lora_rank={max_lora_rank}"
    )
  return LoRAAdapter(int(lora_int_id), largest, scale, _padded(weights, largest))


class _Ranks:
  """Each module's rank and scale by PEFT's rules: ``rank_pattern`` / ``alpha_pattern`` keys
  are regular expressions, the first that matches the end of a module's dotted name after a
  dot (or all of it) gives its value, else ``r`` / ``lora_alpha``; the scale ``alpha / rank``
  (``alpha / sqrt(rank)`` with ``use_rslora``).

  Raises (`rank`):
    ValueError: a pattern's value that is not a positive int (a rank) or a number (an alpha).
  """

  def __init__(self, where: str, rank: int, alpha, rslora: bool, config: Mapping[str, Any]):
    self.where, self.r, self.alpha, self.rslora = where, rank, alpha, rslora
    self.rank_pattern = dict(config.get("rank_pattern") or {})
    self.alpha_pattern = dict(config.get("alpha_pattern") or {})
    for name, patterns, valid in (
      ("rank_pattern", self.rank_pattern, lambda v: isinstance(v, int) and v >= 1),
      ("alpha_pattern", self.alpha_pattern, lambda v: isinstance(v, (int, float))),
    ):
      for key, value in patterns.items():
        if isinstance(value, bool) or not valid(value):
          raise ValueError(f"lora_path={where!r}: {name}[{key!r}]={value!r} is not valid")

  @staticmethod
  def _find(patterns: Mapping[str, Any], module: str, default):
    for key, value in patterns.items():
      if re.match(rf"(.*\.)?({key})$", module):
        return value
    return default

  def rank(self, module: str) -> int:
    """The rank of `module` (its dotted name in the base model, ``model.layers.0...``)."""
    return self._find(self.rank_pattern, module, self.r)

  def module_scale(self, module: str) -> float:
    """The scale of `module`'s update."""
    return self.scale(self.rank(module), self._find(self.alpha_pattern, module, self.alpha))

  def scale(self, rank: int, alpha) -> float:
    """``alpha / rank``, or ``alpha / sqrt(rank)`` with ``use_rslora``."""
    return float(alpha) / (math.sqrt(rank) if self.rslora else rank)


def _padded(weights: dict, rank: int) -> dict:
  """Every ``(A [..., in, r], B [..., r, out])`` pair zero-padded to `rank` (exact: the added
  rank dimensions multiply zeros)."""
  out = {}
  for key, (a, b) in weights.items():
    extra = rank - a.shape[-1]
    if extra:
      a = np.concatenate([a, np.zeros((*a.shape[:-1], extra), a.dtype)], axis=-1)
      b = np.concatenate([b, np.zeros((*b.shape[:-2], extra, b.shape[-1]), b.dtype)], axis=-2)
    out[key] = (a, b)
  return out


def lora_adapter_from_arrays(
  lora_int_id: int,
  weights: Mapping[tuple[int, str], tuple[Any, Any]],
  *,
  scale: float | Mapping[tuple[int, str], float] = 1.0,
) -> LoRAAdapter:
  """An adapter from in-memory arrays (a trainer's LoRA parameters), no file involved.

  Args:
    lora_int_id: the id it goes by (`LoRARequest.lora_int_id`).
    weights: ``(layer, target)`` -> ``(A [in, r], B [r, out])`` of any floating dtype, every
      pair of the same rank ``r``. NumPy pairs are copied to float32 host arrays; JAX pairs
      stay on their devices (cast and scaled there by one jitted call, compiled once per
      structure and scales: nothing passes through the host, as under Tunix's transfer guard).
    scale: the factor of ``B`` (``alpha / r``), one for all pairs or one per pair; folded into
      the copy of ``B``, as `load_peft_adapter` does.

  Returns:
    The `LoRAAdapter` (its `scale` is the first pair's when `scale` is per pair). Shapes
    against a model are checked by `LoRAManager.check_adapter`.

  Raises:
    ValueError: no pairs, a pair that is not 2-D ``[in, r]`` and ``[r, out]``, ranks that
      differ, or a per-pair `scale` missing a pair.
  """
  who = f"lora_int_id={lora_int_id}"
  if not weights:
    raise ValueError(f"{who}: weights is empty (no (layer, target) pairs)")
  factors = {}
  for key, (a, b) in weights.items():
    shape_a, shape_b = np.shape(a), np.shape(b)
    if len(shape_a) != 2 or len(shape_b) != 2 or shape_a[1] != shape_b[0]:
      raise ValueError(
        f"{who}: {key} has A, B of shapes {shape_a}, {shape_b}, expected [in, r], [r, out]"
      )
    factor = scale.get(key) if isinstance(scale, Mapping) else scale
    if factor is None:
      raise ValueError(f"{who}: scale has no entry for {key}")
    factors[key] = float(factor)
  ranks = sorted({np.shape(a)[1] for a, _ in weights.values()})
  if len(ranks) > 1:
    raise ValueError(f"{who}: the pairs' ranks differ ({ranks})")
  on_device = {k: p for k, p in weights.items() if any(isinstance(x, jax.Array) for x in p)}
  pairs = {
    k: (np.asarray(a, np.float32), np.asarray(b, np.float32) * np.float32(factors[k]))
    for k, (a, b) in weights.items()
    if k not in on_device
  }
  if on_device:
    pairs.update(_scaled(on_device, tuple(sorted((k, factors[k]) for k in on_device))))
  first = next(iter(weights))
  return LoRAAdapter(int(lora_int_id), ranks[0], factors[first], pairs)


@functools.partial(jax.jit, static_argnums=1)
def _scaled(pairs, factors: tuple) -> dict:
  """``(A, B * factor)`` in float32 of every pair, on the pairs' device."""
  by_key = dict(factors)
  return {
    k: (a.astype(jnp.float32), b.astype(jnp.float32) * by_key[k]) for k, (a, b) in pairs.items()
  }


def _read_config(where: str) -> dict[str, Any]:
  """The adapter's parsed ``adapter_config.json`` (ValueError naming the file: missing, not
  JSON, with the line and column, or not a JSON object)."""
  from jaxengine.models.safetensors_loader import read_json

  file = os.path.join(where, "adapter_config.json")
  if not os.path.isfile(file):
    raise ValueError(f"lora_path={where!r} has no adapter_config.json (not a PEFT adapter)")
  try:
    config = read_json(Path(file))
  except ValueError as error:
    raise ValueError(f"lora_path={where!r}: {error}") from None
  if not isinstance(config, dict):
    raise ValueError(f"lora_path={where!r}: {file} holds a {type(config).__name__}, not an object")
  return config


def _other_model(where: str, base_model: Any) -> str:
  """The start of an error for an adapter made for another base model than the engine's."""
  named = f" ({base_model!r}, its base_model_name_or_path)" if base_model else ""
  return f"lora_path={where!r} was made for a different base model{named}"


def _target_modules(
  value,
  where: str,
  other_model: str,
  target_shapes: Mapping[str, tuple[int, ...]],
  has_parameters: bool = False,
) -> list[str]:
  """The adapter's target module names, each one the model supports (ValueError otherwise:
  an adapter none of whose modules this model family has is one of another base model).

  A name the model has under a shared expert (``shared_expert.gate_proj``) or its routed
  experts' modules (``gate_proj``, Mixtral's ``w1``: `jaxengine.lora.peft_experts`) counts as
  the model's. With `has_parameters` (``target_parameters`` given) the list may be empty."""
  names = [value] if isinstance(value, str) else list(value or [])
  if not names:
    if has_parameters:
      return []
    raise ValueError(f"lora_path={where!r}: target_modules is empty")
  experts = "experts.gate_proj" in target_shapes
  known = ", ".join(t for t in LORA_TARGETS if t in target_shapes)
  ours = lambda name: (
    name in target_shapes
    or f"shared_expert.{name}" in target_shapes
    or (experts and name in LEGACY_EXPERT_MODULES)
  )
  if not any(name in LORA_TARGETS or name in LEGACY_EXPERT_MODULES for name in names):
    raise ValueError(
      f"{other_model}: none of its target_modules {names} is a module of this model (unknown "
      f"target modules; this model's: {known})"
    )
  for name in names:
    if not ours(name):
      raise ValueError(f"lora_path={where!r}: unknown target module {name!r} (supported: {known})")
  return names


def _read_tensors(where: str) -> dict[str, np.ndarray]:
  """Every tensor of the adapter's ``adapter_model.safetensors`` as host arrays (ValueError
  naming the file when it is missing, corrupt or truncated)."""
  import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy: bfloat16 adapters load too)

  from jaxengine.models.safetensors_loader import open_safetensors

  file = os.path.join(where, "adapter_model.safetensors")
  if not os.path.isfile(file):
    raise ValueError(f"lora_path={where!r} has no adapter_model.safetensors")
  try:
    handle = open_safetensors(file)
  except ValueError as error:
    raise ValueError(f"lora_path={where!r}: {error}") from None
  with handle as f:  # host arrays: reading does no device work
    names = f.keys()
    return {name: f.get_tensor(name) for name in names}


def _pairs(
  where: str,
  tensors: Mapping[str, np.ndarray],
  other_model: str,
  targets: list[str],
  ranks: _Ranks,
  num_layers: int,
  target_shapes: Mapping[str, tuple[int, ...]],
  shapes_of: Any,
) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
  """The adapter's ``(A [in, r], scale * B [r, out])`` pairs by ``(layer, target)`` (``r`` and
  ``scale`` each module's, `_Ranks`).

  Tensors of modules a text-only engine never runs (`_NOT_RUN`: a vision tower's) are left out.

  Raises:
    ValueError: a tensor of an unknown name or of a target outside `targets`; a layer beyond
      the model's or an ``in`` / ``out`` size not the model's (`other_model`: made for a
      different base model); a pair missing a half or of another rank than ``r``.
  """
  halves: dict[tuple[int, str], dict[str, Any]] = {}
  for name, tensor in tensors.items():
    if _NOT_RUN.search(name):
      continue
    match = _TENSOR_NAME.search(name)
    if match is None or match[2].rsplit(".", 1)[-1] not in targets or match[2] not in target_shapes:
      raise ValueError(f"lora_path={where!r}: unexpected tensor {name!r}")
    if int(match[1]) >= num_layers:
      raise ValueError(
        f"{other_model}: tensor {name!r} is for layer {match[1]}, this model has {num_layers} "
        f"layers (0..{num_layers - 1})"
      )
    pair = halves.setdefault((int(match[1]), match[2]), {})
    pair[match[3]], pair["module"] = tensor, module_name(name)
  weights = {}
  for (layer, target), pair in halves.items():
    n_in, n_out = shapes_of(layer, target)
    rank, scale = ranks.rank(pair["module"]), ranks.module_scale(pair["module"])
    a, b = pair.get("A"), pair.get("B")
    if (
      a is not None and b is not None and a.ndim == 2 and (a.shape[1], b.shape[0]) != (n_in, n_out)
    ):
      raise ValueError(
        f"{other_model}: its layer {layer} {target} maps {a.shape[1]} -> {b.shape[0]} "
        f"features (lora_A, lora_B of shapes {a.shape}, {b.shape}), this model's {target} "
        f"{n_in} -> {n_out}"
      )
    if a is None or b is None or a.shape != (rank, n_in) or b.shape != (n_out, rank):
      shapes = [None if t is None else t.shape for t in (a, b)]
      raise ValueError(
        f"lora_path={where!r}: layer {layer} {target} has lora_A, lora_B of shapes {shapes}, "
        f"expected {(rank, n_in)}, {(n_out, rank)}"
      )
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    weights[layer, target] = (np.ascontiguousarray(a32.T), np.ascontiguousarray(b32.T) * scale)
  return weights
