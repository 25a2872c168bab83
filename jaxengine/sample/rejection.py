"""Speculative decoding: vLLM V1's rejection sampler on the persistent batch (`behaviour.md` §1.7).

`rejection_sample(state, metadata, target_logits, draft_token_ids, num_draft_tokens, draft_probs)`
verifies each row's `n <= P` draft tokens against the target model's logits at `P + 1` positions
(shape legend: `R` rows, `P` draft positions per row, `V` vocabulary):

  1. Every position is processed as the main sampler would process the row at that point
     (`spec_history.py`): position `j` sees the request's output plus drafts `[0, j)` as history
     (penalties, bad words, min_tokens by count, custom processors' states), and every sampling
     parameter applies: allowed ids, logit_bias, min_p, top-k, top-p, temperature.
  2. Greedy rows walk the positions: emit the target argmax at each; stop after the first
     position whose draft differs from it (that position still emits the argmax).
  3. Random rows accept draft `d` at position `j` when `p_target(d) >= u * p_draft(d)` with one
     uniform `u` per position (`p_draft` is a point mass on `d` without `draft_probs`; a draft
     with `p_draft(d) = 0` or `p_target(d) = 0` is rejected). At the first rejection the row emits
     a recovered token drawn from `normalize(max(p_target - p_draft, 0))` and stops.
  4. A row whose every draft is accepted emits a bonus token drawn from position `n` exactly as
     `sample` draws: a row with no drafts emits the very token `sample` would emit.

Keys: position `j` of a row uses `fold_in(request_key, num_output_tokens + j)`, the key `sample`
would use for that output token. Its uniform draws the bonus or recovered token; the acceptance
uniform comes from `fold_in(that key, ACCEPT_SALT)`. A row's tokens depend on its own inputs only.

Beyond vLLM (which refuses min_p, logit_bias and min_tokens with drafts) every parameter is
supported. Rows with structured outputs ignore their drafts: the grammar bitmask covers one
position, so such a row emits one token as `sample` would.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample.blocked import block_width, blocked_argmax, blocks
from jaxengine.sample.custom import (
  apply_invariant_processors,
  has_processors,
  update_processor_states,
)
from jaxengine.sample.draw import VocabCdf, draw_from_cdf
from jaxengine.sample.logprobs import LogprobsTensors, gather_logprobs, logprobs_scores
from jaxengine.sample.metadata import SamplingMetadata, inverse_temperature
from jaxengine.sample.processors import (
  NEG_INF,
  any_processing,
  apply_logits_processors,
  nan_as_neg_inf,
)
from jaxengine.sample.spec_history import PositionView, expand_positions
from jaxengine.sample.state import BatchState
from jaxengine.sample.step import _repair_degenerate_rows, _sample_random, _step_keys

#: `fold_in` data deriving a position's acceptance key from its draw key (top-p retries use
#: small attempt numbers, so this never collides with them).
ACCEPT_SALT = 0x5EC0DE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RejectionOutput:
  """What `rejection_sample` returns: device arrays over all `R` rows.

  Attributes:
    sampled_token_ids: `[R, P + 1] int32` per row the accepted drafts, then one recovered or
      bonus token, then `-1` (vLLM's layout). Rows that are not live: all `-1`.
    num_sampled: `[R] int32` tokens emitted (and appended) per row, 0 for rows that are not live.
    logprobs: `LogprobsTensors` per emitted position: `token_ids` and `logprobs`
      `[R, P + 1, k + 1]`, `ranks` `[R, P + 1]` (garbage past `num_sampled`; zeros when no live
      row asked for logprobs).
  """

  sampled_token_ids: jax.Array
  num_sampled: jax.Array
  logprobs: LogprobsTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Target:
  """The target distribution at every position (rows of the position view, `R * (P + 1)`).

  Attributes:
    x: `[R', V] float32` processed logits (NaN as `-inf`, argmax-invariant processors applied).
    row_max: `[R'] float32` largest scaled logit `y = x / T`.
    threshold: `[R'] float32` exact kept threshold on `y` (min-p, top-k, top-p).
    mass: `[R'] float32` kept mass `sum exp(y - row_max)` over `y >= threshold`.
  """

  x: jax.Array
  row_max: jax.Array
  threshold: jax.Array
  mass: jax.Array


def _draw(logits, x, view: PositionView, step_keys, u) -> tuple[jax.Array, _Target]:
  """Stages 7-12 at every position: `(drawn [R'] int32, the target distribution)`.

  As `sample` draws (greedy argmax, argmax-invariant processors, min-p / top-k / top-p cut and
  inverse-CDF draw, repair of degenerate rows), with the exact top-p cut of the processed_*
  modes for every row, since acceptance needs each position's whole distribution. NaN logits
  count as `-inf` up front. So a position draws `sample`'s token, except a top-p row whose
  nucleus is deeper than the candidates in the raw_* modes (`sample` draws it by rejection: an
  equally exact draw from the same distribution, with another token).
  """
  state, md = view.state, view.metadata
  rows = x.shape[0]
  x = nan_as_neg_inf(x)
  greedy = lax.cond(md.any_greedy, lambda: blocked_argmax(x), lambda: jnp.zeros((rows,), jnp.int32))
  x_random = x
  if has_processors(state.config, argmax_invariant=True):
    x_random = apply_invariant_processors(x, state, md, inverse_temperature(md))
  budgets = state.config.candidate_budgets
  random, threshold, row_max = lax.cond(
    md.any_random,
    lambda: _sample_random(x_random, md, step_keys, u, budgets, exact_top_p=True),
    lambda: (jnp.zeros((rows,), jnp.int32), jnp.full((rows,), NEG_INF), x_random.max(-1)),
  )
  drawn = jnp.where(md.is_greedy, greedy, random)
  drawn = _repair_degenerate_rows(logits, x, drawn, row_max, state, md)
  weights = _weigh(x_random * inverse_temperature(md)[:, None], row_max, threshold)
  target = _Target(x=x_random, row_max=row_max, threshold=threshold, mass=weights.sum(-1))
  return drawn, target


def _weigh(y, row_max, threshold):
  """`[R, V]` unnormalised kept probabilities `exp(y - row_max)` where `y >= threshold`."""
  return jnp.where(y >= threshold[:, None], jnp.exp(y - row_max[:, None]), 0.0)


def _target_probability(target: _Target, md: SamplingMetadata, tokens) -> jax.Array:
  """`[R'] float32` the target probability of `tokens [R'] int32` (in `[0, V)`)."""
  y = jnp.take_along_axis(target.x, tokens[:, None], 1)[:, 0] * inverse_temperature(md)
  weight = jnp.where(y >= target.threshold, jnp.exp(y - target.row_max), 0.0)
  return weight / target.mass


def _accepted(view, target: _Target, drawn, drafts, num_drafts, draft_probs, accept_u):
  """`[R, P + 1] bool` whether the draft at each position is accepted (False at `j >= n`)."""
  rows, num_spec = drafts.shape
  positions = num_spec + 1
  md = view.metadata
  vocab = view.state.vocab_size
  padded = jnp.concatenate([drafts, jnp.full((rows, 1), -1, drafts.dtype)], 1).reshape(-1)
  valid = (padded >= 0) & (padded < vocab)
  safe = jnp.clip(padded, 0, vocab - 1)
  # A point-mass target (greedy rows, an infinite logit, nothing kept) accepts only its token.
  point_mass = md.is_greedy | ~jnp.isfinite(target.row_max) | ~(target.mass > 0)
  p_target = _target_probability(target, md, safe)
  if draft_probs is None:
    p_draft = jnp.ones_like(p_target)
  else:
    flat = jnp.concatenate([draft_probs, jnp.zeros((rows, 1, vocab), draft_probs.dtype)], 1)
    flat = flat.reshape(rows * positions, vocab)
    p_draft = jnp.take_along_axis(flat, safe[:, None], 1)[:, 0].astype(jnp.float32)
  random_accept = (p_target > 0) & (p_draft > 0) & (p_target >= accept_u * p_draft)
  accept = valid & jnp.where(point_mass, safe == drawn, random_accept)
  j = jnp.arange(positions)[None, :]
  return accept.reshape(rows, positions) & (j < num_drafts[:, None])


def _row_at(a: jax.Array, index: jax.Array, positions: int) -> jax.Array:
  """`a [R * positions, ...]` at position `index [R]` of each row: `[R, ...]`."""
  flat = jnp.arange(index.shape[0]) * positions + index
  return a[flat]


def _recovered(target: _Target, md, at, drafts, draft_probs, u, positions):
  """`[R] int32` each row's draw from `normalize(max(p_target - p_draft, 0))` at position `at`
  (meaningful where a draft was rejected there; `-1` where that residual has no mass)."""
  rows, vocab = at.shape[0], target.x.shape[1]
  pick = lambda a: _row_at(a, at, positions)
  inv_t = pick(inverse_temperature(md))
  weights = _weigh(pick(target.x) * inv_t[:, None], pick(target.row_max), pick(target.threshold))
  draft = jnp.take_along_axis(drafts, jnp.minimum(at, drafts.shape[1] - 1)[:, None], 1)
  if draft_probs is None:
    residual = jnp.where(jnp.arange(vocab)[None, :] == draft, 0.0, weights)
  else:
    row_probs = draft_probs[jnp.arange(rows), jnp.minimum(at, drafts.shape[1] - 1)]
    p_target = weights / pick(target.mass)[:, None]
    residual = jnp.maximum(p_target - row_probs.astype(jnp.float32), 0.0)
  width = block_width(vocab)
  weight_blocks = blocks(residual, width, 0.0)
  block_mass = weight_blocks.sum(-1)
  cdf = VocabCdf(
    weights=residual,
    blocks=weight_blocks,
    block_mass=block_mass,
    block_cumulative=jnp.cumsum(block_mass, -1),
    width=width,
  )
  return jnp.where(cdf.total > 0, draw_from_cdf(cdf, pick(u)), -1)


def _final_tokens(view, target, drawn, accepted, drafts, num_drafts, draft_probs, u):
  """`(num_accepted [R] int32, final [R] int32)`: the recovered or bonus token of each row."""
  positions = drafts.shape[1] + 1
  md = view.metadata
  num_accepted = jnp.cumprod(accepted, axis=1).sum(1).astype(jnp.int32)
  bonus = _row_at(drawn, num_accepted, positions)
  rejected = num_accepted < num_drafts
  point_mass = md.is_greedy | ~jnp.isfinite(target.row_max) | ~(target.mass > 0)
  recover = rejected & ~_row_at(point_mass, num_accepted, positions)
  recovered = lax.cond(
    recover.any(),
    lambda: _recovered(target, md, num_accepted, drafts, draft_probs, u, positions),
    lambda: jnp.full_like(bonus, -1),
  )
  return num_accepted, jnp.where(recover & (recovered >= 0), recovered, bonus)


def _logprobs(logits, x, view: PositionView, threshold, emitted) -> LogprobsTensors:
  """Logprobs of `emitted [R'] int32` at every position (same format as `sample`'s)."""
  config = view.state.config
  mode = config.logprobs_mode
  scores = logprobs_scores(logits, x, view.metadata, threshold, mode)
  return gather_logprobs(
    scores, emitted, config.num_top_logprobs, normalize=mode.endswith("logprobs")
  )


def _append(state: BatchState, md, tokens, num_sampled, view: PositionView, final, num_accepted):
  """Appends each row's `num_sampled` first `tokens [R, P + 1]`; advances processor states."""
  rows, positions = tokens.shape
  j = jnp.arange(positions)[None, :]
  columns = jnp.where(j < num_sampled[:, None], state.num_tokens[:, None] + j, state.max_model_len)
  counted = jnp.where(j < num_sampled[:, None], tokens, state.vocab_size)
  row_ids = jnp.arange(rows)[:, None]
  new = dataclasses.replace(
    state,
    token_ids=state.token_ids.at[row_ids, columns].set(tokens, mode="drop"),
    num_tokens=state.num_tokens + num_sampled,
    output_token_counts=state.output_token_counts.at[row_ids, counted].add(1, mode="drop"),
  )
  if not state.config.logits_processors:
    return new
  # The state after the drafts kept, then one more update for the final token if appended.
  kept = jnp.minimum(num_sampled, num_accepted)
  prefix = jax.tree.map(lambda a: a[kept, jnp.arange(rows)], view.processor_states)
  at_prefix = dataclasses.replace(state, logits_processor_states=prefix)
  appended = md.is_live & (num_sampled > num_accepted)
  states = update_processor_states(at_prefix, md, final, appended)
  return dataclasses.replace(new, logits_processor_states=states)


def _check_shapes(state: BatchState, target_logits, draft_token_ids, num_draft_tokens, draft_probs):
  rows, vocab = state.max_num_reqs, state.vocab_size
  if draft_token_ids.ndim != 2 or draft_token_ids.shape[0] != rows:
    raise ValueError(f"draft_token_ids must have shape [R={rows}, P], got {draft_token_ids.shape}")
  num_spec = draft_token_ids.shape[1]
  expected = {
    "target_logits": (target_logits.shape, (rows, num_spec + 1, vocab)),
    "num_draft_tokens": (num_draft_tokens.shape, (rows,)),
  }
  if draft_probs is not None:
    expected["draft_probs"] = (draft_probs.shape, (rows, num_spec, vocab))
  for name, (shape, want) in expected.items():
    if tuple(shape) != want:
      raise ValueError(f"{name} must have shape {want}, got {tuple(shape)}")


def rejection_sample(
  state: BatchState,
  metadata: SamplingMetadata,
  target_logits: jax.Array,
  draft_token_ids: jax.Array,
  num_draft_tokens: jax.Array,
  draft_probs: jax.Array | None = None,
) -> tuple[BatchState, RejectionOutput]:
  """Verifies draft tokens against the target model and appends the emitted tokens (unjitted).

  vLLM V1's rejection sampler (`behaviour.md` §1.7) with the main sampler's processors at every
  position; see the module docstring. `rejection_sample_step` is the same function jitted with
  `state` donated; call this one inside your own `jax.jit`.

  Args:
    state: the batch state.
    metadata: `refresh_metadata(state, is_live)`.
    target_logits: `[R, P + 1, V]` float logits of the target model at each draft position and
      the bonus position (any float dtype; computed in float32).
    draft_token_ids: `[R, P] int32` drafts (entries past `num_draft_tokens` are ignored; an id
      outside `[0, V)` is always rejected).
    num_draft_tokens: `[R] int32` in `[0, P]` real drafts per row (rows with structured outputs
      count as 0).
    draft_probs: None (point-mass drafts, e.g. n-gram) or `[R, P, V] float32` the draft model's
      probabilities at each position.

  Returns:
    `(new_state, RejectionOutput)`. `new_state` has every emitted token appended (tokens,
    counts, `num_tokens`, so the next step's keys advance; custom processor states updated once
    per token). A row never grows beyond `max_model_len`: it emits only as many tokens as fit
    (its accepted drafts first, so the recovered or bonus token is the one dropped), and a full
    row emits none.

  Raises:
    ValueError: at trace time, for arrays of other shapes.
  """
  _check_shapes(state, target_logits, draft_token_ids, num_draft_tokens, draft_probs)
  rows, num_spec = draft_token_ids.shape
  positions, vocab = num_spec + 1, state.vocab_size
  drafts = jnp.clip(draft_token_ids.astype(jnp.int32), 0, vocab - 1)
  num_drafts = jnp.clip(num_draft_tokens.astype(jnp.int32), 0, num_spec)
  num_drafts = jnp.where(state.has_grammar, 0, num_drafts)
  view = expand_positions(state, metadata, drafts, num_drafts)
  view_state, md = view.state, view.metadata
  logits = target_logits.reshape(rows * positions, vocab)
  x = lax.cond(
    any_processing(md, view_state.config),
    lambda: apply_logits_processors(logits, view_state, md),
    lambda: logits.astype(jnp.float32),
  )
  step_keys, u = _step_keys(view_state)
  accept_u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_SALT), ()))(
    step_keys
  )
  drawn, target = _draw(logits, x, view, step_keys, u)
  raw_drafts = draft_token_ids.astype(jnp.int32)
  accepted = _accepted(view, target, drawn, raw_drafts, num_drafts, draft_probs, accept_u)
  num_accepted, final = _final_tokens(
    view, target, drawn, accepted, raw_drafts, num_drafts, draft_probs, u
  )
  j = jnp.arange(positions)[None, :]
  padded = jnp.concatenate([drafts, jnp.zeros((rows, 1), jnp.int32)], 1)
  at_final = jnp.where(j == num_accepted[:, None], final[:, None], 0)
  tokens = jnp.where(j < num_accepted[:, None], padded, at_final)
  room = jnp.maximum(state.max_model_len - state.num_tokens, 0)
  num_sampled = jnp.where(metadata.is_live, jnp.minimum(num_accepted + 1, room), 0)
  logprobs = lax.cond(
    metadata.any_logprobs,
    lambda: _logprobs(logits, x, view, target.threshold, tokens.reshape(-1)),
    lambda: LogprobsTensors.zeros(rows * positions, state.config.num_top_logprobs),
  )
  logprobs = jax.tree.map(lambda a: a.reshape(rows, positions, *a.shape[1:]), logprobs)
  new_state = _append(state, metadata, tokens, num_sampled, view, final, num_accepted)
  output = RejectionOutput(
    sampled_token_ids=jnp.where(j < num_sampled[:, None], tokens, -1),
    num_sampled=num_sampled,
    logprobs=logprobs,
  )
  return new_state, output


#: `rejection_sample` jitted with `state` donated (do not read it after the call). One executable
#: per `(BatchConfig, P)` (and whether `draft_probs` is given): any mix of draft counts, greedy
#: and random, seeded and unseeded rows reuses it.
rejection_sample_step = jax.jit(rejection_sample, donate_argnames=("state",))
