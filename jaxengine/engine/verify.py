"""The speculative verify step: one model pass over each row's last token and its drafts, then
the rejection sampler, in one executable.

Row `i` feeds `[last token, draft_0, ..., draft_{k-1}]` at positions `n_i - 1 .. n_i - 1 + k`
(`n_i` its tokens so far), writing their keys and values to its cache slot; padding drafts (past
the row's `num_draft_tokens`) and rows without a request go to position `max_model_len`, which
the cache drops. The logits of all `k + 1` positions go to `jaxengine.sample.rejection_sample`,
which appends the accepted drafts and one recovered or bonus token to the batch. The cache
positions of rejected drafts hold stale keys and values that no query reads (a row attends only
to positions below its length) until the next step overwrites them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.batch.step_loop import MultiStepOutput
from jaxengine.models.attention import AttentionMetadata
from jaxengine.sample import rejection_sample


def verify_and_sample(
  graphdef,
  state,
  metadata,
  weights,
  kv_cache,
  draft_token_ids,
  num_draft_tokens,
  attention_len: int,
  num_rows: int,
):
  """Verifies the drafts of the first `num_rows` rows (shape legend: `B = num_rows`, `k` drafts).

  Args:
    graphdef: the model's NNX graph definition (bound with `functools.partial`).
    state: the `BatchState` (donated).
    metadata: its `SamplingMetadata`.
    weights: the model's weights.
    kv_cache: the KV cache (donated).
    draft_token_ids: `[B, k] int32` drafts (anything past a row's count).
    num_draft_tokens: `[B] int32` drafts per row, in `[0, k]`; 0 for rows without a request.
    attention_len: static; a bucket of cache positions above `n_i + num_draft_tokens_i` of every
      live row.
    num_rows: static; a row bucket holding every live row (the batch is condensed).

  Returns:
    `(state, MultiStepOutput, kv_cache)`: the emitted tokens position by position (`[k + 1, B]`,
    logprobs `[k + 1, B, c]`), as the k-step loop returns them, so its host handling applies.
  """
  rows_state = state.leading_rows(num_rows)
  rows_metadata = metadata.leading_rows(num_rows)
  num_positions = draft_token_ids.shape[1] + 1
  last = jnp.maximum(rows_state.num_tokens - 1, 0)
  last_token = rows_state.token_ids[jnp.arange(num_rows), last]
  token_ids = jnp.concatenate([last_token[:, None], draft_token_ids], axis=1)  # [B, k + 1]
  offsets = jnp.arange(num_positions, dtype=jnp.int32)[None, :]
  fed = rows_metadata.is_live[:, None] & (offsets <= num_draft_tokens[:, None])
  positions = jnp.where(fed, last[:, None] + offsets, state.max_model_len)
  token_ids = jnp.where(fed, token_ids, 0)
  model = nnx.merge(graphdef, weights)
  attn_metadata = AttentionMetadata(
    cache_slots=rows_state.cache_slot, positions=positions, attention_len=attention_len
  )
  hidden, kv_cache = model(token_ids, positions, kv_cache, attn_metadata)
  logits = model.compute_logits(hidden)  # [B, k + 1, V]
  rows_state, out = rejection_sample(
    rows_state, rows_metadata, logits, draft_token_ids, num_draft_tokens
  )
  output = MultiStepOutput(
    sampled_token_ids=out.sampled_token_ids.T,
    logprobs=jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), out.logprobs),
    num_sampled=out.num_sampled,
  )
  return state.with_leading_rows(rows_state), output, kv_cache


def pad_drafts(array: np.ndarray, num_rows: int) -> np.ndarray:
  """Drafts (`[N, k]`) or their counts (`[N]`) with zero rows (no draft) appended up to
  `num_rows`, the row bucket of the verify step."""
  padded = np.zeros((num_rows, *array.shape[1:]), array.dtype)
  padded[: len(array)] = array
  return padded
