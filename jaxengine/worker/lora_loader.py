"""The runner's LoRA adapters: the `LoRAManager` built for a model (its target shapes, layers,
dtype and device), which then holds the adapters' host copies and device slots."""

from __future__ import annotations

from typing import Any, cast

import jax
from flax import nnx

from jaxengine.engine_config import EngineConfig
from jaxengine.lora import LoRAManager
from jaxengine.models.interface import Model
from jaxengine.worker.placement import MeshPlacement


def lora_manager(
  model: Model, config: EngineConfig, placement: MeshPlacement | None = None
) -> LoRAManager:
  """The runner's `LoRAManager` with `enable_lora`: `max_loras` device slots of rank
  `max_lora_rank` over the model's LoRA targets, `max_cpu_loras` host copies; on a mesh
  (`placement`) the slots split as their base projections (`MeshPlacement.lora_shardings`,
  which the steps' shardings then name).

  Raises:
    ValueError: a model without LoRA targets (`lora_target_shapes`).
  """
  shapes = getattr(model, "lora_target_shapes", None)
  if shapes is None:
    raise ValueError(f"enable_lora=True: {type(model).__name__} models do not support LoRA")
  target_shapes, num_layers = shapes(), _num_layers(model)
  shardings = None
  if placement is not None:
    shardings = placement.lora_shardings(target_shapes, num_layers)
  return LoRAManager(
    max_loras=config.max_loras,
    max_lora_rank=config.max_lora_rank,
    max_cpu_loras=cast(int, config.max_cpu_loras),  # validated: never None
    num_layers=num_layers,
    target_shapes=target_shapes,
    dtype=cast(Any, model).dtype,
    device=None if placement is not None else _committed_device(model),
    shardings=cast(Any, shardings),
    target_layers=_optional(model, "lora_target_layers"),
    layer_shapes=_optional(model, "lora_layer_shapes"),
  )


def _optional(model: Model, method: str) -> Any:
  """The model's `method`() where it has one (`lora_target_layers`: the layers of each target
  found only in some; `lora_layer_shapes`: layers narrower than the slots), else None."""
  found = getattr(model, method, None)
  return None if found is None else found()


def _num_layers(model: Model) -> int:
  """The model's decoder layers: its ``num_layers`` (a scanned model's ``layers`` is one stacked
  module), else the length of its ``layers``."""
  count = getattr(model, "num_layers", None)
  return count if isinstance(count, int) else len(cast(Any, model).layers)


def _committed_device(model: Model) -> jax.Device | None:
  """The one device the model's weights are committed to (a trainer's arrays), else None."""
  leaf = jax.tree.leaves(nnx.state(cast(Any, model)))[0]
  if isinstance(leaf, jax.Array) and getattr(leaf, "committed", False):
    return next(iter(leaf.devices()))
  return None
