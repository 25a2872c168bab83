"""The draft-position view of a batch: one virtual row per (row, draft position), for speculation.

Speculative decoding scores `P + 1` positions of each row at once (`P = max_spec_len` drafts, then
the bonus position). Position `j` of row `r` must be processed exactly as the main sampler would
process row `r` after the row had generated its first `j` drafts (`docs/sampling.md` §1.4): penalties
count the draft prefix, bad words look at it, min_tokens counts it, custom logits processors see
their state after it, and its random key is that of output token `num_output_tokens + j`.

`expand_positions` builds that view as an ordinary `BatchState` of `R * (P + 1)` rows (row `r`'s
positions are rows `r * (P + 1) + j`) and its `SamplingMetadata`, so every sampler stage runs on
it unchanged, and position `j` of a row gets what `sample` would compute in its place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample.custom import update_processor_states
from jaxengine.sample.metadata import SamplingMetadata
from jaxengine.sample.state import BatchState


@dataclasses.dataclass(frozen=True, kw_only=True)
class PositionView:
  """The batch seen per draft position (shape legend: `R` rows, `P` draft positions, `V` vocab).

  Traced values only (built inside the caller's jit). `state` is built where it is read, so the
  `[R * (P + 1), V]` arrays it repeats are computed inside the branch that needs them (the
  logits-processing `lax.cond`) and fused into their consumers, never written out as operands.

  Attributes:
    base: the batch state (`R` rows).
    metadata: `SamplingMetadata` of the `R * (P + 1)` positions; position `j` of row `r` is live
      when row `r` is and `j <= num_drafts[r]`.
    drafts: `[R, P] int32` draft ids in `[0, V)`.
    num_drafts: `[R] int32` in `[0, P]`.
    processor_states: each custom processor's state after each draft prefix, leaves
      `[P + 1, R, ...]` (`()` without processors).
  """

  base: BatchState
  metadata: SamplingMetadata
  drafts: jax.Array
  num_drafts: jax.Array
  processor_states: tuple

  @property
  def positions(self) -> int:
    """`P + 1`, positions per row."""
    return self.drafts.shape[1] + 1

  @property
  def config(self):
    """The `BatchConfig` of the view (`max_num_reqs = R * (P + 1)`)."""
    return self.base.config.replace(max_num_reqs=self.base.max_num_reqs * self.positions)

  @property
  def state(self) -> BatchState:
    """`BatchState` of `R * (P + 1)` rows; row `r * (P + 1) + j` is row `r` with its first `j`
    drafts appended (tokens, output counts, `num_tokens`, processor states)."""
    return _view_state(self)


def repeat_rows(a: jax.Array, positions: int) -> jax.Array:
  """`[R, ...]` -> `[R * positions, ...]`, each row repeated `positions` times in place."""
  return jnp.repeat(a, positions, axis=0, total_repeat_length=a.shape[0] * positions)


def _prefix_mask(drafts, num_drafts) -> jax.Array:
  """`[R * (P + 1), P] bool` whether draft `i` is in the history of each position."""
  rows, num_spec = drafts.shape
  j = jnp.arange(num_spec + 1)[None, :, None]  # position
  i = jnp.arange(num_spec)[None, None, :]  # draft index
  in_prefix = (i < j) & (i < num_drafts[:, None, None])
  return in_prefix.reshape(rows * (num_spec + 1), num_spec)


def _view_state(view: PositionView) -> BatchState:
  """Builds `view.state` (see `PositionView`)."""
  state, drafts = view.base, view.drafts
  rows, num_spec = drafts.shape
  positions = num_spec + 1
  in_prefix = _prefix_mask(drafts, view.num_drafts)  # [R', P]
  view_drafts = repeat_rows(drafts, positions)  # [R', P]
  repeated = jax.tree.map(lambda a: repeat_rows(a, positions), state)
  # Output counts plus the draft prefix, elementwise (fused into the penalty pass, no scatter).
  vocab_ids = jnp.arange(state.vocab_size, dtype=jnp.int32)[None, :]
  prefix_counts = sum(
    ((view_drafts[:, i : i + 1] == vocab_ids) & in_prefix[:, i : i + 1]).astype(jnp.int32)
    for i in range(num_spec)
  )
  columns = jnp.where(
    in_prefix, repeated.num_tokens[:, None] + jnp.arange(num_spec), state.max_model_len
  )
  row_ids = jnp.arange(rows * positions)[:, None]
  processor_states = jax.tree.map(
    lambda a: jnp.swapaxes(a, 0, 1).reshape(rows * positions, *a.shape[2:]), view.processor_states
  )
  return dataclasses.replace(
    repeated,
    token_ids=repeated.token_ids.at[row_ids, columns].set(view_drafts, mode="drop"),
    num_tokens=repeated.num_tokens + jnp.tile(jnp.arange(positions, dtype=jnp.int32), rows),
    output_token_counts=repeated.output_token_counts + prefix_counts,
    logits_processor_states=processor_states,
    config=view.config,
  )


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

  Eager work: the `[R * (P + 1)]` metadata and the processors' states after each prefix (a
  `lax.scan` of `update_state` over the `P` drafts). The view's state is built where it is read.
  """
  positions = drafts.shape[1] + 1
  j = jnp.arange(positions)
  live = (md.is_live[:, None] & (j[None, :] <= num_drafts[:, None])).reshape(-1)
  return PositionView(
    base=state,
    metadata=_expand_metadata(md, positions, live),
    drafts=drafts,
    num_drafts=num_drafts,
    processor_states=prefix_processor_states(state, md, drafts, num_drafts),
  )
