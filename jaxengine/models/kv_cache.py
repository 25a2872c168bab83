"""The key/value cache: one fixed-size buffer of slots that requests are pointed into.

The cache is addressed by ``(layer, slot, position)``, by `jaxengine.models.attention` alone. A
slot is a row of the cache owned by one request for its lifetime; the batch state stores each
request's slot index, so reordering or condensing batch rows moves a few integers and never the
cached keys and values themselves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
  """What a model stores per cached token: its cache's layout, without the cache.

  Attributes:
    num_layers: decoder layers `L`.
    num_kv_heads: key/value heads `K`.
    head_dim: width `D` of one head.
    dtype: storage dtype of keys and values (normally the model's compute dtype).
    sliding_window: the window ``W`` the model's attention passes to the seam (a query sees the
      last ``W`` positions) on the layers of `sliding_window_layers`, or None: no layer has a
      window. The paged engine refuses a backend without one.
    sliding_window_layers: the layers whose attention has the window (Gemma's local layers),
      or None: every layer, when `sliding_window` is set (Mistral). The paged engine splits the
      layers into KV cache groups by it and frees the window layers' pages that slid out of
      the window (`jaxengine.core.kv_cache_groups`).
    soft_cap: the attention logit soft cap the model passes to the seam (Gemma 2), or None; the
      paged engine refuses a backend without one.
  """

  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: Any = jnp.float32
  sliding_window: int | None = None
  sliding_window_layers: tuple[int, ...] | None = None
  soft_cap: float | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCache:
  """Per-layer keys and values for every slot and position.

  Rotary embeddings are already applied to the cached keys. A position of a slot holds meaningful
  data only once the request owning that slot has written it; the attention seam
  (`jaxengine.models.attention`, the only code that writes and reads it) never lets a query see a
  position beyond its own, so stale data from a previous owner of the slot is harmless.

  Attributes:
    key: ``[L, num_slots, S, K, D]`` keys after rotary
      embedding, in the cache dtype.
    value: ``[L, num_slots, S, K, D]`` values, same dtype.
  """

  key: jax.Array
  value: jax.Array

  @classmethod
  def create(cls, spec: KVCacheSpec, num_slots: int, max_model_len: int) -> KVCache:
    """Allocates a zero-filled cache.

    Args:
      spec: the model's `KVCacheSpec` (layers, key/value heads, head dim, dtype).
      num_slots: number of requests the cache can hold at once (usually ``max_num_reqs``, plus one
        if the caller wants a scratch slot for inactive rows).
      max_model_len: positions per slot (prompt plus generated tokens).

    Returns:
      A ``KVCache`` whose two leaves are separate buffers (so both can be donated).
    """
    shape = (spec.num_layers, num_slots, max_model_len, spec.num_kv_heads, spec.head_dim)
    # Two separate allocations: aliased leaves would break buffer donation.
    return cls(key=jnp.zeros(shape, spec.dtype), value=jnp.zeros(shape, spec.dtype))

  @property
  def num_layers(self) -> int:
    """Decoder layers."""
    return self.key.shape[0]

  @property
  def num_slots(self) -> int:
    """Requests the cache can hold at once."""
    return self.key.shape[1]

  @property
  def max_model_len(self) -> int:
    """Positions per slot."""
    return self.key.shape[2]

  @property
  def dtype(self) -> jnp.dtype:
    """Storage dtype."""
    return self.key.dtype
