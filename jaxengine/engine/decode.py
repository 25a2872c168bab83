"""The decode step: the model on each live row's last token, then the sampler, in one executable.

`decode_and_sample` is the pure function `ModelRunner` jits (state and KV cache donated);
`DecodeOutput` and `MultiStepOutput` are what the runner hands the engine after one step or
after several (`num_decode_steps`, speculative verification).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from jaxengine.batch import HostSamplerOutput
from jaxengine.batch.step_loop import HostMultiStepOutput
from jaxengine.models.attention import AttentionMetadata
from jaxengine.sample import sample


@dataclasses.dataclass(frozen=True)
class MultiStepOutput:
  """Several decode steps on the host.

  Attributes:
    req_ids: the batch's row ids (`num_reqs`), the order of the arrays below.
    sampled: per step, the sampler's host output over those rows, and each row's valid steps.
  """

  req_ids: list[str]
  sampled: HostMultiStepOutput


@dataclasses.dataclass(frozen=True)
class DecodeOutput:
  """One decode step on the host.

  Attributes:
    req_ids: the batch's row ids (`num_reqs`), the order of the arrays below.
    sampled: the sampler's host output over those rows.
  """

  req_ids: list[str]
  sampled: HostSamplerOutput


def decode_and_sample(
  graphdef, state, metadata, weights, kv_cache, attention_len, num_rows, mesh=None
):
  """Model forward on each live row's last token, then the sampler: one executable per step.

  On a `mesh` (static) the logits stay sharded over the vocabulary and the sampler reduces them
  per shard (`jaxengine.sample.sharded`): only per-row summaries cross devices.

  Only the first `num_rows` rows (static, a bucket above `num_reqs`; the batch is condensed, so
  every live row is among them) are computed, so one request costs about what it costs alone
  whatever `max_num_reqs` is. `attention_len` (static) is a bucket of cache positions above every
  live row's length, so a step costs what the longest sequence needs rather than `max_model_len`.
  """
  rows_state = state.leading_rows(num_rows)
  rows_metadata = metadata.leading_rows(num_rows)
  last = jnp.maximum(rows_state.num_tokens - 1, 0)
  token_ids = rows_state.token_ids[jnp.arange(num_rows), last]
  # Rows without a request write nothing: positions >= max_model_len are dropped by the cache.
  positions = jnp.where(rows_metadata.is_live, last, state.max_model_len)
  model = nnx.merge(graphdef, weights)
  attn_metadata = AttentionMetadata(
    cache_slots=rows_state.cache_slot, positions=positions[:, None], attention_len=attention_len
  )
  hidden, kv_cache = model(token_ids[:, None], positions[:, None], kv_cache, attn_metadata)
  logits = model.compute_logits(hidden[:, 0])
  rows_state, output = sample(rows_state, rows_metadata, logits, mesh=mesh)
  return state.with_leading_rows(rows_state), output, kv_cache
