"""The attention seam: the one place a model's attention reads and writes the KV cache.

A model computes the queries, keys and values of its tokens (projections, biases, norms, rotary
embedding: everything that is the model's own) and hands them, with the cache and this step's
`PagedAttentionMetadata`, to `attention`. It gets back each query's attention output and the
updated cache. It never indexes the cache and never builds a mask: where a token's key and value
are stored, which cached positions a query sees and how they are gathered are this module's, so a
second model family, or a different cache layout, changes nothing in the other.

The cache is a `PagedKVCache`, a pool of pages per layer; the tokens of one call are a flat
ragged batch of many requests (``[T]`` or ``[1, T]``), and the metadata carries each token's
cache slot, each request's block table, where its tokens start and its context length; the
cache's `AttentionBackend` (XLA, TPU or GPU Pallas) writes and reads the pages. The engine builds
each step's metadata and passes it through the model's ``__call__`` untouched (see
`jaxengine.models.interface`); a whole-sequence forward outside the engine builds one step over
a scratch pool of pages (`jaxengine.models.sequence_logprobs.scratch_step`).

Shape letters, as in the rest of `jaxengine.models`: ``T`` tokens of one call, ``H`` query heads,
``K`` key/value heads, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax

from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.paged_attention import PagedAttentionMetadata

__all__ = [
  "AttentionOutput",
  "PagedAttentionMetadata",
  "PagedKVCache",
  "attention",
]


class AttentionOutput(NamedTuple):
  """What `attention` returns.

  Attributes:
    output: ``[..., H, D]`` attention output of each query token, in the queries' dtype.
    kv_cache: the `PagedKVCache` with this call's keys and values written in the layer.
  """

  output: jax.Array
  kv_cache: PagedKVCache


def attention(
  q: jax.Array,
  k: jax.Array | None,
  v: jax.Array | None,
  kv_cache: PagedKVCache,
  layer: int,
  metadata: PagedAttentionMetadata,
  *,
  scale: float,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
) -> AttentionOutput:
  """Stores this call's keys and values in `layer`, then attends causally over each sequence.

  The tokens are one flat ragged batch, ``[T]`` or ``[1, T]`` as the model's leading dimensions;
  request ``r``'s tokens are ``query_start_loc[r] : query_start_loc[r + 1]``, the last of its
  ``seq_lens[r]`` context tokens, so prefill chunks, decodes and draft tokens of many requests
  share one call. Token ``i`` is written at cache slot ``slot_mapping[i]`` (page
  ``slot // block_size``, offset ``slot % block_size``) and request ``r`` reads its pages
  ``block_tables[r]`` through the cache's `AttentionBackend`
  (`jaxengine.models.attention_backends`). The position a query attends from is implied by
  ``seq_lens`` and ``query_start_loc``; the model's own ``positions`` (for its rotary embedding)
  must agree (`jaxengine.worker.step_inputs` builds both). Padding tokens (past
  ``query_start_loc[num_reqs]``) write to the null page 0, which no request reads, and get zero
  outputs.

  Contract (what a model may rely on, and what a cache layout must keep):

  * **Writes.** A token's key and value are stored for its position in its own sequence, cast to
    the cache dtype. A padding token writes only to the null slot, which no real token reads. Its
    output is meaningless.
  * **Causality.** A query at position ``p`` attends to its own sequence's positions ``s <= p``
    (with `sliding_window` ``W``, only ``p - W < s <= p``), over keys and values cached by earlier
    calls and by this one alike: writing happens before reading, so the tokens of one prefill
    chunk see each other and a decode token sees itself.
  * **Continuation.** A call whose first position is ``p > 0`` (a prompt's remainder after a
    cached prefix, a later prefill chunk, a decode step) attends to the positions ``< p`` already
    in the cache for that sequence: they must have been written by earlier calls (or be shared
    blocks written by another request with the same prefix). Stale data beyond a sequence's
    written positions is never read by a real token.
  * **Padding.** Padding tokens come after every real token and map to the null slot.
  * **Numerics.** Scores and the softmax run in float32 whatever the input dtype; masked
    positions enter the matmuls with weight 0, so the cache must stay finite.

  Args:
    q: ``[..., H, D]`` queries after the rotary embedding, model dtype (``[T, H, D]`` or
      ``[1, T, H, D]``).
    k: ``[..., K, D]`` keys after the rotary embedding, or None (with `v`): nothing is written,
      the queries read what earlier layers of this call wrote in `layer` (a layer that shares an
      earlier layer's keys and values: Gemma 4's KV-shared layers).
    v: ``[..., K, D]`` values, or None (with `k`).
    kv_cache: the whole `PagedKVCache`; only `layer` is read and written.
    layer: this layer's index in the cache (static), or a traced ``[] int32`` index when the
      cache's pages are stacked (`PagedKVCache.stacked_layers`, a layer scan).
    metadata: this step's `PagedAttentionMetadata`.
    scale: multiplies the scores (usually ``D ** -0.5``).
    sliding_window: ``W``, or None for full causal attention. The backend applies it (XLA and
      TPU; the GPU backend refuses one, `AttentionBackend.check_sliding_window`); the engine
      frees the pages that slid out of every window (KV cache groups,
      `jaxengine.core.kv_cache_groups`, through the cache's `layer_groups`). A model may pass
      a different window (or None) per layer (Gemma's local and global layers).
    soft_cap: None, or a positive float ``c`` (static): each scaled score ``s`` becomes
      ``c * tanh(s / c)`` before masking and the softmax (attention logit soft-capping, Gemma 2).
      The XLA and TPU backends apply it; the GPU backend refuses one
      (`AttentionBackend.check_soft_cap`).

  Returns:
    `AttentionOutput`: ``[..., H, D]`` outputs in ``q.dtype`` and the updated cache.

  Raises:
    ValueError: (at trace time) a cache that is not a `PagedKVCache`, tokens whose count
      differs from ``slot_mapping``'s, a `sliding_window` or `soft_cap` with a backend that has
      none (``"pallas_gpu"``; the engine refuses it earlier, on the host), or a `soft_cap` that
      is not positive.
  """
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
  if not isinstance(kv_cache, PagedKVCache):
    raise ValueError(f"attention needs a PagedKVCache, got {type(kv_cache)}")
  if kv_cache.stacked_layers is not None:  # one stacked entry, the layer's pages by offset
    metadata, _ = kv_cache.layer_metadata(metadata, layer)
    layer = 0
  elif kv_cache.layer_groups is not None:  # the layer's slot of a page and its group's table
    group, layer = kv_cache.layer_groups[layer]
    if metadata.slot_mapping.ndim == 2:  # [G, T] slots, [G, R, P] tables
      metadata = dataclasses.replace(
        metadata,
        slot_mapping=metadata.slot_mapping[group],
        block_tables=metadata.block_tables[group],
      )
  num_tokens = metadata.slot_mapping.shape[0]
  if math.prod(q.shape[:-2]) != num_tokens:
    raise ValueError(
      f"paged attention takes one flat ragged batch: queries {q.shape} hold "
      f"{math.prod(q.shape[:-2])} tokens, slot_mapping {num_tokens}"
    )
  h, d = q.shape[-2:]
  backend = kv_cache.backend
  written = kv_cache.pages[layer]
  if k is not None and v is not None:
    kv = k.shape[-2]
    flat_k, flat_v = k.reshape(num_tokens, kv, d), v.reshape(num_tokens, kv, d)
    written = backend.write_kv(written, flat_k, flat_v, metadata.slot_mapping)
  out = backend.attention(
    q.reshape(num_tokens, h, d),
    written,
    metadata,
    scale=scale,
    num_kv_heads=kv_cache.num_kv_heads,
    sliding_window=sliding_window,
    soft_cap=soft_cap,
  )
  pages = (*kv_cache.pages[:layer], written, *kv_cache.pages[layer + 1 :])
  return AttentionOutput(out.reshape(q.shape), dataclasses.replace(kv_cache, pages=pages))
