"""Gemma 4's layers under `jax.lax.scan`: a stack per kind of layer, a scan per segment.

Gemma 4's layers differ in structure by kind: a global layer's heads may be wider than a local
one's (``global_head_dim``) and take their values from the keys (``attention_k_eq_v``: no
``wv``), and the last ``num_kv_shared_layers`` layers own no key and value projections and may
have a double-wide MLP. So with ``scan_layers`` (`jaxengine.models.gemma4_config.Gemma4Config.
scan_layers`) a `jaxengine.models.gemma4.Gemma4` keeps one stacked module per kind
(`Gemma4Stacks`: ``layers/sliding``, ``layers/full``, ``layers/shared_sliding``,
``layers/shared_full``, each leaf ``[n, ...]`` for the ``n`` layers of that kind in order,
absent kinds None; `Gemma4Config.layer_rows` maps a checkpoint's layer ``i`` to its row).

`scan_gemma4_layers` runs two segments, the layers with keys and values of their own and then
the KV-shared ones, each as one `jax.lax.scan` over its repeating group of local and global
layers (`jaxengine.models.layer_scan.scan_layer_groups`' scheme: iteration ``g`` runs the
group's ``P`` layers, each position its own traced body and its weights row ``g P_k + r`` of its
kind's stack, ``P_k`` layers of that kind a group and ``r`` its rank among them), the layers
after a segment's last whole group unrolled. What a layer takes besides its weights is passed
by its index: its row of the per-layer inputs (``[..., L, P]``, read with a dynamic index),
its pages in the stacked cache (`jaxengine.models.kv_pages.PagedKVCache.layer_metadata`: a
layer with keys and values writes its own, a KV-shared layer reads those of the last earlier
layer of its kind, a constant of its kind), and its kind's head width, rotary embedding and
window (static: the ``kind`` layer of `jaxengine.models.gemma4.Gemma4Attention.__call__`).

Measured (docs/performance.md): a 35-layer Gemma-4-shaped config (four local : one global, the
last 20 KV-shared, per-layer inputs, bfloat16) compiled deviceless for v6e:1x1, one ragged step
of 8 rows and 8 tokens, in 69.4 / 63.5 s unrolled against 19.5 / 15.9 s scanned on a shared
2-core CPU VM.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.gemma4_config import KINDS, Gemma4Config
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.layer_scan import stack_layers, stacked_lora
from jaxengine.models.lora import LayerLoRA, LoRAInputs
from jaxengine.models.paged_attention import PagedAttentionMetadata

__all__ = ["Gemma4Stacks", "scan_gemma4_layers", "stack_gemma4_layers"]


class Gemma4Stacks(nnx.Module):
  """A scanned Gemma 4's decoder layers: one stacked layer module per kind (`KINDS`), every
  leaf ``[n, ...]`` for the kind's ``n`` layers, or None for a kind the model lacks.

  Attributes:
    sliding, full: the local and global layers with keys and values of their own.
    shared_sliding, shared_full: the KV-shared local and global layers.
  """

  def __init__(self, stacks: dict[str, nnx.Module | None]):
    self.sliding = stacks["sliding"]
    self.full = stacks["full"]
    self.shared_sliding = stacks["shared_sliding"]
    self.shared_full = stacks["shared_full"]


def stack_gemma4_layers(layers: Sequence[Any], config: Gemma4Config) -> Gemma4Stacks:
  """The layers of each kind stacked (`jaxengine.models.layer_scan.stack_layers`); each
  layer's own index (which makes two layers of a kind differ in structure) is dropped first, in
  place: the scan names each call's kind."""
  for layer in layers:
    layer.attn.layer = None
  kinds = [config.layer_kind(i) for i in range(len(layers))]
  stacks = {}
  for kind in KINDS:
    of_kind = [layer for layer, k in zip(layers, kinds) if k == kind]
    stacks[kind] = stack_layers(of_kind) if of_kind else None
  return Gemma4Stacks(stacks)


def _period(types: Sequence[str]) -> int:
  """The length of the repeating group of `types` (``len(types)`` when nothing repeats)."""
  n = len(types)
  return next((p for p in range(1, n + 1) if types[p:] == types[: n - p]), 1)


