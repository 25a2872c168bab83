"""Running a model's decoder layers in order, each distinct layer traced once.

A decoder applies `L` layers of the same structure. Called one after another in Python, each
layer is traced and lowered anew: `L` times the same work for every step function the engine
builds (SmolLM2-135M's 30 layers: about 1.3 s of tracing per step shape on CPU, more than
loading that step's executable from the persistent compilation cache). `apply_layers` calls each
layer through one module-level `jax.jit` of `(graph definition, weights, inputs)` on a one-layer
view of the paged cache (`PagedKVCache.layer_view`), so layers of equal structure share one
trace and one lowered function; XLA inlines the calls, so the compiled step and its arithmetic
are those of the unrolled loop, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.paged_attention import PagedAttentionMetadata


@functools.partial(jax.jit, static_argnums=0)
def _layer_call(graphdef, weights, x, positions, kv_cache, metadata, *extra):
  """One layer as a pure function: `nnx.merge(graphdef, weights)(x, ..., layer 0, ...)`."""
  return nnx.merge(graphdef, weights)(x, positions, kv_cache, 0, metadata, *extra)


def apply_layers(
  layers: Sequence[nnx.Module],
  x: jax.Array,
  positions: jax.Array,
  kv_cache: PagedKVCache,
  metadata: PagedAttentionMetadata,
  extra: Callable[[int], tuple[Any, ...]] = lambda index: (),
  outputs: list[Any] | None = None,
  cache_layer: Callable[[int], int] = lambda index: index,
) -> tuple[jax.Array, PagedKVCache]:
  """`x, kv_cache` after every layer, in order: ``x, kv_cache = layer(x, positions, kv_cache,
  index, metadata, *extra(index))``; a layer may return a third value, appended to `outputs`.

  Args:
    layers: the decoder layers (each called as above; a layer must not change its own state).
    x: ``[..., E]`` the residual stream.
    positions: ``[..., T] int32`` the tokens' positions.
    kv_cache: the `PagedKVCache` (each layer runs on its one-layer view).
    metadata: the step's attention metadata, passed to every layer.
    extra: the further arguments of layer `index` (e.g. its LoRA adapters).
    outputs: None, or a list to which each layer's third result (if it returns one: a MoE
      layer's routed experts, `jaxengine.models.llama.DecoderLayer`) is appended, in order.
    cache_layer: the cache layer whose pages layer `index` reads and writes (itself by default;
      Gemma 4's KV-shared layers read an earlier layer's, `jaxengine.models.gemma4`).

  Returns:
    ``(x, kv_cache)``: the last layer's output and the cache with every layer's keys and values.
  """
  for index, layer in enumerate(layers):
    view, slot = kv_cache.layer_view(cache_layer(index))
    graphdef, weights = nnx.split(layer)
    x, view, *more = _layer_call(graphdef, weights, x, positions, view, metadata, *extra(index))
    if more and outputs is not None:
      outputs.append(more[0])
    kv_cache = kv_cache.with_slot(slot, view)
  return x, kv_cache
