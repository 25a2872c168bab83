"""The attention seam: the one place a model's attention reads and writes the KV cache.

A model computes the queries, keys and values of its tokens (projections, biases, norms, rotary
embedding: everything that is the model's own) and hands them, with the cache and this step's
`AttentionMetadata`, to `attention`. It gets back each query's attention output and the updated
cache. It never indexes the cache and never builds a mask: where a token's key and value are
stored, which cached positions a query sees and how they are gathered are this module's, so a
second model family, or a different cache layout, changes nothing in the other.

The engine builds each step's metadata and passes it through the model's ``__call__``
untouched (see `jaxengine.models.interface`). Two cache layouts sit behind the seam, chosen by
the metadata's type:

* slots (`AttentionMetadata` + `KVCache`): the cache is addressed by ``(layer, slot, position)``
  and the tokens of one call form a ``[B, T]`` grid of rows; the metadata says which slot each row
  owns, each token's position, and how many positions of each slot to read;
* pages (`PagedAttentionMetadata` + `PagedKVCache`): the cache is a pool of pages per layer, the
  tokens of one call are a flat ragged batch of many requests (``[T]`` or ``[1, T]``), and the
  metadata carries each token's cache slot, each request's block table, where its tokens start
  and its context length; the cache's `AttentionBackend` (XLA, TPU or GPU Pallas) writes and
  reads the pages.

A model that treats the leading dimensions of its tokens as opaque (``[...]`` below) runs over
either unchanged: the same weights give the same logits (tested in ``tests/models/test_model_pages.py``).

Shape letters, as in the rest of `jaxengine.models`: ``B`` rows of one call, ``T`` tokens per
row, ``S`` cache positions per slot (``max_model_len``), ``H`` query heads, ``K`` key/value
heads, ``G = H // K``, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxengine.models.kv_cache import KVCache
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.layers import grouped_query_attention
from jaxengine.models.paged_attention import PagedAttentionMetadata

__all__ = [
  "AnyKVCache",
  "AttentionMetadata",
  "AttentionOutput",
  "PagedAttentionMetadata",
  "PagedKVCache",
  "StepMetadata",
  "as_attention_metadata",
  "attention",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionMetadata:
  """Where one step's tokens live in the cache and what each may attend to.

  Built by the engine once per step (inside its jitted function) and shared by every layer. A
  model passes it to `attention` without reading it.

  Attributes:
    cache_slots: ``[B] int32`` the cache slot each row reads and writes
      (``0 <= slot < num_slots``).
    positions: ``[B, T] int32`` absolute position of each token in its sequence (the same array
      the model gets for its rotary embedding); positions ``>= S`` mark padding tokens.
    attention_len: static; positions ``0..attention_len-1`` of each slot are attended to (None:
      all ``S``). It must exceed the position of every token whose output is used; each distinct
      value compiles once.
  """

  cache_slots: jax.Array
  positions: jax.Array
  attention_len: int | None = dataclasses.field(default=None, metadata={"static": True})


#: The metadata a step passes through the model: slot or paged (the seam dispatches on its type).
StepMetadata = AttentionMetadata | PagedAttentionMetadata

#: The cache that goes with it: `KVCache` for slot metadata, `PagedKVCache` for paged metadata.
AnyKVCache = KVCache | PagedKVCache


class AttentionOutput(NamedTuple):
  """What `attention` returns.

  Attributes:
    output: ``[..., H, D]`` attention output of each query token, in the queries' dtype.
    kv_cache: the cache (of the type passed in) with this call's keys and values written in
      the layer.
  """

  output: jax.Array
  kv_cache: AnyKVCache


def as_attention_metadata(
  metadata: StepMetadata | jax.Array, positions: jax.Array, attention_len: int | None
) -> StepMetadata:
  """`metadata` itself, or the metadata of the older call form ``(..., cache_slots, attention_len=)``.

  Args:
    metadata: an `AttentionMetadata` or `PagedAttentionMetadata`, or ``[B] int32`` cache slots
      (the fourth argument of a model call before the seam existed).
    positions: ``[B, T] int32`` the call's positions.
    attention_len: the older call's static keyword (ignored with an `AttentionMetadata`).
  """
  if isinstance(metadata, AttentionMetadata | PagedAttentionMetadata):
    return metadata
  return AttentionMetadata(cache_slots=metadata, positions=positions, attention_len=attention_len)


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  kv_cache: AnyKVCache,
  layer: int,
  metadata: StepMetadata,
  *,
  scale: float,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
) -> AttentionOutput:
  """Stores this call's keys and values in `layer`, then attends causally over each sequence.

  Two cache layouts, chosen by the metadata's type (a model passes both through unchanged):

  * **Slots** (`AttentionMetadata` with a `KVCache`): the tokens form a ``[B, T]`` grid of rows,
    row ``b`` owns cache slot ``cache_slots[b]`` and token ``(b, t)`` sits at position
    ``positions[b, t]``.
  * **Pages** (`PagedAttentionMetadata` with a `PagedKVCache`): the tokens are one flat ragged
    batch, ``[T]`` or ``[1, T]`` as the model's leading dimensions; request ``r``'s tokens are
    ``query_start_loc[r] : query_start_loc[r + 1]``, the last of its ``seq_lens[r]`` context
    tokens, so prefill chunks, decodes and draft tokens of many requests share one call. Token
    ``i`` is written at cache slot ``slot_mapping[i]`` (page ``slot // B``, offset ``slot % B``)
    and request ``r`` reads its pages ``block_tables[r]`` through the cache's `AttentionBackend`
    (`jaxengine.models.attention_backends`). The position a query attends from is implied by
    ``seq_lens`` and ``query_start_loc``; the model's own ``positions`` (for its rotary
    embedding) must agree (`jaxengine.worker.step_inputs` builds both). Padding tokens (past
    ``query_start_loc[num_reqs]``) write to the null page 0, which no request reads, and get
    zero outputs.

  Contract (what a model may rely on, and what a cache layout must keep):

  * **Writes.** A token's key and value are stored for its position in its own sequence, cast to
    the cache dtype. A padding token writes nothing a real token reads (slots: a position
    ``>= S``, ``max_model_len``; pages: the null slot). Its output is meaningless.
  * **Causality.** A query at position ``p`` attends to its own sequence's positions ``s <= p``
    (with `sliding_window` ``W``, only ``p - W < s <= p``), over keys and values cached by earlier
    calls and by this one alike: writing happens before reading, so the tokens of one prefill
    chunk see each other and a decode token sees itself.
  * **Continuation.** A call whose first position is ``p > 0`` (a prompt's remainder after a
    cached prefix, a later prefill chunk, a decode step) attends to the positions ``< p`` already
    in the cache for that sequence: they must have been written by earlier calls (or, with pages,
    be shared blocks written by another request with the same prefix). Stale data beyond a
    sequence's written positions is never read by a real token.
  * **Padding.** Slots: padding tokens of a row must sit at positions after its real tokens (or
    ``>= S``): a padding token at an earlier position would overwrite a real key. Pages: padding
    tokens come after every real token and map to the null slot.
  * **Numerics.** Scores and the softmax run in float32 whatever the input dtype; masked
    positions enter the matmuls with weight 0, so the cache must stay finite.

  Args:
    q: ``[..., H, D]`` queries after the rotary embedding, model dtype (``[B, T, H, D]`` with
      slots, ``[T, H, D]`` or ``[1, T, H, D]`` with pages).
    k: ``[..., K, D]`` keys after the rotary embedding.
    v: ``[..., K, D]`` values.
    kv_cache: the whole cache (a `KVCache`, ``[L, num_slots, S, K, D]`` keys and values, or a
      `PagedKVCache`); only `layer` is read and written.
    layer: this layer's index in the cache (static).
    metadata: this step's `AttentionMetadata` or `PagedAttentionMetadata`.
    scale: multiplies the scores (usually ``D ** -0.5``).
    sliding_window: ``W``, or None for full causal attention. With pages, the backend applies it
      (XLA and TPU; the GPU backend refuses one, `AttentionBackend.check_sliding_window`); the
      engine frees the pages that slid out of every window (KV cache groups,
      `jaxengine.core.kv_cache_groups`, through the cache's `layer_groups`). A model may pass
      a different window (or None) per layer (Gemma's local and global layers).
    soft_cap: None, or a positive float ``c`` (static): each scaled score ``s`` becomes
      ``c * tanh(s / c)`` before masking and the softmax (attention logit soft-capping, Gemma 2).
      With pages: the XLA and TPU backends apply it; the GPU backend refuses one
      (`AttentionBackend.check_soft_cap`).

  Returns:
    `AttentionOutput`: ``[..., H, D]`` outputs in ``q.dtype`` and the updated cache.

  Raises:
    ValueError: (at trace time) a cache that does not match the metadata's type, paged tokens
      whose count differs from ``slot_mapping``'s, a `sliding_window` or `soft_cap` with a paged
      backend that has none (``"pallas_gpu"``; the paged engine refuses it earlier, on the host),
      or a `soft_cap` that is not positive.
  """
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be positive or None, got {soft_cap}")
  if isinstance(metadata, PagedAttentionMetadata):
    if not isinstance(kv_cache, PagedKVCache):
      raise ValueError(f"paged attention metadata needs a PagedKVCache, got {type(kv_cache)}")
    return _paged_attention(q, k, v, kv_cache, layer, metadata, scale, sliding_window, soft_cap)
  if not isinstance(kv_cache, KVCache):
    raise ValueError(f"slot attention metadata needs a KVCache, got {type(kv_cache)}")
  return _slot_attention(q, k, v, kv_cache, layer, metadata, scale, sliding_window, soft_cap)


def _slot_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  kv_cache: KVCache,
  layer: int,
  metadata: AttentionMetadata,
  scale: float,
  sliding_window: int | None,
  soft_cap: float | None,
) -> AttentionOutput:
  """The slot cache's write and dense masked read (``[B, T, ...]`` tokens)."""
  b, t, h, d = q.shape
  kv = k.shape[-2]
  positions, cache_slots = metadata.positions, metadata.cache_slots
  # Scatter to (layer, slot, position); the index arrays broadcast to [B, T]. Positions >= S are
  # dropped, so a row can be made write-free with position S.
  slots = cache_slots[:, None]  # [B, 1]
  key_cache = kv_cache.key.at[layer, slots, positions].set(k.astype(kv_cache.dtype), mode="drop")
  value_cache = kv_cache.value.at[layer, slots, positions].set(
    v.astype(kv_cache.dtype), mode="drop"
  )
  # Gather each row's slot after writing: [B, S', K, D] with S' = attention_len or S.
  keys = key_cache[layer, cache_slots, : metadata.attention_len].astype(q.dtype)
  values = value_cache[layer, cache_slots, : metadata.attention_len].astype(q.dtype)
  key_positions = jnp.arange(keys.shape[1], dtype=jnp.int32)[None, None, :]  # [1, 1, S']
  visible = key_positions <= positions[:, :, None]  # [B, T, S']
  if sliding_window is not None:
    visible &= key_positions > positions[:, :, None] - sliding_window
  grouped = q.reshape(b, t, kv, h // kv, d)  # [B, T, K, G, D]
  out = grouped_query_attention(grouped, keys, values, visible, scale=scale, soft_cap=soft_cap)
  updated = dataclasses.replace(kv_cache, key=key_cache, value=value_cache)
  return AttentionOutput(out.reshape(b, t, h, d), updated)


def _paged_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  kv_cache: PagedKVCache,
  layer: int,
  metadata: PagedAttentionMetadata,
  scale: float,
  sliding_window: int | None,
  soft_cap: float | None,
) -> AttentionOutput:
  """The paged cache's write and ragged read through the cache's backend (flat tokens)."""
  if kv_cache.layer_groups is not None:  # the layer's slot of a page and its group's table
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
  kv = k.shape[-2]
  flat_k, flat_v = k.reshape(num_tokens, kv, d), v.reshape(num_tokens, kv, d)
  backend = kv_cache.backend
  written = backend.write_kv(kv_cache.pages[layer], flat_k, flat_v, metadata.slot_mapping)
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
