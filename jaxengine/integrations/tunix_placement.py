"""Where a Tunix rollout's engine goes and how much device memory it takes.

`JaxEngineRollout` (`jaxengine.integrations.tunix`) places its engine here: `engine_placement`
resolves `RolloutConfig`'s tensor- and data-parallel sizes on the rollout mesh as Tunix's own
vLLM rollout does (unless the engine options place the engine themselves), `engine_device` is
the engine's first device, and `rollout_memory_fraction` / `process_memory_fraction` turn the
engine's share of each device's memory (``gpu_memory_utilization``, else
`RolloutConfig.rollout_vllm_hbm_utilization`) into the process-wide fraction the engine takes,
whatever a colocated trainer holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxengine.integrations import missing_extra

try:
  from tunix.rl.rollout import base_rollout
except ModuleNotFoundError as error:  # the extra is not installed: say how to install it
  raise missing_extra(error, __name__) from error

from jaxengine.parallel import make_mesh

__all__ = [
  "PARALLEL_FIELDS",
  "engine_device",
  "engine_placement",
  "process_memory_fraction",
  "rollout_memory_fraction",
]

#: `RolloutConfig`'s parallelism fields -> the engine option of the same meaning.
PARALLEL_FIELDS = ("tensor_parallel_size", "data_parallel_size")


def _rollout_sizes(config: base_rollout.RolloutConfig) -> dict[str, int]:
  """`RolloutConfig`'s tensor- and data-parallel sizes (-1: inferred from the rollout mesh).

  Raises:
    ValueError: a size that is neither -1 nor a positive int, naming the field and value.
  """
  sizes = {}
  for name in PARALLEL_FIELDS:
    value = getattr(config, name, -1)
    bad = isinstance(value, bool) or not isinstance(value, (int, np.integer))
    if bad or value == 0 or value < -1:
      raise ValueError(f"RolloutConfig.{name} must be -1 or a positive int, got {value!r}")
    sizes[name] = int(value)
  return sizes


def _engine_sizes(engine_options: dict[str, Any]) -> dict[str, int] | None:
  """The parallel sizes the engine options fix (a `mesh`'s axes, or the sizes given), or None
  when they place nothing."""
  mesh = engine_options.get("mesh")
  if mesh is not None:
    return {
      "tensor_parallel_size": int(mesh.shape.get("model", 1)),
      "data_parallel_size": int(mesh.shape.get("data", 1)),
    }
  given = {k: engine_options.get(k) for k in PARALLEL_FIELDS}
  if all(v is None for v in given.values()):
    return None
  return {k: 1 if v is None else int(v) for k, v in given.items()}


def engine_placement(
  config: base_rollout.RolloutConfig,
  mesh: jax.sharding.Mesh | None,
  device: jax.Device,
  engine_options: dict[str, Any],
) -> None:
  """Places the engine from `RolloutConfig`'s parallel sizes and the rollout mesh, in
  `engine_options` (its ``mesh``), unless the options place it themselves.

  The sizes resolve as Tunix's own vLLM rollout resolves them: -1 for both: every device of the
  rollout mesh splits each layer (`tensor_parallel_size` = the mesh's device count, one
  data-parallel group); -1 for one: the devices left by the other. A resolved ``t x d`` of 1
  is a one-device engine mesh on `device`: the trainer's weights are committed to their device,
  and an engine without a mesh would compile every step twice (once per placement); on a mesh
  everything is placed from the start. Otherwise a ``(data, model)`` mesh of the rollout
  mesh's first ``d * t`` devices. Engine options that place the engine (`mesh`,
  `tensor_parallel_size`, `data_parallel_size`) win, and a size `RolloutConfig` sets
  explicitly (not -1) must equal theirs. A LoRA rollout is placed the same way (the engine
  splits its adapters' slots as their base projections, `jaxengine.parallel.lora_specs`).

  Args:
    config: the rollout's `RolloutConfig`.
    mesh: the rollout mesh (None or empty: `device` alone).
    device: the engine's first device (`engine_device`).
    engine_options: `EngineConfig` fields; ``mesh`` is set here when they place nothing.

  Raises:
    ValueError: (before any device work) a size that is neither -1 nor positive; a set size
      that differs from the engine options' (both named); sizes needing more devices than the
      rollout mesh has.
  """
  sizes = _rollout_sizes(config)
  given = _engine_sizes(engine_options)
  if given is not None:
    for name, value in sizes.items():
      if value != -1 and value != given[name]:
        raise ValueError(
          f"RolloutConfig.{name}={value} conflicts with the engine options' {name}="
          f"{given[name]} (give one, or the same)"
        )
    if engine_options.get("mesh") is not None or given != dict.fromkeys(PARALLEL_FIELDS, 1):
      return
    sizes = dict.fromkeys(PARALLEL_FIELDS, 1)  # one device, as the options say
    for name in PARALLEL_FIELDS:
      engine_options.pop(name, None)
  devices = list(mesh.devices.flat) if mesh is not None and not mesh.empty else [device]
  t, d = sizes["tensor_parallel_size"], sizes["data_parallel_size"]
  n = len(devices)
  if t == -1 and d == -1:
    t, d = n, 1
  elif t == -1:
    t = max(n // d, 1)
  elif d == -1:
    d = max(n // t, 1)
  if t * d > n:
    raise ValueError(
      f"RolloutConfig.tensor_parallel_size={t} x data_parallel_size={d} needs {t * d} devices, "
      f"the rollout mesh has {n}"
    )
  if t * d == 1:
    devices = [device]
  engine_options["mesh"] = make_mesh(t, d, devices)


def rollout_memory_fraction(
  engine_options: dict[str, Any], config: base_rollout.RolloutConfig
) -> tuple[float, str]:
  """The engine's memory fraction and where it came from: the `gpu_memory_utilization` engine
  option, else `RolloutConfig.rollout_vllm_hbm_utilization` (Tunix's rollout memory fraction).

  Raises:
    ValueError: a fraction outside (0, 1], naming its source and value.
  """
  if engine_options.get("gpu_memory_utilization") is not None:
    value, source = engine_options["gpu_memory_utilization"], "gpu_memory_utilization"
  else:
    value = getattr(config, "rollout_vllm_hbm_utilization", 0.9)
    source = "RolloutConfig.rollout_vllm_hbm_utilization"
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
    raise ValueError(f"{source} must be a float in (0, 1], got {value!r}")
  return float(value), source


def process_memory_fraction(fraction: float, devices: Sequence[jax.Device]) -> float:
  """The engine's `gpu_memory_utilization` (a fraction of each device's memory for everything
  the process holds) that leaves the engine `fraction` of the memory for itself.

  Called before the engine places anything: what the devices hold then (a colocated trainer's
  parameters and optimizer state) is added on top of `fraction`, so the engine's weights and
  KV cache together take at most ``fraction * bytes_limit`` (vLLM's meaning: this engine's
  share), whatever the trainer holds. Devices without memory statistics (CPU): `fraction`
  itself (unused there).

  Args:
    fraction: the engine's share of each device's memory, in (0, 1].
    devices: the engine's devices.

  Returns:
    ``min(1, fraction + max over devices of bytes_in_use / bytes_limit)``.
  """
  shares = []
  for device in devices:
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
      return fraction
    shares.append(int(stats.get("bytes_in_use", 0)) / int(stats["bytes_limit"]))
  return min(1.0, fraction + max(shares, default=0.0))


def engine_device(mesh: jax.sharding.Mesh | None, embedding: Any) -> jax.Device:
  """The device the engine's weights live on: the rollout mesh's first, else the actor's."""
  if mesh is not None and not mesh.empty:
    return mesh.devices.flat[0]
  devices = getattr(embedding, "devices", None)
  return min(devices(), key=lambda d: d.id) if devices else jax.devices()[0]
