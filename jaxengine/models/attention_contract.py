"""The contract every paged attention backend keeps (`AttentionBackend`), and what they share.

A backend owns one layer's page layout (`page_arrays`: the arrays and their storage dtypes,
`KVPages` in use), the write of a step's new keys and values `[T, K, D]` at
`PagedAttentionMetadata.slot_mapping` (`write_kv`) and the ragged step's causal grouped-query
attention `[T, H, D]` over them (`attention`); the base class derives zero-filled pages, bytes
per page and pages per memory budget from the layout, and the host-side refusals (platform,
sliding window, soft cap, cache dtype). The backends themselves live in `attention_xla`,
`attention_pallas_tpu` and `attention_pallas_gpu`; `attention_backends` chooses one.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.paged_attention import PagedAttentionMetadata

#: One layer's pages (or `L` layers' with a leading axis), in the backend's layout.
KVPages = tuple[jax.Array, ...]


def check_kv_scale(name: str, value: Any) -> float:
  """`value` as a float, for a per-tensor fp8 scale field `name` (`k_scale`, `v_scale`).

  Raises:
    ValueError: `value` is not a finite number > 0 (naming the field and value).
  """
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not number or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
  return float(value)


class AttentionBackend(abc.ABC):
  """Paged attention on one kind of device: page layout, write, ragged attention."""

  name: str
  #: The axis of every page array (of one layer) that holds the key/value heads.
  kv_head_axis: int
  #: Whether `attention` takes a `sliding_window`.
  supports_sliding_window: bool = True
  #: Whether `attention` takes a `soft_cap`.
  supports_soft_cap: bool = True
  #: The `jax.default_backend()` platforms the backend runs on (None: any).
  platforms: tuple[str, ...] | None = None

  def describe(self, spec: KVCacheSpec, num_heads: int) -> str:
    """What the device runs for a model's cache `spec` (`spec.dtype` the cache dtype,
    `FP8_KV_DTYPE` for fp8 pages) and its `num_heads` query heads, in words: the kernel, the
    padding it needs, or the fallback and why (a compile report's `attention_backend`)."""
    del spec, num_heads  # the same for every model unless a backend says otherwise
    return f"{self.name} paged attention"

  def check_platform(self, platform: str) -> None:
    """Refuses a platform the backend's kernel cannot run on (host side, before any device
    work; a Pallas kernel would otherwise fail at the first step, deep inside JAX).

    Raises:
      ValueError: naming the backend, the platform and what to use instead.
    """
    if self.platforms is not None and platform not in self.platforms:
      raise ValueError(
        f"attention_backend={self.name!r} runs on {' / '.join(self.platforms)}, not on "
        f"{platform!r}: use attention_backend='xla' or None (the platform's default)"
      )

  def check_sliding_window(self, sliding_window: int | None) -> None:
    """Refuses a model's sliding window this backend cannot apply (host side, before any
    device work).

    Raises:
      ValueError: `sliding_window` is set and the backend has no sliding window (naming both).
    """
    if sliding_window is not None and not self.supports_sliding_window:
      raise ValueError(
        f"attention_backend={self.name!r} has no sliding-window attention, got "
        f"sliding_window={sliding_window}: use attention_backend='xla' (or 'pallas_tpu' on TPU)"
      )

  def check_soft_cap(self, soft_cap: float | None) -> None:
    """Refuses a model's attention logit soft cap this backend cannot apply (host side, before
    any device work).

    Raises:
      ValueError: `soft_cap` is set and the backend has no soft cap (naming both).
    """
    if soft_cap is not None and not self.supports_soft_cap:
      raise ValueError(
        f"attention_backend={self.name!r} has no attention logit soft-capping, got "
        f"soft_cap={soft_cap}: use attention_backend='xla' (or 'pallas_tpu' on TPU)"
      )

  def check_kv_cache_dtype(self, dtype: Any, devices: Sequence[Any]) -> None:
    """Refuses a cache dtype the backend's kernel cannot read on `devices` (host side, before
    any device work); every backend reads every dtype unless it says otherwise.

    Raises:
      ValueError: naming `kv_cache_dtype`, the backend and what prevents it.
    """
    del dtype, devices  # no limit here

  @abc.abstractmethod
  def page_arrays(
    self,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes and storage dtypes of one layer's page arrays (`N = num_blocks`,
    `B = block_size`) for the cache dtype `dtype` (`FP8_KV_DTYPE` for fp8 pages, which each
    backend stores in its own way)."""

  def page_shapes(
    self,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's page arrays (`page_arrays`)."""
    arrays = self.page_arrays(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return tuple(a.shape for a in arrays)

  def init_pages(
    self,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
    num_layers: int | None = None,
  ) -> KVPages:
    """Zero-filled pages, each array its own buffer (so all can be donated).

    Args:
      num_blocks: pages `N`, the null page 0 included.
      block_size: positions per page `B`.
      num_kv_heads: key/value heads `K`.
      head_dim: head width `D`.
      dtype: the cache dtype (`page_arrays` gives each array's storage dtype).
      num_layers: a leading layer axis `L`, or None for one layer.
    """
    lead = () if num_layers is None else (num_layers,)
    arrays = self.page_arrays(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return tuple(jnp.zeros((*lead, *a.shape), a.dtype) for a in arrays)

  def bytes_per_block(
    self,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> int:
    """Bytes of one page of all `L` layers in this backend's layout: `L * sum(page array size *
    its itemsize)` (keys and values, padded heads and fp8 scales included)."""
    arrays = self.page_arrays(1, block_size, num_kv_heads, head_dim, dtype)
    return num_layers * sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)

  def num_blocks_for_memory(
    self,
    kv_cache_memory_bytes: int,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> int:
    """Pages (the null page included) of all `L` layers that fit in `kv_cache_memory_bytes`.

    A page costs `bytes_per_block` bytes in this backend's layout (keys and values, padded
    heads and fp8 scales included).

    Raises:
      ValueError: the memory holds fewer than 2 pages (the null page and one usable), naming
        the bytes per page.
    """
    per_block = self.bytes_per_block(
      num_layers=num_layers,
      block_size=block_size,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      dtype=dtype,
    )
    num_blocks = int(kv_cache_memory_bytes) // per_block
    if num_blocks < 2:
      raise ValueError(
        f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds {num_blocks} KV cache blocks of "
        f"{per_block} bytes ({block_size} tokens x {num_layers} layers); at least 2 are needed"
      )
    return num_blocks

  @abc.abstractmethod
  def write_kv(
    self,
    pages: KVPages,
    key: jax.Array,
    value: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int | None = None,
  ) -> KVPages:
    """Writes `[T, K, D]` new keys and values at `[T] int32` slots (of layer `layer` when the
    pages have a leading layer axis)."""

  @abc.abstractmethod
  def attention(
    self,
    q: jax.Array,
    pages: KVPages,
    md: PagedAttentionMetadata,
    *,
    scale: float,
    num_kv_heads: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
  ) -> jax.Array:
    """`[T, H, D]` causal grouped-query attention of one layer's `[T, H, D]` queries; rows of
    padding tokens are 0.

    `num_kv_heads` is the model's `K` (static), needed where the layout pads heads (TPU);
    None: the pages' own head count. `sliding_window` `W` (static): a query at position `p`
    sees only `p - W < s <= p`; None: all `s <= p`. `soft_cap` `c` (static): scaled scores `s`
    become `c * tanh(s / c)` before masking; None: no cap. Raises `ValueError` (at trace time)
    for a window where `supports_sliding_window` is False, or a cap where `supports_soft_cap`
    is."""


def set_kv_scales(backend: AttentionBackend) -> None:
  """Checks a frozen backend's `k_scale` and `v_scale` (`check_kv_scale`), then stores them as
  floats (the TPU kernel takes only floats)."""
  scales = {name: check_kv_scale(name, getattr(backend, name)) for name in ("k_scale", "v_scale")}
  for name, value in scales.items():
    object.__setattr__(backend, name, value)
