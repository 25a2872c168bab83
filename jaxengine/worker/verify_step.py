"""Speculative decoding: n-gram drafts as query tokens of the ragged step.

Each step with `speculative_config`, `Speculation.propose` (`spec_decode/speculation.py`) asks the engine's
`SpeculativePolicy` for drafts of the running decodes (its drafts, limits and cost model; none
while a row with structured outputs runs). The `Scheduler` schedules a
drafted decode as `1 + d` query tokens (its last known token, then its `d` drafts, at positions
`n - 1 .. n - 1 + d`), within the token budget and the free pages. The step then runs `verify_forward`
(the model once over the ragged tokens, drafts fed in place of tokens the batch does not hold yet;
the logits at every query position of drafted rows), then `rejection_sample_produced`
(`jaxengine.sample.rejection_sample` over all rows): a row without drafts (a plain decode, a
prompt's last chunk) emits the very token `sample` would, a drafted row its accepted drafts and one
recovered or bonus token, each drawn with the key of its output index (so seeded outputs are those
of plain decoding). `Speculation.record` counts the accepted
drafts; the scheduler advances a drafted row's computed tokens by `1 + accepted`: the keys and
values of rejected drafts lie past it and the next step overwrites them. Prefix caching hashes known
tokens only, so a cached page never holds a rejected draft.

Compiles: `verify_forward` is one more model executable per (token bucket, row bucket), and
`rejection_sample_produced` one per row bucket, with `k` (the draft slots per row) fixed by the
config; `worker/precompile.py` compiles them beside the plain step's.

On a mesh (`tensor_parallel_size`): the model runs as in the plain step (pages split over key/
value heads), then the verify logits are gathered whole on every device and the rejection sampler
runs replicated: the same tokens as one device, for `R (k + 1)` rows of `V` floats moved per step.

Shape legend: `T` query tokens, `R` rows, `k` draft slots, `V` vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.batch.step_loop import MultiStepOutput
from jaxengine.core.scheduler import SchedulerOutput
from jaxengine.sample import rejection_sample
from jaxengine.sample.sharded import across_devices
from jaxengine.worker.ragged_step import RaggedInputs, ragged_forward


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDrafts:
  """A verify step's drafts on the device (int32 arrays).

  Attributes:
    input_token_ids: `[T]` the token of each query position that the batch does not hold yet (a
      draft), -1 where the token is the batch's own (`state.token_ids[row, position]`).
    logits_indices: `[R, k + 1]` flat query index of each row's positions to verify: its last
      known token, then its drafts (repeating the last for positions past its count).
    draft_token_ids: `[R, k]` each row's drafts (0 past its count).
    num_draft_tokens: `[R]` drafts per row, in `[0, k]`.
  """

  input_token_ids: jax.Array
  logits_indices: jax.Array
  draft_token_ids: jax.Array
  num_draft_tokens: jax.Array


def ragged_drafts(
  scheduled: SchedulerOutput,
  rows: Mapping[str, int],
  query_starts: Mapping[str, int],
  num_tokens: int,
  num_rows: int,
  k: int,
  sharding: jax.sharding.Sharding | None = None,
) -> RaggedDrafts:
  """Lays out a step's drafts (host NumPy, then one transfer).

  Args:
    scheduled: the step's plan (`spec_token_ids`: at most `k` per row; may be empty).
    rows: the batch row of each scheduled completion.
    query_starts: its first flat query index (`ModelRunner._query_starts`).
    num_tokens: `T`, the token bucket.
    num_rows: `R`, the row bucket.
    k: draft slots per row (`num_speculative_tokens`).
    sharding: where the arrays go (the mesh's replicated sharding on a mesh), None: the default
      device.

  Returns:
    The step's `RaggedDrafts`.
  """
  input_token_ids = np.full(num_tokens, -1, np.int32)
  logits_indices = np.zeros((num_rows, k + 1), np.int32)
  draft_token_ids = np.zeros((num_rows, k), np.int32)
  num_draft_tokens = np.zeros(num_rows, np.int32)
  slots = np.arange(k + 1)
  for seq_id, count in scheduled.num_scheduled_tokens.items():
    drafts = scheduled.spec_token_ids.get(seq_id, [])
    row, num = rows[seq_id], len(drafts)
    last = query_starts[seq_id] + count - 1 - num  # the row's last known token
    logits_indices[row] = last + np.minimum(slots, num)
    if num:
      input_token_ids[last + 1 : last + 1 + num] = drafts
      draft_token_ids[row, :num] = drafts
      num_draft_tokens[row] = num
  host = (input_token_ids, logits_indices, draft_token_ids, num_draft_tokens)
  device = jax.device_put(host, sharding)  # one transfer
  return RaggedDrafts(
    input_token_ids=device[0],
    logits_indices=device[1],
    draft_token_ids=device[2],
    num_draft_tokens=device[3],
  )


def verify_forward(
  graphdef, state, weights, kv_cache, inputs: RaggedInputs, drafts: RaggedDrafts, prompt_logprobs=0
):
  """The model's part of a verify step: `ragged_forward` with the drafts fed in place of tokens
  the batch does not hold yet, returning the logits at every position to verify.

  Args:
    graphdef, state, weights, kv_cache, inputs, prompt_logprobs: as
      `jaxengine.worker.ragged_step.ragged_forward` (`kv_cache` donated by the jitted step).
    drafts: the step's `RaggedDrafts`.

  Returns:
    `RaggedForward` with logits `[R, k + 1, V]`.
  """
  return ragged_forward(
    graphdef,
    state,
    weights,
    kv_cache,
    inputs,
    prompt_logprobs,
    input_token_ids=drafts.input_token_ids,
    logits_indices=drafts.logits_indices,
  )


def rejection_sample_produced(state, metadata, logits, drafts: RaggedDrafts, produces, num_rows,
                              mesh=None):  # fmt: skip
  """The sampler's part of a verify step: `rejection_sample` on the rows that produce.

  Args:
    state: the batch's `BatchState` (donated by the jitted step).
    metadata: its `SamplingMetadata`.
    logits: `[R, k + 1, V] float32` (`verify_forward`), whole on every device on a mesh (the
      rejection sampler has no vocabulary-sharded path, so it computes what one device does).
    drafts: the step's `RaggedDrafts`.
    produces: `[R] bool` rows that produce a token this step.
    num_rows: `R` (static).
    mesh: None, or the engine's mesh (static).

  Returns:
    `(state, MultiStepOutput)`: the emitted tokens position by position (`[k + 1, R]`, logprobs
    `[k + 1, R, c]`); `num_sampled [R]` is `1 + accepted drafts` for rows that produce and 0
    elsewhere.
  """
  rows_state = state.leading_rows(num_rows)
  rows_metadata = metadata.leading_rows(num_rows)
  producing = dataclasses.replace(rows_metadata, is_live=rows_metadata.is_live & produces)
  # On several devices the sampler leaves out a barrier XLA refuses there (`across_devices`).
  several = mesh is not None and mesh.size > 1
  before = rows_state  # the leaves the sampler leaves alone are not written back
  with across_devices() if several else contextlib.nullcontext():
    rows_state, out = rejection_sample(
      rows_state, producing, logits, drafts.draft_token_ids, drafts.num_draft_tokens
    )
  output = MultiStepOutput(
    sampled_token_ids=out.sampled_token_ids.T,
    logprobs=jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), out.logprobs),
    num_sampled=out.num_sampled,
  )
  return state.with_leading_rows(rows_state, before), output
