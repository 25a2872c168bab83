"""The topologies `jaxengine compile` targets: Cloud TPU slices (each name's libtpu arguments)
and NVIDIA GPUs (``"h100"``, ``"h100:4"``: `CUDA_TARGETS`), and the numbers of their chips that
the memory plan and the decode estimates read.

libtpu describes a topology without a TPU (`jax.experimental.topologies.get_topology_desc`), and
the CUDA plugin one without a GPU (`cuda_topology`, from a `CudaTarget`'s
description): their devices carry the chip's kind and compile for it, but report no memory
statistics, so each chip's memory, bandwidth and peak bfloat16 rate come from the tables here
(the vendors' published figures per chip). A GPU is a `Chip` too (`CudaTarget`), so the plan and
the report read one interface. This module imports no JAX (the CLI checks names with it).
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
  """One accelerator chip (a TPU generation's; a GPU's is a `CudaTarget`).

  Attributes:
    name: the chip as topology names spell it (``"v6e"``, ``"h100"``).
    device_kind: `jax.Device.device_kind` of its devices (``"TPU v6 lite"``).
    hbm_bytes: HBM per chip (one JAX device), bytes.
    hbm_bandwidth: HBM bandwidth per chip, bytes per second.
    peak_flops: peak dense bfloat16 multiply-adds x 2 per second per chip.
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
class CudaTarget(Chip):
  """A GPU as XLA:GPU needs it to compile without one (published specifications), beyond the
  `Chip` fields (``device_kind`` as `nvidia-smi` names it, ``hbm_bytes`` as it reports it).

  Attributes:
    compute_capability: CUDA compute capability ``(major, minor)``.
    sm_count: streaming multiprocessors.
    l2_cache_bytes: L2 cache.
    clock_ghz: boost clock.
    shared_memory_per_sm: shared memory per multiprocessor, bytes.
    shared_memory_per_block_optin: the most a block may opt in to, bytes.
  """

  compute_capability: tuple[int, int]
  sm_count: int
  l2_cache_bytes: int
  clock_ghz: float
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int

  def target_config(self) -> str:
    """XLA's ``GpuTargetConfigProto`` in text format (the topology's ``target_config``)."""
    major, minor = self.compute_capability
    fields = {
      "threads_per_block_limit": 1024,
      "threads_per_warp": 32,
      "shared_memory_per_block": 48 * 1024,
      "shared_memory_per_core": self.shared_memory_per_sm,
      "threads_per_core_limit": 2048 if major >= 9 or (major, minor) == (8, 0) else 1536,
      "core_count": self.sm_count,
      "fpus_per_core": 128 if major >= 9 or (major, minor) == (8, 9) else 64,
      "block_dim_limit_x": 2**31 - 1,
      "block_dim_limit_y": 65535,
      "block_dim_limit_z": 65535,
      "memory_bandwidth": int(self.hbm_bandwidth),
      "l2_cache_size": self.l2_cache_bytes,
      "clock_rate_ghz": self.clock_ghz,
      "device_memory_size": self.hbm_bytes,
      "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
      "registers_per_core_limit": 65536,
      "registers_per_block_limit": 65536,
    }
    info = "\n".join(f"  {key}: {value}" for key, value in fields.items())
    return (
      f"gpu_device_info {{\n{info}\n"
      f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
      f'platform_name: "CUDA"\n'
      f"dnn_version_info {{ major: 9 minor: 8 }}\n"
      f'device_description_str: "{self.device_kind}"\n'
    )


_MiB, _KiB = 2**20, 2**10

#: The GPUs `cuda_topology` describes, by the name ``--topology`` takes (peak: dense bfloat16
#: of the SXM parts; the L4's as NVIDIA lists it).
CUDA_TARGETS: dict[str, CudaTarget] = {
  "h100": CudaTarget(
    name="h100", device_kind="NVIDIA H100 80GB HBM3", hbm_bytes=81559 * _MiB,
    hbm_bandwidth=3.35e12, peak_flops=989e12, compute_capability=(9, 0), sm_count=132,
    l2_cache_bytes=50 * _MiB, clock_ghz=1.98, shared_memory_per_sm=228 * _KiB,
    shared_memory_per_block_optin=227 * _KiB,
  ),
  "h200": CudaTarget(
    name="h200", device_kind="NVIDIA H200", hbm_bytes=143771 * _MiB, hbm_bandwidth=4.8e12,
    peak_flops=989e12, compute_capability=(9, 0), sm_count=132, l2_cache_bytes=50 * _MiB,
    clock_ghz=1.98, shared_memory_per_sm=228 * _KiB, shared_memory_per_block_optin=227 * _KiB,
  ),
  "a100": CudaTarget(
    name="a100", device_kind="NVIDIA A100-SXM4-80GB", hbm_bytes=81920 * _MiB,
    hbm_bandwidth=2.039e12, peak_flops=312e12, compute_capability=(8, 0), sm_count=108,
    l2_cache_bytes=40 * _MiB, clock_ghz=1.41, shared_memory_per_sm=164 * _KiB,
    shared_memory_per_block_optin=163 * _KiB,
  ),
  "l4": CudaTarget(
    name="l4", device_kind="NVIDIA L4", hbm_bytes=23034 * _MiB, hbm_bandwidth=300e9,
    peak_flops=121e12, compute_capability=(8, 9), sm_count=58, l2_cache_bytes=48 * _MiB,
    clock_ghz=2.04, shared_memory_per_sm=100 * _KiB, shared_memory_per_block_optin=99 * _KiB,
  ),
}  # fmt: skip


