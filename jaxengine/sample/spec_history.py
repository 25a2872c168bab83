"""The draft-position view of a batch: one virtual row per (row, position) for the rejection sampler.

Speculative decoding scores `P + 1` positions of each row at once (`P = max_spec_len` drafts, then
the bonus position). Position `j` of row `r` must be processed exactly as the main sampler would
process row `r` after the row had generated its first `j` drafts (`behaviour.md` §1.7): penalties
count the draft prefix, bad words look at it, min_tokens counts it, custom logits processors see
their state after it, and its random key is that of output token `num_output_tokens + j`.

`expand_positions` builds that view as an ordinary `BatchState` of `R * (P + 1)` rows (row `r`'s
positions are rows `r * (P + 1) + j`) and its `SamplingMetadata`, so every sampler stage runs on
it unchanged, and position `j` of a row gets bit for bit what `sample` would compute in its place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample.custom import update_processor_states
from jaxengine.sample.metadata import SamplingMetadata
from jaxengine.sample.state import BatchState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PositionView:
  """The batch seen per draft position (shape legend: `R` rows, `P` draft positions).

  Attributes:
    state: `BatchState` of `R * (P + 1)` rows; row `r * (P + 1) + j` is row `r` with its first
      `j` drafts appended (tokens, counts, `num_tokens`, processor states).
    metadata: its `SamplingMetadata`; position `j` of row `r` is live when row `r` is and
      `j <= num_draft_tokens[r]`.
    processor_states: each custom processor's state after each draft prefix, leaves
      `[P + 1, R, ...]` (`()` without processors).
  """

  state: BatchState
  metadata: SamplingMetadata
  processor_states: tuple


def repeat_rows(a: jax.Array, positions: int) -> jax.Array:
  """`[R, ...]` -> `[R * positions, ...]`, each row repeated `positions` times in place."""
  return jnp.repeat(a, positions, axis=0, total_repeat_length=a.shape[0] * positions)


def _prefix_scatter_indices(state: BatchState, drafts, num_drafts):
  """Where each position's draft prefix goes: `(rows, columns, tokens)`, each
  `[R * (P + 1), P]`; `columns` is the token position, `max_model_len` (dropped) outside the
  prefix."""
  rows, num_spec = drafts.shape
  positions = num_spec + 1
  j = jnp.arange(positions)[None, :, None]  # position
  i = jnp.arange(num_spec)[None, None, :]  # draft index
  in_prefix = (i < j) & (i < num_drafts[:, None, None])
  columns = jnp.where(in_prefix, state.num_tokens[:, None, None] + i, state.max_model_len)
  tokens = jnp.broadcast_to(drafts[:, None, :], (rows, positions, num_spec))
  virtual_rows = jnp.broadcast_to(
    jnp.arange(rows * positions).reshape(rows, positions, 1), columns.shape
  )
  flat = lambda a: a.reshape(rows * positions, num_spec)
  return flat(virtual_rows), flat(columns), flat(tokens), flat(in_prefix)


def prefix_processor_states(state: BatchState, md: SamplingMetadata, drafts, num_drafts) -> tuple:
  """Each custom processor's state after each draft prefix: leaves `[P + 1, R, ...]`.

  Entry `j` is the state after the row's first `j` drafts were appended one step at a time
  (`update_state`), so position `j` sees what the main sampler would see `j` steps later.
  """
  initial = state.logits_processor_states
  if not state.config.logits_processors:
    return ()

  def step(states, j):
    step_state = dataclasses.replace(state, logits_processor_states=states)
    appended = md.is_live & (j < num_drafts)
    new = update_processor_states(step_state, md, drafts[:, j], appended)
    return new, new

  _, stacked = lax.scan(step, initial, jnp.arange(drafts.shape[1]))
  return jax.tree.map(lambda first, rest: jnp.concatenate([first[None], rest]), initial, stacked)


def _expand_metadata(md: SamplingMetadata, positions: int, live: jax.Array) -> SamplingMetadata:
  """Metadata of the position view: per-row values repeated, batch-wide flags kept."""
  expanded = jax.tree.map(lambda a: repeat_rows(a, positions) if a.ndim else a, md)
  return dataclasses.replace(
    expanded,
    is_live=live,
    is_greedy=expanded.is_greedy & live,
    any_logits_processor=md.any_logits_processor,
  )


def expand_positions(
  state: BatchState, md: SamplingMetadata, drafts: jax.Array, num_drafts: jax.Array
) -> PositionView:
  """The `PositionView` of the batch for drafts `drafts [R, P] int32` (ids in `[0, V)`),
  `num_drafts [R] int32` in `[0, P]` of them real.

  Costs one copy of the per-row state for each position (`[R * (P + 1), V]` token counts and
  masks, `[R * (P + 1), max_model_len]` tokens) plus small scatters of the draft prefixes.
  """
  rows, num_spec = drafts.shape
  positions = num_spec + 1
  j = jnp.arange(positions)
  live = (md.is_live[:, None] & (j[None, :] <= num_drafts[:, None])).reshape(-1)
  virtual_rows, columns, tokens, in_prefix = _prefix_scatter_indices(state, drafts, num_drafts)
  vocab = state.vocab_size
  repeated = jax.tree.map(lambda a: repeat_rows(a, positions), state)
  processor_states = prefix_processor_states(state, md, drafts, num_drafts)
  view_processor_states = jax.tree.map(
    lambda a: jnp.swapaxes(a, 0, 1).reshape(rows * positions, *a.shape[2:]), processor_states
  )
  view = dataclasses.replace(
    repeated,
    token_ids=repeated.token_ids.at[virtual_rows, columns].set(tokens, mode="drop"),
    num_tokens=repeated.num_tokens + jnp.tile(j, rows),
    output_token_counts=repeated.output_token_counts.at[
      virtual_rows, jnp.where(in_prefix, tokens, vocab)
    ].add(1, mode="drop"),
    logits_processor_states=view_processor_states,
    config=state.config.replace(max_num_reqs=rows * positions),
  )
  return PositionView(
    state=view,
    metadata=_expand_metadata(md, positions, live),
    processor_states=processor_states,
  )
