"""The runner's pool of KV-cache pages: its attention backend, its size and its arrays.

`choose_backend` picks the backend for `EngineConfig.attention_backend` and checks it against the
model's `KVCacheSpec` on the host; `create_kv_cache` sizes the pool (`num_kv_blocks`,
`kv_cache_memory_bytes`, or the default of `worker/kv_cache_size.py`) and makes the zero pages, on
a mesh placed as `worker/placement.py` says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import jax

from jaxengine.core.kv_cache_groups import KVCacheGroups, kv_cache_groups, max_group_blocks
from jaxengine.engine_config import EngineConfig
from jaxengine.models.attention_backends import (
  AttentionBackend,
  XlaAttentionBackend,
  attention_backend,
)
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.paged_attention import FP8_KV_DTYPE
from jaxengine.models.sharded_attention import shard_backend
from jaxengine.worker.kv_cache_size import (
  bytes_per_block,
  check_kv_cache_fits,
  default_num_kv_blocks,
)
from jaxengine.worker.placement import MeshPlacement


def cache_groups(spec: KVCacheSpec, config: EngineConfig) -> KVCacheGroups:
  """The model's KV cache groups (`core/kv_cache_groups.py`): one without sliding windows or
  with `disable_hybrid_kv_cache_manager`."""
  return kv_cache_groups(
    spec.num_layers,
    spec.sliding_window,
    spec.sliding_window_layers,
    enabled=not config.disable_hybrid_kv_cache_manager,
  )


def pool_layout(
  spec: KVCacheSpec, config: EngineConfig, groups: KVCacheGroups, max_model_len: int
) -> tuple[KVCacheSpec, tuple[tuple[int, int], ...] | None, int]:
  """The pool's page layout: the `KVCacheSpec` of one page (`group_size` layers, the cache's
  dtype), the layer groups (None for one group), and the pages one request may hold: every full
  group's and a window group's bounded share (what the default pool's size counts)."""
  block_size, max_blocks = config.block_size, config.max_num_blocks_per_req
  num_blocks_per_req = sum(
    min(
      max_blocks,
      max_group_blocks(window, max_model_len, block_size, config.max_num_batched_tokens),
    )
    for window in groups.group_windows
  )
  spec = dataclasses.replace(spec, num_layers=groups.group_size)
  layer_groups = groups.layer_groups if groups.num_groups > 1 else None
  if config.kv_cache_dtype == "fp8":
    spec = dataclasses.replace(spec, dtype=FP8_KV_DTYPE)  # each backend stores it its own way
  return spec, layer_groups, num_blocks_per_req


def create_kv_cache(
  spec: KVCacheSpec,
  config: EngineConfig,
  groups: KVCacheGroups,
  placement: MeshPlacement | None,
  max_model_len: int,
) -> tuple[PagedKVCache, int]:
  """The pool of pages and its `num_blocks` (the null page 0 included); on a mesh split over
  key/value heads when the model axis divides them (`jaxengine.models.sharded_attention`), else
  replicated, and sized per device.

  Args:
    spec: the model's `kv_cache_spec`.
    config: the engine's config (`mesh`, `block_size`, `max_num_reqs`,
      `max_num_batched_tokens`, `kv_cache_dtype`, `num_kv_blocks`, `kv_cache_memory_bytes`,
      `gpu_memory_utilization`, `attention_backend`, `batch_invariant`).
    groups: the KV cache groups (`core/kv_cache_groups.py`); a page holds `group_size` layers.
    placement: the runner's shardings on `config.mesh`, None off a mesh.
    max_model_len: the engine's resolved `max_model_len`.

  Raises:
    ValueError: the model's `sliding_window`, `soft_cap` or the cache dtype with a backend
      that has none (host side, `choose_backend`); a size that does not fit the devices.
  """
  block_size = config.block_size
  spec, layer_groups, num_blocks_per_req = pool_layout(spec, config, groups, max_model_len)
  # This process's devices: another process's cannot report their memory (multi-host meshes).
  mesh = config.mesh
  devices = (
    [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if mesh is not None
    else jax.local_devices()[:1]
  )
  backend = choose_backend(config, spec, mesh, devices)
  num_blocks = config.num_kv_blocks
  if num_blocks is None and config.kv_cache_memory_bytes is None:
    num_blocks = default_num_kv_blocks(
      spec,
      backend,
      max_num_reqs=config.max_num_reqs,
      max_num_blocks_per_req=num_blocks_per_req,
      block_size=block_size,
      devices=devices,
      gpu_memory_utilization=config.gpu_memory_utilization,
    )
  elif num_blocks is None:
    memory = cast(int, config.kv_cache_memory_bytes)  # the branch above took None
    check_kv_cache_fits(memory, devices, asked=f"kv_cache_memory_bytes={memory}")
    num_blocks = backend.num_blocks_for_memory(
      memory,
      num_layers=spec.num_layers,
      block_size=block_size,
      num_kv_heads=spec.num_kv_heads,
      head_dim=spec.head_dim,
      dtype=spec.dtype,
    )
  else:
    per_block = bytes_per_block(spec, backend, block_size)
    check_kv_cache_fits(num_blocks * per_block, devices, asked=f"num_kv_blocks={num_blocks}")
  num_blocks = int(num_blocks)
  if placement is not None:
    pages = placement.create_kv_pages(spec, backend, num_blocks, block_size, layer_groups)
  else:
    pages = PagedKVCache.create(spec, backend, num_blocks, block_size, layer_groups)
  return pages, num_blocks


def choose_backend(
  config: EngineConfig,
  spec: KVCacheSpec,
  mesh: jax.sharding.Mesh | None,
  devices: Sequence[Any],
  platform: str | None = None,
) -> AttentionBackend:
  """The paged cache's attention backend for `config.attention_backend`, checked against the
  `KVCacheSpec` and the devices (host side). With ``attention_backend=None`` the platform's
  default gives way to XLA where it cannot serve the spec (a Gemma or Mistral model on GPU, whose
  Pallas decode kernel has no window or cap; fp8 pages on a GPU without Triton's fp8).

  `platform` (default `jax.default_backend()`) is the one the steps compile for: ``"tpu"`` for
  an ahead-of-time compile from another machine (`jaxengine.aot`).

  Raises:
    ValueError: the model's `sliding_window`, `soft_cap` or the cache dtype with an explicit
      backend that has none, or a backend that does not run on the platform.
  """
  platform = jax.default_backend() if platform is None else platform
  chosen = attention_backend(config.attention_backend, platform=platform)
  if config.attention_backend is None and not _serves(chosen, spec, devices):
    chosen = XlaAttentionBackend()
  if config.batch_invariant:  # the config allows only "xla" (or None on CPU) with it
    chosen = XlaAttentionBackend(fixed_order=True)
  backend = shard_backend(chosen, mesh, spec.num_kv_heads)
  backend.check_sliding_window(spec.sliding_window)
  backend.check_soft_cap(spec.soft_cap)
  backend.check_kv_cache_dtype(spec.dtype, devices)
  backend.check_platform(platform)
  return backend


def _serves(backend: AttentionBackend, spec: KVCacheSpec, devices: Sequence[Any]) -> bool:
  """Whether `backend` has the sliding window, soft cap and cache dtype the `KVCacheSpec` asks
  for on `devices`."""
  try:
    backend.check_kv_cache_dtype(spec.dtype, devices)
  except ValueError:
    return False
  return (spec.sliding_window is None or backend.supports_sliding_window) and (
    spec.soft_cap is None or backend.supports_soft_cap
  )
