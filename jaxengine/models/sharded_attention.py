"""Paged attention on a mesh: any `AttentionBackend` run per device over its own key/value heads.

Tensor parallelism splits a layer's query heads ``H`` and key/value heads ``K`` over the mesh's
model axis (``t`` devices; the projections are column-parallel). `HeadShardedBackend` wraps a
backend so that each device holds, writes and reads only its ``K / t`` heads of every page:

* the pages of a layer are ``t`` copies of the wrapped backend's layout for ``K / t`` heads, laid
  side by side along its head axis (`AttentionBackend.kv_head_axis`) and sharded there, so
  ``[N, B, K, D]`` XLA pages are ``P(None, None, "model", None)``, and the TPU kernel's combined
  ``[N, B, 2K', D]`` pages hold each device's own ``2 * tpu_kv_heads(K / t)`` heads (the GPU
  layout's fp8 scales ``[K, N, B]`` are split along ``K`` too);
* `write_kv` and `attention` run under `jax.shard_map` over the model axis: a device gets its
  ``[T, H / t, D]`` queries and ``[T, K / t, D]`` keys and values, the step's metadata whole
  (block tables, slot mapping, lengths: replicated, small), and calls the wrapped backend as on
  one device. Grouped-query attention keeps query head ``h`` with key/value head ``h // (H / K)``,
  and contiguous shards of both keep the groups together, so no collective is needed.

The Pallas kernels have no partitioning rule for XLA's SPMD partitioner; inside `shard_map` each
device runs the kernel on its own shard, which is also how the XLA path stays free of gathers.

Shape letters as in `jaxengine.models.attention`: ``T`` tokens, ``N`` pages, ``B`` block size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxengine.models.attention_backends import AttentionBackend, KVPages
from jaxengine.models.paged_attention import PagedAttentionMetadata


@dataclasses.dataclass(frozen=True)
class HeadShardedBackend(AttentionBackend):
  """`inner` on each device of `mesh`'s `axis` over its share of the key/value heads.

  Attributes:
    inner: the backend each device runs (`XlaAttentionBackend`, a Pallas backend, ...).
    mesh: the engine's mesh.
    axis: the mesh axis the heads are split over (``"model"``), of size ``t`` dividing ``K``.
  """

  inner: AttentionBackend
  mesh: Mesh
  axis: str = "model"

  @property
  def name(self) -> str:  # type: ignore[override]
    return self.inner.name

  @property
  def kv_head_axis(self) -> int:  # type: ignore[override]
    return self.inner.kv_head_axis

  @property
  def supports_sliding_window(self) -> bool:  # type: ignore[override]
    return self.inner.supports_sliding_window

  @property
  def supports_soft_cap(self) -> bool:  # type: ignore[override]
    return self.inner.supports_soft_cap

  def check_platform(self, platform: str) -> None:
    """The inner backend's check."""
    self.inner.check_platform(platform)

  def check_kv_cache_dtype(self, dtype, devices) -> None:
    """The inner backend's check."""
    self.inner.check_kv_cache_dtype(dtype, devices)

  def describe(self, spec, num_heads):
    """The wrapped backend's description for one device's heads, and over how many devices."""
    local = dataclasses.replace(spec, num_kv_heads=self.local_kv_heads(spec.num_kv_heads))
    inner = self.inner.describe(local, num_heads // self.num_shards)
    return f"{inner}, per device of {self.num_shards} (heads split over {self.axis!r})"

  @property
  def num_shards(self) -> int:
    """``t``: devices along `axis`."""
    return int(self.mesh.shape[self.axis])

  def local_kv_heads(self, num_kv_heads: int) -> int:
    """Key/value heads per device, ``K / t``.

    Raises:
      ValueError: ``t`` does not divide ``K`` (both named).
    """
    if num_kv_heads % self.num_shards:
      raise ValueError(
        f"the {self.axis!r} axis of size {self.num_shards} must divide num_kv_heads="
        f"{num_kv_heads} to shard the pages over key/value heads"
      )
    return num_kv_heads // self.num_shards

  def page_arrays(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32):
    local = self.inner.page_arrays(
      num_blocks, block_size, self.local_kv_heads(num_kv_heads), head_dim, dtype
    )
    axis, t = self.kv_head_axis, self.num_shards
    return tuple(
      jax.ShapeDtypeStruct(tuple(n * t if i == axis else n for i, n in enumerate(a.shape)), a.dtype)
      for a in local
    )

  def page_specs(self, num_arrays: int, layered: bool = False) -> tuple[P, ...]:
    """Partition specs of one layer's `num_arrays` page arrays (with a leading layer axis when
    `layered`): the head axis over `axis`, the rest replicated."""
    axis = self.kv_head_axis + int(layered)
    spec = P(*(self.axis if i == axis else None for i in range(axis + 1)))
    return (spec,) * num_arrays

  def bytes_per_block(self, *, num_kv_heads, **sizes):
    """Bytes of one page on each device (its ``K / t`` heads), as the wrapped backend counts."""
    return self.inner.bytes_per_block(num_kv_heads=self.local_kv_heads(num_kv_heads), **sizes)

  def num_blocks_for_memory(self, kv_cache_memory_bytes, *, num_kv_heads, **sizes):
    """Pages that fit in `kv_cache_memory_bytes` on each device (a device holds ``K / t`` heads
    of every page), as the wrapped backend counts them."""
    return self.inner.num_blocks_for_memory(
      kv_cache_memory_bytes, num_kv_heads=self.local_kv_heads(num_kv_heads), **sizes
    )

  def head_spec(self) -> P:
    """The partition spec of ``[T, heads, D]`` queries, keys and values: heads over `axis`."""
    return P(None, self.axis, None)

  def _shard_map(self, fn, in_specs, out_specs):
    return jax.shard_map(
      fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    specs = self.page_specs(len(pages), layered=layer is not None)
    heads = self.head_spec()  # [T, K, D]
    extra: tuple[Any, ...] = () if layer is None else (layer,)

    def local(pages, key, value, slot_mapping, *layer_index):
      return self.inner.write_kv(pages, key, value, slot_mapping, *layer_index)

    fn = self._shard_map(local, (specs, heads, heads, P(), *(P(),) * len(extra)), specs)
    return fn(tuple(pages), key, value, slot_mapping, *extra)

  def attention(
    self,
    q,
    pages,
    md: PagedAttentionMetadata,
    *,
    scale,
    num_kv_heads=None,
    sliding_window=None,
    soft_cap=None,
  ):
    specs = self.page_specs(len(pages))
    heads = self.head_spec()  # [T, H, D]
    local_heads = None if num_kv_heads is None else self.local_kv_heads(num_kv_heads)

    def local(q, pages: KVPages, md):
      return self.inner.attention(
        q,
        pages,
        md,
        scale=scale,
        num_kv_heads=local_heads,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
      )

    return self._shard_map(local, (heads, specs, P()), heads)(q, tuple(pages), md)


@dataclasses.dataclass(frozen=True)
class ReplicatedOnMeshBackend(HeadShardedBackend):
  """`inner` run whole on every device of `mesh`: the pages replicated (every key/value head on
  each device), queries, keys and values gathered, each device computing the step's attention.

  For a model axis that does not divide the key/value heads, with a backend whose kernel XLA's
  SPMD partitioner cannot place (the Pallas kernels: "Mosaic kernels cannot be automatically
  partitioned"): under `jax.shard_map` with every spec replicated each device calls the kernel
  as on one device, as XLA's own partitioning does with the XLA path's replicated pages.
  """

  def describe(self, spec, num_heads):
    """The wrapped backend's description, and that every device runs all of it."""
    inner = self.inner.describe(spec, num_heads)
    return f"{inner}, replicated on each of {self.num_shards} devices ({self.axis!r} axis)"

  def local_kv_heads(self, num_kv_heads: int) -> int:
    """Every key/value head on each device."""
    return num_kv_heads

  def page_arrays(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32):
    return self.inner.page_arrays(num_blocks, block_size, num_kv_heads, head_dim, dtype)

  def page_specs(self, num_arrays: int, layered: bool = False) -> tuple[P, ...]:
    """Every page array replicated."""
    return (P(),) * num_arrays

  def head_spec(self) -> P:
    """Queries, keys and values whole on each device."""
    return P()


def shard_backend(
  backend: AttentionBackend, mesh: Mesh | None, num_kv_heads: int
) -> AttentionBackend:
  """`backend` for an engine on `mesh`: wrapped in `HeadShardedBackend` when the model axis has
  more than one device and divides `num_kv_heads`; otherwise the pages are replicated over the
  model axis, and a Pallas backend (which XLA cannot partition) runs whole on each device
  (`ReplicatedOnMeshBackend`); as it is on one device."""
  if mesh is None or "model" not in mesh.shape:
    return backend
  t = int(mesh.shape["model"])
  if t == 1:
    return backend
  if num_kv_heads % t:
    return backend if backend.name == "xla" else ReplicatedOnMeshBackend(backend, mesh)
  return HeadShardedBackend(backend, mesh)
