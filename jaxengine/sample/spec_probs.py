"""Drafts with probabilities: the target distribution at every draft position, acceptance
probabilities and the residual draw of vLLM's rejection sampler (`docs/sampling.md` §1.4).

Point-mass drafts (n-gram) need none of this (`rejection.py` verifies them with `sample`'s own
draws). A draft model's `draft_probs [R, P, V]` need each position's kept target distribution:
the exact min-p / top-k / top-p cut (the processed_* modes' exact top-p), its mass (from the
candidates when the kept set lies inside them, else one exponential pass), `p_target(d)`, and the
residual `normalize(max(p_target - p_draft, 0))` drawn by inverse CDF. Shape legend: `R` rows,
`P` draft positions, `R' = R * (P + 1)` positions, `C` candidates, `V` vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample.blocked import block_width, blocked_argmax, blocks
from jaxengine.sample.custom import apply_invariant_processors, has_processors
from jaxengine.sample.draw import VocabCdf, draw_from_cdf, inverse_cdf, weigh
from jaxengine.sample.filters import Candidates, find_candidates
from jaxengine.sample.metadata import SamplingMetadata, inverse_temperature
from jaxengine.sample.spec_history import PositionView
from jaxengine.sample.step import repair_degenerate_rows, sample_random_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
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
  """`(tokens, Target fields)` for the random rows: `sample`'s draw with the exact cut, and the
  kept mass from the candidates (one exponential pass over the vocabulary only for rows whose
  kept set reaches beyond them, e.g. plain temperature sampling)."""
  tokens, threshold, row_max = sample_random_rows(
    x, md, step_keys, u, config.candidate_budgets, exact_top_p=True
  )
  candidates = find_candidates(x, md, config.num_candidates)
  inside = (threshold > candidates.last) | (config.num_candidates >= x.shape[1])
  mass = weigh(candidates.values, row_max, threshold).sum(-1)
  outside = md.is_live & ~md.is_greedy & ~inside
  full_mass = lambda: weigh(x * inverse_temperature(md)[:, None], row_max, threshold).sum(-1)
  mass = lax.cond(outside.any(), lambda: jnp.where(inside, mass, full_mass()), lambda: mass)
  fields = dict(
    row_max=row_max, threshold=threshold, mass=mass, candidates=candidates, inside=inside
  )
  return tokens, fields


def draw_exact(logits, x, view: PositionView, step_keys, u) -> tuple[jax.Array, Target]:
  """Stages 7-12 at every position with the whole target distribution, for drafts with
  probabilities: `(drawn [R'] int32, Target)`.

  As `rejection._draw` (`sample`'s code), but with the exact top-p cut of the processed_* modes
  for every row (acceptance needs each position's distribution); `x` comes from
  `step.drawable_logits`, NaN already read as `-inf`. So a position draws `sample`'s token,
  except a top-p row whose nucleus is deeper than the candidates in the raw_* modes (`sample`
  draws it by rejection: an equally exact draw).
  """
  md = view.metadata
  rows, config = x.shape[0], view.config
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
  target = Target(x=x_random, **fields)  # `x` never leaves a branch: that would cost a copy
  drawn = jnp.where(md.is_greedy, greedy, random)
  drawn = repair_degenerate_rows(logits, x, drawn, target.row_max, view.state, md)
  return drawn, target


def target_probability(target: Target, md: SamplingMetadata, tokens) -> jax.Array:
  """`[R'] float32` the target probability of `tokens [R'] int32` (in `[0, V)`)."""
  y = jnp.take_along_axis(target.x, tokens[:, None], 1)[:, 0] * inverse_temperature(md)
  weight = jnp.where(y >= target.threshold, jnp.exp(y - target.row_max), 0.0)
  return weight / target.mass


def row_at(a: jax.Array, index: jax.Array, positions: int) -> jax.Array:
  """`a [R * positions, ...]` at position `index [R]` of each row: `[R, ...]`."""
  flat = jnp.arange(index.shape[0]) * positions + index
  return a[flat]


def _residual(weights, mass, ids, row_probs):
  """`[R, n]` `max(p_target - p_draft, 0)` over tokens `ids [R, n]` of kept weights
  `weights [R, n]` (`mass [R]` their normaliser, `row_probs [R, V]` the draft's)."""
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


def recovered(target: Target, md, at, recover, drafts, draft_probs, u, positions) -> jax.Array:
  """`[R] int32` each row's draw from `normalize(max(p_target - p_draft, 0))` at position `at`
  (meaningful where `recover`; `-1` where that residual has no mass).

  The residual lies inside the kept set, so a row whose kept set lies inside its candidates
  draws from them; the others (under `lax.cond`) from the vocabulary.
  """
  rows, vocab = at.shape[0], target.x.shape[1]
  pick = lambda a: row_at(a, at, positions)
  row_max, threshold, mass = pick(target.row_max), pick(target.threshold), pick(target.mass)
  row_probs = draft_probs[jnp.arange(rows), jnp.minimum(at, drafts.shape[1] - 1)]
  u = pick(u)
  ids, values = pick(target.candidates.ids), pick(target.candidates.values)
  residual = _residual(weigh(values, row_max, threshold), mass, ids, row_probs)
  total = residual.sum(-1)
  chosen = jnp.take_along_axis(ids, inverse_cdf(residual, u * total)[:, None], 1)[:, 0]
  from_candidates = jnp.where(total > 0, chosen, -1)
  inside = pick(target.inside)

  def from_vocab():
    weights = weigh(pick(target.x) * pick(inverse_temperature(md))[:, None], row_max, threshold)
    all_ids = jnp.broadcast_to(jnp.arange(vocab), (rows, vocab))
    return _vocab_draw(_residual(weights, mass, all_ids, row_probs), u)

  return lax.cond(
    (recover & ~inside).any(),
    lambda: jnp.where(inside, from_candidates, from_vocab()),
    lambda: from_candidates,
  )
