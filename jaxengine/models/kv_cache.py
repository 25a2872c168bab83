"""What a model stores per cached token: `KVCacheSpec`, the shape of the paged cache's pages.

The cache itself is `jaxengine.models.kv_pages.PagedKVCache` (a pool of pages per layer, laid
out by an attention backend); the spec is what a model declares and the engine sizes the pool
and its KV cache groups by (`jaxengine.worker.kv_cache_pool`, `jaxengine.core.kv_cache_groups`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
    stacked: the cache keeps every layer's pages in one buffer per page array, stacked along
      the page axis (`jaxengine.models.kv_pages.PagedKVCache`), as a model whose layers run
      under `jax.lax.scan` needs (`jaxengine.models.layer_scan`); False: a buffer per layer.
  """

  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: Any = jnp.float32
  sliding_window: int | None = None
  sliding_window_layers: tuple[int, ...] | None = None
  soft_cap: float | None = None
  stacked: bool = False