def scan_gemma4_layers(
  stacks: Gemma4Stacks,
  x: jax.Array,
  positions: jax.Array,
  kv_cache: PagedKVCache,
  metadata: PagedAttentionMetadata,
  per_layer: jax.Array | None,
  config: Gemma4Config,
  lora: LoRAInputs | None = None,
) -> tuple[jax.Array, PagedKVCache]:
  """``x, kv_cache`` after every layer of a scanned Gemma 4 (module docstring).

  Layer ``i`` (a `jaxengine.models.gemma4.Gemma4DecoderLayer`, its weights a row of its kind's
  stack) is called as ``layer(x, positions, kv_cache, cache_layer, metadata, per_layer_i,
  lora=lora_i, kind=k)``: ``cache_layer`` its pages' layer (``i``, traced in a scan, or its KV source), ``k``
  the first layer of its kind in the segment (static).

  Args:
    stacks: the stacked layers (`stack_gemma4_layers`).
    x: ``[..., E]`` the residual stream.
    positions: ``[..., T] int32`` the tokens' positions.
    kv_cache: a `PagedKVCache` with stacked pages (`Gemma4Config.kv_cache_spec`).
    metadata: the step's attention metadata.
    per_layer: ``[..., L, P]`` every layer's per-layer input, or None.
    config: the model's config.
    lora: the step's LoRA adapters (``L`` per-layer dicts, each layer's row read in the loop),
      or None.

  Returns:
    ``(x, kv_cache)``: the last layer's output and the cache.

  Raises:
    ValueError: a cache whose pages are not stacked.
  """
  if kv_cache.stacked_layers is None:
    raise ValueError("a scanned Gemma 4 needs stacked pages (its kv_cache_spec's stacked)")
  graphdefs, weights = {}, {}
  for kind in KINDS:
    stack = getattr(stacks, kind)
    if stack is not None:
      graphdefs[kind], weights[kind] = nnx.split(stack)
  pages = kv_cache.pages
  adapters = None if lora is None else (lora, stacked_lora(lora))
  num_cache = config.num_cache_layers
  for start, end in ((0, num_cache), (num_cache, config.num_hidden_layers)):
    if end > start:
      x, pages = _scan_segment(
        graphdefs, weights, x, pages, start, end, positions, kv_cache, metadata, per_layer, config,
        adapters,
      )  # fmt: skip
  return x, dataclasses.replace(kv_cache, pages=pages)


def _scan_segment(
  graphdefs, weights, x, pages, start, end, positions, kv_cache, metadata, per_layer, config,
  adapters,
):  # fmt: skip
  """Layers ``start .. end - 1`` (one kind of sharing) as a scan over their repeating group."""
  period = _period(config.layer_types[start:end])
  groups, rest = divmod(end - start, period)
  kinds = [config.layer_kind(start + j) for j in range(period)]
  rank = [kinds[:j].count(kinds[j]) for j in range(period)]
  per_group = [kinds.count(kind) for kind in kinds]

  def run(x, pages, g, j):
    """Layer ``start + g P + j`` (``g`` traced in the loop, an int after it)."""
    index = start + g * period + j
    row = g * per_group[j] + rank[j]
    layer_weights = jax.tree.map(
      lambda leaf: jax.lax.dynamic_index_in_dim(leaf, row, keepdims=False), weights[kinds[j]]
    )
    layer = nnx.merge(graphdefs[kinds[j]], layer_weights)
    layer_input = None
    if per_layer is not None:
      axis = per_layer.ndim - 2
      layer_input = jax.lax.dynamic_index_in_dim(per_layer, index, axis, keepdims=False)
    view = None
    if adapters is not None:
      lora, stacked = adapters
      row_of = lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)
      own = lora.layers[index] if isinstance(index, int) else jax.tree.map(row_of, stacked)
      view = LayerLoRA(lora.slots, own)
    kind = start + j  # a layer of this kind: its head width, rope and window
    cache_layer = config.kv_source(kind) if config.is_kv_shared(kind) else index
    cache = dataclasses.replace(kv_cache, pages=pages)
    x, cache = layer(x, positions, cache, cache_layer, metadata, layer_input, lora=view, kind=kind)
    return x, cache.pages

  def body(carry, g):
    x, pages = carry
    for j in range(period):
      x, pages = run(x, pages, g, j)
    return (x, pages), None

  (x, pages), _ = jax.lax.scan(body, (x, pages), jnp.arange(groups, dtype=jnp.int32))
  for j in range(rest):  # the layers after the segment's last whole group
    x, pages = run(x, pages, groups, j)
  return x, pages
