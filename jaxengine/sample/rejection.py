"""Speculative decoding: vLLM V1's rejection sampler on the persistent batch (`docs/sampling.md` §1.4).

`rejection_sample(state, metadata, target_logits, draft_token_ids, num_draft_tokens, draft_probs)`
verifies each row's `n <= P` draft tokens against the target model's logits at `P + 1` positions
(shape legend: `R` rows, `P` draft positions per row, `V` vocabulary):

  1. Every position is processed as the main sampler would process the row at that point
     (`spec_history.py`): position `j` sees the request's output plus drafts `[0, j)` as history
     (penalties, bad words, min_tokens by count, custom processors' states), and every sampling
     parameter applies: allowed ids, logit_bias, min_p, top-k, top-p, temperature.
  2. Greedy rows walk the positions: emit the target argmax at each; stop after the first
     position whose draft differs from it (that position still emits the argmax).
  3. Random rows accept draft `d` at position `j` with probability `min(1, p_target(d) /
     p_draft(d))` and at the first rejection emit a recovered token drawn from
     `normalize(max(p_target - p_draft, 0))`, then stop. So every emitted token follows the
     target distribution whatever the drafts (Leviathan et al. 2023; Chen et al. 2023).
  4. A row whose every draft is accepted emits a bonus token drawn at position `n`.

How (random rows):
  - point-mass drafts (`draft_probs` None, e.g. n-gram): every position draws a token with
    `sample`'s own code and key; the draft is accepted when the position drew it, and the first
    position that drew another token emits that token (it is distributed as `p_target` without
    `d`, renormalised: vLLM's recovered distribution). This needs no probabilities at all, costs
    what `sample` costs per position, and makes each emitted token the very token `sample` would
    have drawn at that point: a row with no drafts emits `sample`'s token.
  - drafts with probabilities: the acceptance test `p_target(d) >= u * p_draft(d)` with its own
    uniform `u` (a draft with `p_target(d) = 0` or `p_draft(d) = 0` is rejected), each
    position's exact kept distribution (the processed_* modes' exact top-p cut), and the
    residual drawn from the candidates when the kept set lies inside them (else the vocabulary).

Keys: position `j` of a row uses `fold_in(request_key, num_output_tokens + j)`, the key `sample`
would use for that output token: its draw gives the position's token; the acceptance uniform
comes from `fold_in(that key, ACCEPT_SALT)`. A row's tokens depend on its own inputs only.

Beyond vLLM (which refuses min_p, logit_bias and min_tokens with drafts) every parameter is
supported, custom `LogitsProcessor`s included (their state advances one step per draft). Rows
with structured outputs ignore their drafts: the grammar bitmask covers one position, so such a
row emits one token, as `sample` would."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample.custom import (
  update_processor_states,
)
from jaxengine.sample.logprobs import LogprobsTensors, gather_logprobs, logprobs_scores
from jaxengine.sample.metadata import SamplingMetadata
from jaxengine.sample.spec_history import PositionView, expand_positions
from jaxengine.sample.spec_probs import Target, draw_exact, recovered, row_at, target_probability
from jaxengine.sample.state import BatchState
from jaxengine.sample.step import (
  draw_tokens,
  drawable_logits,
  repair_degenerate_rows,
  row_step_keys,
)

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


def _draw(logits, x, view: PositionView) -> tuple[jax.Array, jax.Array]:
  """`sample`'s stages 7-12 at every position: `(drawn [R'] int32, threshold [R'] float32)`.

  `sample`'s own code (greedy argmax, argmax-invariant processors, min-p / top-k / top-p cut,
  inverse-CDF draw with the position's key, NaN as `-inf`, repair of degenerate rows), so
  position `j` draws exactly the token `sample` would draw there; the threshold is exact in the
  processed_* logprobs modes, as `sample`'s.
  """
  state, md = view.state, view.metadata
  drawn, threshold, row_max = draw_tokens(x, state, md)
  return repair_degenerate_rows(logits, x, drawn, row_max, state, md), threshold


def _accepted(view, target: Target | None, drawn, drafts, num_drafts, draft_probs, accept_u):
  """`[R, P + 1] bool` whether the draft at each position is accepted (False at `j >= n`).

  Point-mass drafts (`draft_probs` None): accepted when the position drew the draft itself.
  That is vLLM's rule in distribution: accepted with probability `p_target(d)`, and a position
  that drew another token drew it from `p_target` without `d`, renormalised: the recovered
  token. Greedy rows draw their argmax: the greedy walk.
  """
  rows, num_spec = drafts.shape
  positions = num_spec + 1
  md = view.metadata
  vocab = view.base.vocab_size
  padded = jnp.concatenate([drafts, jnp.full((rows, 1), -1, drafts.dtype)], 1).reshape(-1)
  valid = (padded >= 0) & (padded < vocab)
  safe = jnp.clip(padded, 0, vocab - 1)
  accept = valid & (safe == drawn)
  if draft_probs is not None:
    assert target is not None
    # A point-mass target (greedy rows, an infinite logit, nothing kept) accepts only its token.
    point_mass = md.is_greedy | ~jnp.isfinite(target.row_max) | ~(target.mass > 0)
    p_target = target_probability(target, md, safe)
    # p_draft(d) gathered in place ([R, P, V] is never copied); the bonus position has none.
    position = jnp.minimum(jnp.arange(positions), num_spec - 1)[None, :]
    p_draft = draft_probs[jnp.arange(rows)[:, None], position, safe.reshape(rows, positions)]
    p_draft = p_draft.reshape(-1).astype(jnp.float32)
    random_accept = (p_target > 0) & (p_draft > 0) & (p_target >= accept_u * p_draft)
    accept = jnp.where(point_mass, accept, valid & random_accept)
  j = jnp.arange(positions)[None, :]
  return accept.reshape(rows, positions) & (j < num_drafts[:, None])


def _final_tokens(view, target, drawn, accepted, drafts, num_drafts, draft_probs, u):
  """`(num_accepted [R] int32, final [R] int32)`: the recovered or bonus token of each row.

  The bonus token, and with point-mass drafts the recovered one too, is the token the position
  drew; with draft probabilities a random row that rejected draws from the residual.
  """
  positions = drafts.shape[1] + 1
  md = view.metadata
  num_accepted = jnp.cumprod(accepted, axis=1).sum(1).astype(jnp.int32)
  bonus = row_at(drawn, num_accepted, positions)
  if draft_probs is None:
    return num_accepted, bonus
  rejected = num_accepted < num_drafts
  point_mass = md.is_greedy | ~jnp.isfinite(target.row_max) | ~(target.mass > 0)
  recover = rejected & ~row_at(point_mass, num_accepted, positions)
  residual = lax.cond(
    recover.any(),
    lambda: recovered(target, md, num_accepted, recover, drafts, draft_probs, u, positions),
    lambda: jnp.full_like(bonus, -1),
  )
  return num_accepted, jnp.where(recover & (residual >= 0), residual, bonus)


def _logprobs(logits, x, view: PositionView, threshold, emitted) -> LogprobsTensors:
  """Logprobs of `emitted [R'] int32` at every position (same format as `sample`'s)."""
  config = view.config
  mode = config.logprobs_mode
  scores = logprobs_scores(logits, x, view.state, view.metadata, threshold, mode)
  return gather_logprobs(
    scores,
    emitted,
    config.num_top_logprobs,
    normalize=mode.endswith("logprobs"),
    fixed_order=config.batch_invariant,
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Inputs:
  """The drafts: `drafts [R, P] int32` as given (ids outside `[0, V)` are rejected),
  `num_drafts [R] int32` in `[0, P]`, `draft_probs` None or `[R, P, V]`."""

  drafts: jax.Array
  num_drafts: jax.Array
  draft_probs: jax.Array | None


def _verify(logits, x, view: PositionView, inputs: _Inputs):
  """Stages 7-13 at every position and the verification, on processed logits `x [R', V]`.

  Returns `(tokens [R, P + 1] int32, num_accepted [R] int32, final [R] int32, LogprobsTensors
  [R', k + 1])`: the accepted drafts then the final (recovered or bonus) token, 0 after it.
  """
  rows, num_spec = inputs.drafts.shape
  md = view.metadata
  step_keys, u = row_step_keys(view.state)
  accept_u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_SALT), ()))(
    step_keys
  )
  drafts, num_drafts, draft_probs = inputs.drafts, inputs.num_drafts, inputs.draft_probs
  target = None
  if draft_probs is None:
    drawn, threshold = _draw(logits, x, view)  # `sample`'s code: the same keys
  else:
    drawn, target = draw_exact(logits, x, view, step_keys, u)
    threshold = target.threshold
  accepted = _accepted(view, target, drawn, drafts, num_drafts, draft_probs, accept_u)
  num_accepted, final = _final_tokens(
    view, target, drawn, accepted, drafts, num_drafts, draft_probs, u
  )
  j = jnp.arange(num_spec + 1)[None, :]
  padded = jnp.concatenate([view.drafts, jnp.zeros((rows, 1), jnp.int32)], 1)
  at_final = jnp.where(j == num_accepted[:, None], final[:, None], 0)
  tokens = jnp.where(j < num_accepted[:, None], padded, at_final)
  config = view.config
  logprobs = lax.cond(
    md.any_logprobs,
    lambda: _logprobs(logits, x, view, threshold, tokens.reshape(-1)),
    lambda: LogprobsTensors.zeros(rows * (num_spec + 1), config.num_top_logprobs),
  )
  return tokens, num_accepted, final, logprobs


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

  vLLM V1's rejection sampler (`docs/sampling.md` §1.4) with the main sampler's processors at every
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
  draft_probs = draft_probs if num_spec else None  # no draft position: nothing to verify
  drafts = jnp.clip(draft_token_ids.astype(jnp.int32), 0, vocab - 1)
  num_drafts = jnp.clip(num_draft_tokens.astype(jnp.int32), 0, num_spec)
  num_drafts = jnp.where(state.has_grammar, 0, num_drafts)
  view = expand_positions(state, metadata, drafts, num_drafts)
  logits = target_logits.reshape(rows * positions, vocab)
  inputs = _Inputs(
    drafts=draft_token_ids.astype(jnp.int32), num_drafts=num_drafts, draft_probs=draft_probs
  )
  # One copy of the verification, on `sample`'s drawable logits (processed, NaN as -inf).
  x = drawable_logits(logits, view.state, view.metadata)
  tokens, num_accepted, final, logprobs = _verify(logits, x, view, inputs)
  j = jnp.arange(positions)[None, :]
  room = jnp.maximum(state.max_model_len - state.num_tokens, 0)
  num_sampled = jnp.where(metadata.is_live, jnp.minimum(num_accepted + 1, room), 0)
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
