"""Several decode-and-sample steps in one jitted loop on the device.

On accelerators a decode step of a small model takes about as long as the host needs to launch it
and read its tokens back; looping `k` steps on the device pays that once per `k` tokens.

Each iteration of `decode_steps` is exactly the engine's one-step decode (the model on each
running row's last token, then `jaxengine.sample.sample`, which appends the token), so a row's
tokens, logprobs and random streams are those of `k` single steps. A row stops on the device
after the token that ends it by the rules the device can see: `max_tokens`, `max_model_len`,
EOS (unless `ignore_eos`) and `stop_token_ids`, the last two never before `min_tokens`. A stopped
row is masked out of the later iterations (nothing appended, nothing written to its cache).
Stop strings need the text: the host checks them afterwards and discards what follows a match.
The loop ends after `k` iterations, when no row runs, or (with `end_on_first_finish`, set while
requests wait for a row) as soon as one row stops, so a freed row is refilled at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxengine.batch.step_loop import MultiStepOutput
from jaxengine.models.attention import AttentionMetadata
from jaxengine.params import SamplingParams
from jaxengine.sample import LogprobsTensors, sample


def device_stop_rules(
  params: SamplingParams, eos_token_ids: Sequence[int], max_model_len: int
) -> tuple[int, tuple[int, ...]]:
  """A completion's stop rules the device loop checks: `(max_output_tokens, stop ids)`.

  Args:
    params: the completion's sampling parameters.
    eos_token_ids: the engine's EOS ids (all of them end generation unless `ignore_eos`).
    max_model_len: the engine's limit (a row also stops when its sequence reaches it).

  Returns:
    The most output tokens the completion may have, and the ids that end it once it has
    `min_tokens` tokens.
  """
  eos = () if params.ignore_eos else tuple(eos_token_ids)
  stop_ids = tuple(dict.fromkeys((*eos, *(params.stop_token_ids or ()))))
  return params.max_tokens or max_model_len, stop_ids


def stop_rule_arrays(
  rules: Sequence[tuple[int, tuple[int, ...]]], num_rows: int, max_num_stop_ids: int
) -> tuple[np.ndarray, np.ndarray]:
  """Rows of `device_stop_rules` as the loop's arrays, padded to `num_rows` rows.

  Returns:
    `max_output_tokens [num_rows] int32` and `stop_ids [num_rows, max_num_stop_ids] int32`
    (padded with -1, which no token equals).
  """
  max_output_tokens = np.zeros((num_rows,), np.int32)
  stop_ids = np.full((num_rows, max_num_stop_ids), -1, np.int32)
  for row, (limit, ids) in enumerate(rules):
    max_output_tokens[row] = limit
    stop_ids[row, : len(ids)] = ids
  return max_output_tokens, stop_ids


def decode_steps(
  graphdef,
  state,
  metadata,
  weights,
  kv_cache,
  max_output_tokens,
  stop_ids,
  end_on_first_finish,
  attention_len: int,
  num_rows: int,
  num_steps: int,
  mesh=None,
):
  """Up to `num_steps` decode-and-sample steps over the first `num_rows` rows, on the device.

  On a `mesh` (static) each step samples the vocabulary-sharded logits as `decode_and_sample`
  does.

  Args:
    graphdef: the model's NNX graph definition (bound with `functools.partial`).
    state: the `BatchState` (donated).
    metadata: its `SamplingMetadata`.
    weights: the model's weights.
    kv_cache: the KV cache (donated).
    max_output_tokens: `[num_rows] int32` output tokens after which a row stops.
    stop_ids: `[num_rows, C] int32` ids that stop a row once it has `min_tokens` outputs (-1 pads).
    end_on_first_finish: `[] bool`, end the loop after the step in which some row stopped.
    attention_len: static; a bucket of cache positions above every row's length after the
      last step.
    num_rows: static; a row bucket holding every live row (the batch is condensed).
    num_steps: static; `k`.

  Returns:
    `(state, MultiStepOutput, kv_cache)`.
  """
  model = nnx.merge(graphdef, weights)
  rows_state = state.leading_rows(num_rows)
  rows_metadata = metadata.leading_rows(num_rows)
  max_model_len = state.max_model_len
  num_columns = state.num_top_logprobs + 1
  logprobs = LogprobsTensors(
    token_ids=jnp.zeros((num_steps, num_rows, num_columns), jnp.int32),
    logprobs=jnp.zeros((num_steps, num_rows, num_columns), jnp.float32),
    ranks=jnp.zeros((num_steps, num_rows), jnp.int32),
  )
  carry = dict(
    step=jnp.int32(0),
    state=rows_state,
    kv_cache=kv_cache,
    running=rows_metadata.is_live,
    any_finished=jnp.bool_(False),
    tokens=jnp.zeros((num_steps, num_rows), jnp.int32),
    logprobs=logprobs,
    num_sampled=jnp.zeros((num_rows,), jnp.int32),
  )

  def go_on(c):
    return (c["step"] < num_steps) & c["running"].any() & ~(end_on_first_finish & c["any_finished"])

  def one_step(c):
    rows, running = c["state"], c["running"]
    # Stopped rows are not live for this step: no token appended, no cache write.
    step_metadata = dataclasses.replace(rows_metadata, is_live=running)
    last = jnp.maximum(rows.num_tokens - 1, 0)
    token_ids = rows.token_ids[jnp.arange(num_rows), last]
    positions = jnp.where(running, last, max_model_len)
    attn_metadata = AttentionMetadata(
      cache_slots=rows.cache_slot, positions=positions[:, None], attention_len=attention_len
    )
    hidden, kv = model(token_ids[:, None], positions[:, None], c["kv_cache"], attn_metadata)
    rows, output = sample(rows, step_metadata, model.compute_logits(hidden[:, 0]), mesh=mesh)
    tokens = output.sampled_token_ids
    appended = output.is_appended
    num_output = rows.num_output_tokens
    is_stop_id = (stop_ids == tokens[:, None]).any(-1) & (num_output >= rows.min_tokens)
    stopped = (num_output >= max_output_tokens) | (rows.num_tokens >= max_model_len) | is_stop_id
    finished = running & (~appended | stopped)
    step = c["step"]
    return dict(
      step=step + 1,
      state=rows,
      kv_cache=kv,
      running=running & ~finished,
      any_finished=c["any_finished"] | finished.any(),
      tokens=c["tokens"].at[step].set(tokens),
      logprobs=jax.tree.map(lambda a, b: a.at[step].set(b), c["logprobs"], output.logprobs),
      num_sampled=c["num_sampled"] + appended.astype(jnp.int32),
    )

  c = lax.while_loop(go_on, one_step, carry)
  output = MultiStepOutput(
    sampled_token_ids=c["tokens"], logprobs=c["logprobs"], num_sampled=c["num_sampled"]
  )
  return state.with_leading_rows(c["state"]), output, c["kv_cache"]
