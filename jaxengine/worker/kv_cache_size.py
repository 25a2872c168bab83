"""How many pages the paged KV cache gets when the user names no size.

`num_kv_blocks` gives the pool's size in pages and `kv_cache_memory_bytes` in bytes; without
either, `default_num_kv_blocks` sizes it from a memory budget, as vLLM does, never above what the
engine can use at once:

- the budget: on an accelerator, `gpu_memory_utilization` of the memory JAX's allocator may hold
  (`Device.memory_stats()["bytes_limit"]`) less what is in use once the weights are placed
  (`bytes_in_use`), the smallest over the engine's devices (vLLM's `gpu_memory_utilization`
  likewise bounds weights and cache together); on CPU, whose devices report no memory
  statistics, `DEFAULT_CPU_KV_CACHE_BYTES`, or one request of `max_model_len` tokens where that
  needs more (so a long-context model starts by default; refused beyond the machine's physical
  memory);
- at most enough pages for `max_num_reqs` requests of `max_model_len` tokens each, plus a quarter
  more for the prefix cache to keep finished prompts' pages (and the null page): more pages would
  only ever serve cached prefixes, so the default does not seize a device that JAX training code
  shares with the engine;
- at least one request of `max_model_len` tokens (and the null page): a budget that holds less
  is refused when the engine is built (vLLM's rule), naming `max_model_len` and what fits.

So the pool grows with `max_num_reqs` and `max_model_len` only up to the budget: a 32k-token
model on CPU gets the same 1 GiB as a 1k-token one, and its requests share it (the scheduler
admits requests while pages last and preempts when they run out). Give `kv_cache_memory_bytes`
for more.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

from jaxengine.models.attention_backends import AttentionBackend
from jaxengine.models.kv_cache import KVCacheSpec

#: The default paged cache's memory limit on devices without memory statistics (CPU): 1 GiB,
#: about 23,000 tokens of SmolLM2-135M in float32.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30

#: Pages beyond `max_num_reqs` full-length requests the default keeps for cached prefixes, as a
#: fraction of theirs.
PREFIX_CACHE_SHARE = 0.25


def memory_limit(devices: Sequence[jax.Device], gpu_memory_utilization: float) -> int:
  """Bytes per device the default paged cache may take (see the module).

  Args:
    devices: the engine's devices (the mesh's, or the default device).
    gpu_memory_utilization: the fraction of each device's `bytes_limit` the engine may hold.

  Returns:
    `min over devices of gpu_memory_utilization * bytes_limit - bytes_in_use`, or
    `DEFAULT_CPU_KV_CACHE_BYTES` when a device reports no memory statistics; may be <= 0.
  """
  limits = []
  for device in devices:
    usage = _memory_usage(device)
    if usage is None:
      return DEFAULT_CPU_KV_CACHE_BYTES
    limit, in_use = usage
    limits.append(int(gpu_memory_utilization * limit) - in_use)
  return min(limits)


def check_kv_cache_fits(
  bytes_per_device: int, devices: Sequence[jax.Device], *, asked: str
) -> None:
  """Refuses a requested cache size the devices could not hold, before anything is allocated.

  The bound is each device's free memory as JAX's allocator reports it (`bytes_limit` less
  `bytes_in_use`) on accelerators; on CPU, whose devices report no statistics and share the
  machine's memory, the pools of all the CPU devices together against the machine's physical
  memory (a larger CPU cache would be killed by the operating system, not refused).

  Args:
    bytes_per_device: the pool's bytes on each device.
    devices: the devices holding the pool (a mesh's, or one device).
    asked: what the user gave, for the message (``"kv_cache_memory_bytes=..."``,
      ``"num_kv_blocks=..."``).

  Raises:
    ValueError: naming `asked`, the bytes and the bound.
  """
  cpu_devices = 0
  for device in devices:
    usage = _memory_usage(device)
    if usage is None:
      cpu_devices += 1
    elif bytes_per_device > usage[0] - usage[1]:
      raise ValueError(
        f"{asked} ({bytes_per_device} bytes per device) exceeds free on {device} "
        f"({usage[0] - usage[1]} bytes)"
      )
  physical = _physical_memory() if cpu_devices else None
  if physical is not None and cpu_devices * bytes_per_device > physical:
    raise ValueError(
      f"{asked} ({bytes_per_device} bytes per device x {cpu_devices} CPU devices) exceeds the "
      f"machine's physical memory ({physical} bytes)"
    )


def _memory_usage(device: jax.Device) -> tuple[int, int] | None:
  """``(bytes_limit, bytes_in_use)`` of JAX's allocator on `device`, or None where the device
  reports no memory statistics (CPU)."""
  stats = device.memory_stats()
  if not stats or "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def _physical_memory() -> int | None:
  """Bytes of physical memory (None where the OS does not say)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (AttributeError, ValueError, OSError):
    return None


def default_num_kv_blocks(
  spec: KVCacheSpec,
  backend: AttentionBackend,
  *,
  max_num_reqs: int,
  max_num_blocks_per_req: int,
  block_size: int,
  devices: Sequence[jax.Device],
  gpu_memory_utilization: float,
) -> int:
  """Pages (the null page included) of the paged cache when neither `num_kv_blocks` nor
  `kv_cache_memory_bytes` is given: the memory budget's pages, at most room for `max_num_reqs`
  full-length requests and `PREFIX_CACHE_SHARE` more, at least one full-length request (see the
  module).

  Raises:
    ValueError: the budget holds fewer pages than one request of `max_num_blocks_per_req` pages
      and the null page (naming the bytes, `max_model_len`'s pages and, on an accelerator,
      `gpu_memory_utilization`); on CPU, one such request needs more than the machine's physical
      memory.
  """
  wanted = 1 + max_num_reqs * max_num_blocks_per_req * (1 + PREFIX_CACHE_SHARE)
  needed = 1 + max_num_blocks_per_req  # one request of max_model_len tokens and the null page
  per_block = bytes_per_block(spec, backend, block_size)
  limit = memory_limit(devices, gpu_memory_utilization)
  on_cpu = any(_memory_usage(device) is None for device in devices)
  if on_cpu and limit < needed * per_block:  # the CPU default grows to one full request
    limit = needed * per_block
    physical = _physical_memory()
    if physical is not None and limit > physical:
      raise ValueError(
        f"one request of max_model_len tokens ({max_num_blocks_per_req} KV cache blocks of "
        f"{per_block} bytes) needs {limit} bytes, more than the machine's physical memory "
        f"({physical} bytes); give a smaller max_model_len"
      )
  fits = max(limit, 0) // per_block
  if fits < needed:
    where = (
      ""
      if on_cpu
      else f" (gpu_memory_utilization={gpu_memory_utilization} of the device memory, less what is "
      "in use)"
    )
    raise ValueError(
      f"the default paged KV cache has {limit} bytes per device{where}: {fits} KV cache blocks of "
      f"{per_block} bytes ({block_size} tokens x {spec.num_layers} layers), fewer than one "
      f"request of max_model_len tokens needs ({max_num_blocks_per_req} blocks and the null "
      "block); give a smaller max_model_len, raise gpu_memory_utilization or give "
      "kv_cache_memory_bytes / num_kv_blocks"
    )
  return min(int(wanted), fits)


def bytes_per_block(spec: KVCacheSpec, backend: AttentionBackend, block_size: int) -> int:
  """Bytes of one page of all layers per device in `backend`'s layout (a sharded backend's
  share)."""
  return backend.bytes_per_block(
    num_layers=spec.num_layers,
    block_size=block_size,
    num_kv_heads=spec.num_kv_heads,
    head_dim=spec.head_dim,
    dtype=spec.dtype,
  )
