"""The runner's prefill steps as pure device functions.

A prefill writes the keys and values of a padded `[B, T]` block of prompt tokens, from position
0, into their rows' cache slots, attending to the first `T` positions of each slot.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxengine.models.attention import AttentionMetadata
from jaxengine.sample import gather_logprobs


def prefill_step(graphdef, weights, kv_cache, token_ids, positions, cache_slots):
  """Writes the keys and values of `token_ids` [B, T] (positions `0 .. T - 1` of each row)."""
  model = nnx.merge(graphdef, weights)
  attn_metadata = AttentionMetadata(
    cache_slots=cache_slots, positions=positions, attention_len=token_ids.shape[1]
  )
  _, kv_cache = model(token_ids, positions, kv_cache, attn_metadata)
  return kv_cache


def prefill_with_prompt_logprobs(
  graphdef, num_logprobs, weights, kv_cache, token_ids, positions, cache_slots, next_token_ids
):
  """Prefill that also returns the raw log-softmax logprobs of each next prompt token
  (`LogprobsTensors` of `[B, T, num_logprobs + 1]`)."""
  model = nnx.merge(graphdef, weights)
  attn_metadata = AttentionMetadata(
    cache_slots=cache_slots, positions=positions, attention_len=token_ids.shape[1]
  )
  hidden, kv_cache = model(token_ids, positions, kv_cache, attn_metadata)
  logits = model.compute_logits(hidden)  # [B, T, V]
  rows, length, vocab = logits.shape
  logprobs = gather_logprobs(
    logits.reshape(rows * length, vocab), next_token_ids.reshape(-1), num_logprobs
  )
  return kv_cache, jax.tree.map(lambda a: a.reshape(rows, length, *a.shape[1:]), logprobs)
