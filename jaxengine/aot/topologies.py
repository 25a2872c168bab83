"""The Cloud TPU topologies `jaxengine compile` targets: each name's libtpu arguments and the
numbers of its chip that the memory plan and the decode estimates read.

libtpu describes a topology without a TPU (`jax.experimental.topologies.get_topology_desc`):
its devices carry the chip's kind and compile for it, but report no memory statistics, so each
chip's HBM capacity, bandwidth and peak bfloat16 rate come from the table here (Google's
published figures per chip).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import Any

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation's chip.

  Attributes:
    name: the generation as topology names spell it (``"v6e"``).
    device_kind: `jax.Device.device_kind` of its devices (``"TPU v6 lite"``).
    hbm_bytes: HBM per chip (one JAX device), bytes.
    hbm_bandwidth: HBM bandwidth per chip, bytes per second.
    peak_flops: peak bfloat16 multiply-adds x 2 per second per chip.
  """

  name: str
  device_kind: str
  hbm_bytes: int
  hbm_bandwidth: float
  peak_flops: float


CHIPS = {
  "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 819e9, 197e12),
  "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 1640e9, 918e12),
  "v5p": Chip("v5p", "TPU v5", 95 * GIB, 2765e9, 459e12),
  "v4": Chip("v4", "TPU v4", 32 * GIB, 1228e9, 275e12),
}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A named slice: ``"v6e:2x2"`` is four v6e chips on one host.

  Attributes:
    name: the name (`TOPOLOGIES`' key).
    chip: its chips' `Chip`.
    chips_per_host_bounds: libtpu's host bounds (the whole slice on one host here).
    chip_config_name: libtpu's chip configuration (``"megacore"``: one device per v4 chip).
  """

  name: str
  chip: Chip
  chips_per_host_bounds: tuple[int, int, int]
  chip_config_name: str = "default"

  @property
  def num_chips(self) -> int:
    x, y, z = self.chips_per_host_bounds
    return x * y * z


def _topology(name: str, bounds: tuple[int, int, int], chip_config: str = "default") -> Topology:
  return Topology(name, CHIPS[name.split(":")[0]], bounds, chip_config)


#: The topologies `jaxengine compile --topology` knows, by name.
TOPOLOGIES: dict[str, Topology] = {
  t.name: t
  for t in (
    _topology("v5e:1x1", (1, 1, 1)),
    _topology("v5e:2x2", (2, 2, 1)),
    _topology("v5e:2x4", (2, 4, 1)),
    _topology("v6e:1x1", (1, 1, 1)),
    _topology("v6e:2x2", (2, 2, 1)),
    _topology("v6e:2x4", (2, 4, 1)),
    _topology("v5p:2x2x1", (2, 2, 1)),
    _topology("v4:2x2x1", (2, 2, 1), "megacore"),
  )
}


def topology(name: Any) -> Topology:
  """The topology named `name`.

  Raises:
    ValueError: an unknown name, naming the known ones.
  """
  found = TOPOLOGIES.get(name) if isinstance(name, str) else None
  if found is None:
    raise ValueError(f"unknown topology {name!r}; known topologies: {', '.join(TOPOLOGIES)}")
  return found


@functools.cache
def topology_devices(name: str) -> tuple[Any, ...]:
  """The devices of topology `name`, as libtpu describes them without a TPU (they compile for
  that chip; they hold no arrays).

  Raises:
    ValueError: an unknown name (`topology`).
    ImportError: libtpu is not installed (``pip install "jaxengine[tpu]"``).
  """
  spec = topology(name)
  if importlib.util.find_spec("libtpu") is None:
    raise ImportError(f'compiling for {name} needs libtpu: pip install "jaxengine[tpu]"')
  # libtpu locks itself to one process unless told otherwise; compiling needs no TPU to own.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  desc = topologies.get_topology_desc(
    platform="tpu",
    topology_name=spec.name,
    chip_config_name=spec.chip_config_name,
    chips_per_host_bounds=spec.chips_per_host_bounds,
    num_slices=1,
  )
  return tuple(desc.devices)
