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

from jaxengine.sample.blocked import block_width, blocked_argmax, blocks
from jaxengine.sample.custom import (
  apply_invariant_processors,
  has_processors,
  update_processor_states,
)
from jaxengine.sample.draw import VocabCdf, draw_from_cdf, inverse_cdf
from jaxengine.sample.filters import Candidates, find_candidates
from jaxengine.sample.logprobs import LogprobsTensors, gather_logprobs, logprobs_scores
from jaxengine.sample.metadata import SamplingMetadata, inverse_temperature
from jaxengine.sample.processors import (
  any_processing,
  apply_logits_processors,
  nan_as_neg_inf,
)
from jaxengine.sample.spec_history import PositionView, expand_positions
from jaxengine.sample.state import BatchState
from jaxengine.sample.step import (
  _draw_tokens_nan_as_neg_inf,
  _repair_degenerate_rows,
  _sample_random,
  _step_keys,
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Target:
  """The target distribution at every position (rows of the position view, `R' = R * (P + 1)`).

  Attributes:
    x: `[R', V] float32` processed logits (NaN as `-inf`, argmax-invariant processors applied).
    row_max: `[R'] float32` largest scaled logit `y = x / T`.
    threshold: `[R'] float32` exact kept threshold on `y` (min-p, top-k, top-p).
    mass: `[R'] float32` kept mass `sum exp(y - row_max)` over `y >= threshold`.
    candidates: the `C` largest `y` of each row (`Candidates`, `[R', C]`).
    inside: `[R'] bool` the kept set lies inside the candidates (its threshold is above the
      last one), so its mass and draws need no pass over the vocabulary.
  """

  x: jax.Array
  row_max: jax.Array
  threshold: jax.Array
  mass: jax.Array
  candidates: Candidates
  inside: jax.Array


def _random_target(x, md: SamplingMetadata, step_keys, u, config):
  """`(tokens, _Target fields)` for the random rows: `sample`'s draw with the exact cut, and the
  kept mass from the candidates (one exponential pass over the vocabulary only for rows whose
  kept set reaches beyond them, e.g. plain temperature sampling)."""
  tokens, threshold, row_max = _sample_random(
    x, md, step_keys, u, config.candidate_budgets, exact_top_p=True
  )
  candidates = find_candidates(x, md, config.num_candidates)
  inside = (threshold > candidates.last) | (config.num_candidates >= x.shape[1])
  mass = _weigh(candidates.values, row_max, threshold).sum(-1)
  outside = md.is_live & ~md.is_greedy & ~inside
  full_mass = lambda: _weigh(x * inverse_temperature(md)[:, None], row_max, threshold).sum(-1)
  mass = lax.cond(outside.any(), lambda: jnp.where(inside, mass, full_mass()), lambda: mass)
  fields = dict(
    row_max=row_max, threshold=threshold, mass=mass, candidates=candidates, inside=inside
  )
  return tokens, fields


def _draw(logits, x, view: PositionView, step_keys, u) -> tuple[jax.Array, jax.Array]:
  """`sample`'s stages 7-12 at every position: `(drawn [R'] int32, threshold [R'] float32)`.

  `sample`'s own code (greedy argmax, argmax-invariant processors, min-p / top-k / top-p cut,
  inverse-CDF draw with the position's key, NaN as `-inf`, repair of degenerate rows), so
  position `j` draws exactly the token `sample` would draw there; the threshold is exact in the
  processed_* logprobs modes, as `sample`'s.
  """
  del step_keys, u  # `sample`'s code derives the same keys from the view's state
  state, md = view.state, view.metadata
  drawn, threshold, row_max = _draw_tokens_nan_as_neg_inf(x, state, md)
  return _repair_degenerate_rows(logits, x, drawn, row_max, state, md), threshold


def _draw_exact(logits, x, view: PositionView, step_keys, u) -> tuple[jax.Array, _Target]:
  """Stages 7-12 at every position with the whole target distribution, for drafts with
  probabilities: `(drawn [R'] int32, _Target)`.

  As `_draw`, but with the exact top-p cut of the processed_* modes for every row (acceptance
  needs each position's distribution) and NaN logits cleaned up front. So a position draws
  `sample`'s token, except a top-p row whose nucleus is deeper than the candidates in the raw_*
  modes (`sample` draws it by rejection: an equally exact draw from the same distribution).
  """
  md = view.metadata
  rows, config = x.shape[0], view.config
  x = nan_as_neg_inf(x)
  greedy = lax.cond(md.any_greedy, lambda: blocked_argmax(x), lambda: jnp.zeros((rows,), jnp.int32))
  x_random = x
  if has_processors(config, argmax_invariant=True):
    x_random = apply_invariant_processors(x, view.state, md, inverse_temperature(md))

  def no_random():
    num_candidates, zeros = config.num_candidates, jnp.zeros((rows,))
    candidates = Candidates(
      values=jnp.zeros((rows, num_candidates)), ids=jnp.zeros((rows, num_candidates), jnp.int32)
    )
    fields = dict(
      row_max=zeros, threshold=zeros, mass=zeros, candidates=candidates, inside=zeros > 0
    )
    return jnp.zeros((rows,), jnp.int32), fields

  random, fields = lax.cond(
    md.any_random, lambda: _random_target(x_random, md, step_keys, u, config), no_random
  )
  target = _Target(x=x_random, **fields)  # `x` never leaves a branch: that would cost a copy
  drawn = jnp.where(md.is_greedy, greedy, random)
  drawn = _repair_degenerate_rows(logits, x, drawn, target.row_max, view.state, md)
  return drawn, target


def _weigh(y, row_max, threshold):
  """`[R, n]` unnormalised kept probabilities `exp(y - row_max)` where `y >= threshold`."""
  return jnp.where(y >= threshold[:, None], jnp.exp(y - row_max[:, None]), 0.0)


def _target_probability(target: _Target, md: SamplingMetadata, tokens) -> jax.Array:
  """`[R'] float32` the target probability of `tokens [R'] int32` (in `[0, V)`)."""
  y = jnp.take_along_axis(target.x, tokens[:, None], 1)[:, 0] * inverse_temperature(md)
  weight = jnp.where(y >= target.threshold, jnp.exp(y - target.row_max), 0.0)
  return weight / target.mass


def _accepted(view, target: _Target | None, drawn, drafts, num_drafts, draft_probs, accept_u):
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
    p_target = _target_probability(target, md, safe)
    flat = jnp.concatenate([draft_probs, jnp.zeros((rows, 1, vocab), draft_probs.dtype)], 1)
    flat = flat.reshape(rows * positions, vocab)
    p_draft = jnp.take_along_axis(flat, safe[:, None], 1)[:, 0].astype(jnp.float32)
    random_accept = (p_target > 0) & (p_draft > 0) & (p_target >= accept_u * p_draft)
    accept = jnp.where(point_mass, accept, valid & random_accept)
  j = jnp.arange(positions)[None, :]
  return accept.reshape(rows, positions) & (j < num_drafts[:, None])


def _row_at(a: jax.Array, index: jax.Array, positions: int) -> jax.Array:
  """`a [R * positions, ...]` at position `index [R]` of each row: `[R, ...]`."""
  flat = jnp.arange(index.shape[0]) * positions + index
  return a[flat]


def _residual(weights, mass, ids, draft, row_probs):
  """`[R, n]` unnormalised `max(p_target - p_draft, 0)` over tokens `ids [R, n]` of kept
  weights `weights [R, n]`: the point-mass draft's token removed when `row_probs` is None."""
  if row_probs is None:
    return jnp.where(ids == draft[:, None], 0.0, weights)
  p_draft = jnp.take_along_axis(row_probs, ids, 1).astype(jnp.float32)
  return jnp.maximum(weights / mass[:, None] - p_draft, 0.0)


def _vocab_draw(weights, u):
  """`[R] int32` inverse-CDF draw over the vocabulary (blocked) from `weights [R, V]`."""
  width = block_width(weights.shape[1])
  weight_blocks = blocks(weights, width, 0.0)
  block_mass = weight_blocks.sum(-1)
  cdf = VocabCdf(
    weights=weights,
    blocks=weight_blocks,
    block_mass=block_mass,
    block_cumulative=jnp.cumsum(block_mass, -1),
    width=width,
  )
  return jnp.where(cdf.total > 0, draw_from_cdf(cdf, u), -1)


def _recovered(target: _Target, md, at, recover, drafts, draft_probs, u, positions):
  """`[R] int32` each row's draw from `normalize(max(p_target - p_draft, 0))` at position `at`
  (meaningful where `recover`; `-1` where that residual has no mass).

  The residual lies inside the kept set, so a row whose kept set lies inside its candidates
  draws from them; the others (under `lax.cond`) from the vocabulary.
  """
  rows, vocab = at.shape[0], target.x.shape[1]
  pick = lambda a: _row_at(a, at, positions)
  row_max, threshold, mass = pick(target.row_max), pick(target.threshold), pick(target.mass)
  index = jnp.minimum(at, drafts.shape[1] - 1)
  draft = jnp.take_along_axis(drafts, index[:, None], 1)[:, 0]
  row_probs = None if draft_probs is None else draft_probs[jnp.arange(rows), index]
  u = pick(u)
  ids, values = pick(target.candidates.ids), pick(target.candidates.values)
  residual = _residual(_weigh(values, row_max, threshold), mass, ids, draft, row_probs)
  total = residual.sum(-1)
  chosen = jnp.take_along_axis(ids, inverse_cdf(residual, u * total)[:, None], 1)[:, 0]
  from_candidates = jnp.where(total > 0, chosen, -1)
  inside = pick(target.inside)

  def from_vocab():
    weights = _weigh(pick(target.x) * pick(inverse_temperature(md))[:, None], row_max, threshold)
    all_ids = jnp.broadcast_to(jnp.arange(vocab), (rows, vocab))
    return _vocab_draw(_residual(weights, mass, all_ids, draft, row_probs), u)

  return lax.cond(
    (recover & ~inside).any(),
    lambda: jnp.where(inside, from_candidates, from_vocab()),
    lambda: from_candidates,
  )


def _final_tokens(view, target, drawn, accepted, drafts, num_drafts, draft_probs, u):
  """`(num_accepted [R] int32, final [R] int32)`: the recovered or bonus token of each row.

  The bonus token, and with point-mass drafts the recovered one too, is the token the position
  drew; with draft probabilities a random row that rejected draws from the residual.
  """
  positions = drafts.shape[1] + 1
  md = view.metadata
  num_accepted = jnp.cumprod(accepted, axis=1).sum(1).astype(jnp.int32)
  bonus = _row_at(drawn, num_accepted, positions)
  if draft_probs is None:
    return num_accepted, bonus
  rejected = num_accepted < num_drafts
  point_mass = md.is_greedy | ~jnp.isfinite(target.row_max) | ~(target.mass > 0)
  recover = rejected & ~_row_at(point_mass, num_accepted, positions)
  recovered = lax.cond(
    recover.any(),
    lambda: _recovered(target, md, num_accepted, recover, drafts, draft_probs, u, positions),
    lambda: jnp.full_like(bonus, -1),
  )
  return num_accepted, jnp.where(recover & (recovered >= 0), recovered, bonus)


def _logprobs(logits, x, view: PositionView, threshold, emitted) -> LogprobsTensors:
  """Logprobs of `emitted [R'] int32` at every position (same format as `sample`'s)."""
  config = view.config
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
  Only small arrays leave it, so it can be a `lax.cond` branch.
  """
  rows, num_spec = inputs.drafts.shape
  md = view.metadata
  step_keys, u = _step_keys(view.state)
  accept_u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_SALT), ()))(
    step_keys
  )
  drafts, num_drafts, draft_probs = inputs.drafts, inputs.num_drafts, inputs.draft_probs
  target = None
  if draft_probs is None:
    drawn, threshold = _draw(logits, x, view, step_keys, u)
  else:
    drawn, target = _draw_exact(logits, x, view, step_keys, u)
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
  logits = target_logits.reshape(rows * positions, vocab)
  inputs = _Inputs(
    drafts=draft_token_ids.astype(jnp.int32), num_drafts=num_drafts, draft_probs=draft_probs
  )
  # Two copies of the verification, as in `sample`: a branch returning `[R', V]` processed
  # logits would cost a copy of the logits when no row needs processing.
  tokens, num_accepted, final, logprobs = lax.cond(
    any_processing(view.metadata, view.config),
    lambda: _verify(
      logits, apply_logits_processors(logits, view.state, view.metadata), view, inputs
    ),
    lambda: _verify(logits, logits.astype(jnp.float32), view, inputs),
  )
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
