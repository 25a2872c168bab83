"""The paged engine's step: the model once over a ragged batch of tokens, then the sampler.

Two jitted functions, called back to back without a host round trip: `ragged_forward` (the
model; one executable per (token bucket, row bucket)) and `sample_produced` (the sampler; one
per row bucket of at least `MIN_SAMPLE_ROWS`, `worker/buckets.py`'s `sample_rows`: the model's
logits are gathered into that many rows). Kept apart, a new token bucket compiles only the
model, not the sampler again.

The model computes the scheduled tokens of every request back to back (decode tokens, prefill
chunks, a preempted request's recomputation: `PagedAttentionMetadata` says which are whose) and
samples a token for each row whose last known token was among them. Rows that only advanced
their prefill (or were not scheduled) keep their batch state as it was: the sampler runs over
the row bucket with those rows masked out of `is_live`, so nothing is appended, counted or
advanced for them.

Shape legend: `T` query tokens (a bucket of the step's token count), `R` rows (a bucket above
the batch's live rows), `V` vocabulary, `k` logprob columns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.batch.step_loop import MultiStepOutput
from jaxengine.models.lora import LoRAInputs
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.sample import LogprobsTensors, gather_logprobs, sample
from jaxengine.worker.routed_experts import RoutedExperts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedInputs:
  """One ragged step's device inputs (every field an int32 or bool array).

  Attributes:
    token_rows: `[T] int32` the batch row of each query token (0 for padding tokens).
    positions: `[T] int32` each query token's position in its sequence (0 for padding): the
      token is `state.token_ids[token_rows, positions]`, the rotary position is this one.
    attention: the step's `PagedAttentionMetadata` (`R` requests in row order).
    logits_indices: `[S] int32` for each row, the flat index of its last query token (any index
      for rows that do not sample); `S >= R` the sampler's rows (`worker/buckets.py`'s
      `sample_rows`; a verify step's `R`), rows past `R` padding.
    produces: `[S] bool` rows that sample a token this step.
    lora: None (an engine without `enable_lora`: the model call is the plain one), or the
      LoRA adapters' device slots with each query token's slot (`[T] int32`, 0: the base).
  """

  token_rows: jax.Array
  positions: jax.Array
  attention: PagedAttentionMetadata
  logits_indices: jax.Array
  produces: jax.Array
  lora: LoRAInputs | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedForward:
  """The model's part of a ragged step.

  Attributes:
    logits: `[S, V] float32` logits at each row's last query token (`logits_indices`; zeros in
      the sampler's padding rows past `R`; `[R, k + 1, V]` in a verify step).
    kv_cache: the `PagedKVCache` with the step's keys and values written.
    prompt_logprobs: `LogprobsTensors` of `[T, k + 1]` (see `ragged_forward`), or None.
    routed_experts: the `[T, M, k]` experts of the step's tokens and their slots, when the
      model returns its routing (`worker/routed_experts.py`), else None.
  """

  logits: jax.Array
  kv_cache: Any
  prompt_logprobs: LogprobsTensors | None
  routed_experts: RoutedExperts | None = None


def ragged_forward(
  graphdef,
  state,
  weights,
  kv_cache,
  inputs: RaggedInputs,
  prompt_logprobs=0,
  input_token_ids=None,
  logits_indices=None,
):
  """The model once over the step's flat tokens; the logits each producing row samples from.

  Args:
    graphdef: the model's graph definition (bound by the runner).
    state: the batch's `BatchState` (read: the tokens at `inputs`' rows and positions).
    weights: the model's weights.
    kv_cache: the `PagedKVCache` (donated by the jitted step).
    inputs: the step's `RaggedInputs` (`T` tokens, `R` rows).
    prompt_logprobs: static; 0, or `k + 1` to also return, for every query token, the raw
      logprobs (log-softmax of the logits) of the token that follows it in its sequence and the
      top `k` (a step with a prompt that asked for `prompt_logprobs`).
    input_token_ids: None, or `[T] int32` tokens fed in place of the batch's, -1 where the
      batch's own token is fed (a verify step's drafts, `worker/verify_step.py`).
    logits_indices: None (`inputs.logits_indices`), or `[R, ...] int32` flat query indices
      whose logits to return (a verify step's `[R, k + 1]`).

  Returns:
    `RaggedForward` (logits `[R, ..., V]`; routed experts with a model whose
    ``return_routed_experts`` is set). On a mesh the logits stay sharded over the vocabulary.
  """
  token_ids = state.token_ids[inputs.token_rows, inputs.positions]
  if input_token_ids is not None:
    token_ids = jnp.where(input_token_ids >= 0, input_token_ids, token_ids)
  if logits_indices is None:
    logits_indices = inputs.logits_indices
  model = nnx.merge(graphdef, weights)
  lora = {} if inputs.lora is None else {"lora": inputs.lora}
  hidden, kv_cache, *routing = model(
    token_ids[None], inputs.positions[None], kv_cache, inputs.attention, **lora
  )
  routed = None
  if routing:  # [1, T, M, k]: only a model told to return them
    routed = RoutedExperts(experts=routing[0][0], slots=inputs.attention.slot_mapping)
  num_rows = inputs.attention.seq_lens.shape[0]
  logits = model.compute_logits(hidden[0, logits_indices[:num_rows]])
  if logits_indices.shape[0] > num_rows:  # the sampler's padding rows (`sample_rows`): zeros
    logits = jnp.pad(
      logits, ((0, logits_indices.shape[0] - num_rows),) + ((0, 0),) * (logits.ndim - 1)
    )
  token_logprobs = None
  if prompt_logprobs:
    following = jnp.minimum(inputs.positions + 1, state.max_model_len - 1)
    next_token_ids = state.token_ids[inputs.token_rows, following]
    all_logits = model.compute_logits(hidden[0])  # [T, V]
    token_logprobs = gather_logprobs(
      all_logits, next_token_ids, prompt_logprobs - 1, fixed_order=state.config.batch_invariant
    )
  return RaggedForward(
    logits=logits, kv_cache=kv_cache, prompt_logprobs=token_logprobs, routed_experts=routed
  )


def sample_produced(state, metadata, logits, produces, num_rows, mesh=None):
  """The sampler on the rows that produce a token this step; the other rows keep their state.

  Args:
    state: the batch's `BatchState` (donated by the jitted step).
    metadata: its `SamplingMetadata`.
    logits: `[R, V] float32` (`RaggedForward.logits`).
    produces: `[R] bool` rows that sample (`RaggedInputs.produces`).
    num_rows: `R` (static), a bucket holding every live row (the batch is condensed).
    mesh: None, or the engine's mesh (static): the sampler reduces the vocabulary-sharded
      logits per shard (`jaxengine.sample.sharded`): only per-row summaries cross devices.

  Returns:
    `(state, MultiStepOutput)`: one step; `num_sampled [R]` is 1 for rows that produced a token
    and 0 elsewhere.
  """
  rows_state = state.leading_rows(num_rows)
  rows_metadata = metadata.leading_rows(num_rows)
  producing = dataclasses.replace(rows_metadata, is_live=rows_metadata.is_live & produces)
  before = rows_state  # the leaves the sampler leaves alone are not written back
  rows_state, sampled = sample(rows_state, producing, logits, mesh=mesh)
  output = MultiStepOutput(
    sampled_token_ids=sampled.sampled_token_ids[None],
    logprobs=jax.tree.map(lambda a: a[None], sampled.logprobs),
    num_sampled=sampled.is_appended.astype(jnp.int32),
  )
  return state.with_leading_rows(rows_state, before), output
