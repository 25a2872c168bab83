"""The attention seam: the one place a model's attention reads and writes the KV cache.

A model computes the queries, keys and values of its tokens (projections, biases, norms, rotary
embedding: everything that is the model's own) and hands them, with the cache and this step's
`AttentionMetadata`, to `attention`. It gets back each query's attention output and the updated
cache. It never indexes the cache and never builds a mask: where a token's key and value are
stored, which cached positions a query sees and how they are gathered are this module's, so a
second model family, or a different cache layout, changes nothing in the other.

The engine builds the `AttentionMetadata` of each step and passes it through the model's
``__call__`` untouched (see `jaxengine.models.interface`). Today the cache is addressed by
``(layer, slot, position)`` (`KVCache`) and the tokens of one call form a ``[B, T]`` grid of rows;
the metadata says which slot each row owns, each token's position, and how many positions of
each slot to read. A paged cache replaces these fields (block tables, the cache slot of each
token, where each request's tokens start in a flat ragged batch, each sequence's length) and this
function's body; a model that treats the leading dimensions of its tokens as opaque (``[...]``
below) keeps working unchanged.

Shape letters, as in the rest of `jaxengine.models`: ``B`` rows of one call, ``T`` tokens per
row, ``S`` cache positions per slot (``max_model_len``), ``H`` query heads, ``K`` key/value
heads, ``G = H // K``, ``D`` head dim, ``L`` layers.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxengine.models.kv_cache import KVCache
from jaxengine.models.layers import grouped_query_attention

__all__ = ["AttentionMetadata", "AttentionOutput", "as_attention_metadata", "attention"]


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


class AttentionOutput(NamedTuple):
  """What `attention` returns.

  Attributes:
    output: ``[..., H, D]`` attention output of each query token, in the queries' dtype.
    kv_cache: the cache with this call's keys and values written in the layer.
  """

  output: jax.Array
  kv_cache: KVCache


def as_attention_metadata(
  metadata: AttentionMetadata | jax.Array, positions: jax.Array, attention_len: int | None
) -> AttentionMetadata:
  """`metadata` itself, or the metadata of the older call form ``(..., cache_slots, attention_len=)``.

  Args:
    metadata: an `AttentionMetadata`, or ``[B] int32`` cache slots (the fourth argument of a model
      call before the seam existed).
    positions: ``[B, T] int32`` the call's positions.
    attention_len: the older call's static keyword (ignored with an `AttentionMetadata`).
  """
  if isinstance(metadata, AttentionMetadata):
    return metadata
  return AttentionMetadata(cache_slots=metadata, positions=positions, attention_len=attention_len)


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  kv_cache: KVCache,
  layer: int,
  metadata: AttentionMetadata,
  *,
  scale: float,
  sliding_window: int | None = None,
) -> AttentionOutput:
  """Stores this call's keys and values in `layer`, then attends causally over each sequence.

  Contract (what a model may rely on, and what a cache layout must keep):

  * **Writes.** Token ``(b, t)``'s key and value are stored for position ``positions[b, t]`` of
    row ``b``'s sequence, cast to the cache dtype. A token at a position ``>= S``
    (``max_model_len``) writes nothing: that is how padding rows and tokens are made harmless.
    Its output is meaningless.
  * **Causality.** A query at position ``p`` attends to its own sequence's positions ``s <= p``
    (with `sliding_window` ``W``, only ``p - W < s <= p``), over keys and values cached by earlier
    calls and by this one alike: writing happens before reading, so the tokens of one prefill
    chunk see each other and a decode token sees itself.
  * **Continuation.** A call whose first position is ``p > 0`` (a prompt's remainder after a
    cached prefix, a later prefill chunk, a decode step) attends to the positions ``< p`` already
    in the cache for that sequence: they must have been written by earlier calls (or copied there
    by the prefix cache). Stale data beyond a sequence's written positions is never read by a
    real token.
  * **Padding.** Padding tokens of a row must sit at positions after its real tokens (or
    ``>= S``): a padding token at an earlier position would overwrite a real key.
  * **Numerics.** Scores and the softmax run in float32 whatever the input dtype; masked
    positions enter the matmuls with weight 0, so the cache must stay finite.

  Args:
    q: ``[B, T, H, D]`` queries after the rotary embedding, model dtype.
    k: ``[B, T, K, D]`` keys after the rotary embedding.
    v: ``[B, T, K, D]`` values.
    kv_cache: the whole cache (``[L, num_slots, S, K, D]`` keys and values); only `layer` is
      read and written.
    layer: this layer's index in the cache (static).
    metadata: this step's `AttentionMetadata`.
    scale: multiplies the scores (usually ``D ** -0.5``).
    sliding_window: ``W``, or None for full causal attention.

  Returns:
    `AttentionOutput`: ``[B, T, H, D]`` outputs in ``q.dtype`` and the updated cache.
  """
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
  out = grouped_query_attention(grouped, keys, values, visible, scale=scale)
  updated = dataclasses.replace(kv_cache, key=key_cache, value=value_cache)
  return AttentionOutput(out.reshape(b, t, h, d), updated)