def parse_cuda_topology(topology: str) -> tuple[CudaTarget, int]:
  """``"h100"`` (one GPU) or ``"h100:8"`` (eight on one host) as `(CudaTarget, GPUs)`.

  Raises:
    ValueError: an unknown GPU (naming the known ones) or a GPU count that is not a positive
      integer.
  """
  gpu, _, count = topology.partition(":")
  target = CUDA_TARGETS.get(gpu.lower())
  if target is None:
    raise ValueError(f"topology={topology!r}: unknown GPU {gpu!r}, known: {sorted(CUDA_TARGETS)}")
  if count and not (count.isdigit() and int(count) >= 1):
    raise ValueError(f"topology={topology!r}: the GPU count must be a positive integer")
  return target, int(count or 1)


def is_cuda_topology(topology: Any) -> bool:
  """Whether ``topology`` names a GPU of `CUDA_TARGETS` (``"h100"``, ``"h100:8"``), for a
  command line that takes TPU and GPU topologies alike."""
  return isinstance(topology, str) and topology.partition(":")[0].lower() in CUDA_TARGETS


@dataclasses.dataclass(frozen=True)
class Topology:
  """A named slice: ``"v6e:2x2"`` is four v6e chips on one host, ``"h100:4"`` four H100s.

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
  """The topology named `name`: one of `TOPOLOGIES`, or GPUs of `CUDA_TARGETS` (``"h100:4"``,
  on one host: ``chips_per_host_bounds`` ``(1, 1, 4)``).

  Raises:
    ValueError: an unknown name, naming the known ones; a bad GPU count (`parse_cuda_topology`).
  """
  if is_cuda_topology(name):
    target, gpus = parse_cuda_topology(name)
    return Topology(name, target, (1, 1, gpus))
  found = TOPOLOGIES.get(name) if isinstance(name, str) else None
  if found is None:
    raise ValueError(f"unknown topology {name!r}; known topologies: {known_topologies()}")
  return found


def known_topologies() -> str:
  """The names `topology` takes, for a message."""
  gpus = ", ".join(f"{name}[:N]" for name in CUDA_TARGETS)
  return f"{', '.join(TOPOLOGIES)}, {gpus}"


def larger_topology(chip: Chip, num_chips: int) -> str | None:
  """The first topology of `chip`'s chips with at least `num_chips` (a GPU's: ``"h100:4"``, up
  to 8 on one host), None if none."""
  if isinstance(chip, CudaTarget):
    return f"{chip.name}:{num_chips}" if num_chips <= 8 else None
  larger = [s.name for s in TOPOLOGIES.values() if s.chip == chip and s.num_chips >= num_chips]
  return larger[0] if larger else None


@functools.cache
def topology_devices(name: str) -> tuple[Any, ...]:
  """The devices of topology `name`, as libtpu (or for a GPU, the CUDA plugin:
  `cuda_topology`) describes them without the chip (they compile for that
  chip; they hold no arrays).

  Raises:
    ValueError: an unknown name (`topology`).
    ImportError: libtpu is not installed (``pip install "jaxengine[tpu]"``).
    RuntimeError: the CUDA plugin is not installed (naming the wheels).
  """
  spec = topology(name)
  if isinstance(spec.chip, CudaTarget):
    return tuple(cuda_topology(name).devices)
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


def cuda_topology(topology: str) -> Any:
  """Compile-only CUDA devices for a named GPU (`parse_cuda_topology`), without a GPU.

  Args:
    topology: ``"h100"``, ``"h100:8"`` (GPUs on one host), ... (`CUDA_TARGETS`).

  Returns:
    A `jax.experimental.topologies.TopologyDescription`: its ``devices`` (platform "gpu",
    ``device_kind`` the GPU's name, ``compute_capability`` "9.0") take `jax.ShapeDtypeStruct`
    shardings, and ``jax.jit(f).lower(...).compile()`` on them compiles for that GPU.

  Raises:
    ValueError: as `parse_cuda_topology`.
    RuntimeError: the CUDA plugin is not installed (naming the wheels to install).
  """
  import jax
  from jax.experimental import topologies

  target, gpus = parse_cuda_topology(topology)
  try:
    return topologies.get_topology_desc(
      topology, platform="cuda", target_config=target.target_config(), topology=f"1x1x{gpus}"
    )
  except NotImplementedError as error:
    raise RuntimeError(
      f"topology={topology!r} needs the CUDA PJRT plugin and ptxas: pip install "
      f"jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__} "
      "nvidia-cuda-nvcc-cu12 (no GPU or driver needed)"
    ) from error
