"""Stage 12 of the sampler: the random draw, one uniform per row, by inverse CDF.

A row keeps the tokens whose scaled logit `y` is at or above its threshold, weighted
`exp(y - max(y))`; the token is the first whose cumulative weight exceeds `u * total`. From the
candidates this is a cumulative sum over `[R, C]`; over the vocabulary it is blocked (block masses,
then one block of `W` tokens). One uniform per row is exact here, where a Gumbel race would need
`V` random numbers per row.

Top-p nuclei deeper than the candidates are drawn exactly by rejection, without finding their cut:
draw from the distribution kept so far and accept when the mass strictly above the token is below
`top_p` (vLLM's keep rule). Rows that keep refusing take the exact bisection cut.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample import sharded
from jaxengine.sample.blocked import block_width, blocks
from jaxengine.sample.filters import Candidates
from jaxengine.sample.thresholds import top_p_threshold

#: Attempts of the top-p rejection draw before the remaining rows take the exact bisection.
MAX_REJECTION_ATTEMPTS = 16


def _last_positive(weights: jax.Array) -> jax.Array:
  """`[R] int32` index of the last positive entry of each row of `[R, n]` (0 if none)."""
  n = weights.shape[-1]
  return n - 1 - jnp.argmax(weights[:, ::-1] > 0, axis=-1)


def inverse_cdf(weights: jax.Array, target: jax.Array) -> jax.Array:
  """`[R]` first index whose inclusive cumulative weight exceeds `target`, never a zero weight.

  Args:
    weights: `[R, n] float32` non-negative.
    target: `[R] float32` in `[0, total)`.
  """
  cumulative = jnp.cumsum(weights, axis=-1)
  index = (cumulative <= target[:, None]).sum(-1)
  return jnp.minimum(index, _last_positive(weights))


def weigh(values: jax.Array, row_max: jax.Array, threshold: jax.Array) -> jax.Array:
  """Unnormalised probabilities `exp(v - max)` of the kept values (`v >= threshold`), else 0.

  Args:
    values: `[R, ...] float32` scaled logits.
    row_max, threshold: `[R] float32`.
  """
  shape = (values.shape[0],) + (1,) * (values.ndim - 1)
  return jnp.where(
    values >= threshold.reshape(shape), jnp.exp(values - row_max.reshape(shape)), 0.0
  )


def draw_from_candidates(candidates: Candidates, row_max, threshold, u) -> jax.Array:
  """`[R] int32` each row's token drawn from its kept candidates with uniform `u [R]`."""
  weights = weigh(candidates.values, row_max, threshold)  # [R, C]
  index = inverse_cdf(weights, u * weights.sum(-1))
  return jnp.take_along_axis(candidates.ids, index[:, None], 1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class VocabCdf:
  """The kept distribution of each row over the whole vocabulary, in blocks of `W` tokens.

  Attributes:
    weights: `[R, V] float32` kept tokens' `exp(y - max)`, else 0 (written once: one exp pass).
    blocks: `[R, V / W, W]` the same, by block (the last block padded with 0).
    block_mass: `[R, V / W]` each block's sum.
    block_cumulative: `[R, V / W]` inclusive cumulative block masses.
    width: static `W`.
  """

  weights: jax.Array
  blocks: jax.Array
  block_mass: jax.Array
  block_cumulative: jax.Array
  width: int = dataclasses.field(metadata=dict(static=True))

  @property
  def total(self) -> jax.Array:
    """`[R]` the kept mass of each row."""
    return self.block_cumulative[:, -1]


def vocab_cdf(y: jax.Array, row_max: jax.Array, threshold: jax.Array) -> VocabCdf:
  """The `VocabCdf` of `y [R, V]` keeping `y >= threshold`."""
  weights = weigh(y, row_max, threshold)  # [R, V]
  width = block_width(y.shape[1])
  if not sharded.vocab_blocks_fit(y.shape[1], width):
    weights = sharded.whole_rows(weights)  # blocks straddle shards: gathered (same sums)
  weight_blocks = blocks(weights, width, 0.0)  # [R, V / W, W]
  block_mass = sharded.whole_rows(weight_blocks.sum(-1))  # [R, V / W]: summed in one order
  return VocabCdf(
    weights=weights,
    blocks=weight_blocks,
    block_mass=block_mass,
    block_cumulative=jnp.cumsum(block_mass, axis=-1),
    width=width,
  )


def draw_from_cdf(cdf: VocabCdf, u: jax.Array) -> jax.Array:
  """`[R] int32` the token whose cumulative mass first exceeds `u * total`: the block on the
  cumulative block masses, then the token within that one block."""
  target = u * cdf.total
  block = jnp.minimum(
    (cdf.block_cumulative <= target[:, None]).sum(-1), _last_positive(cdf.block_mass)
  )
  before = jnp.take_along_axis(cdf.block_cumulative, jnp.maximum(block - 1, 0)[:, None], 1)
  before = jnp.where(block > 0, before[:, 0], 0.0)
  # Within the chosen block of W tokens (on the shard owning it when the vocabulary is sharded).
  index = sharded.in_block_along_vocab(cdf.blocks, block, inverse_cdf, target - before)
  return (block * cdf.width + index).astype(jnp.int32)


def attempt_uniform(step_keys: jax.Array, attempt) -> jax.Array:
  """`[R] float32` the uniform of rejection attempt `attempt > 0`: `fold_in(step_key, attempt)`,
  so a row's attempts depend on nothing but its own key."""
  return jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, attempt), ()))(step_keys)


def _in_nucleus(cdf: VocabCdf, drawn: jax.Array, target: jax.Array) -> jax.Array:
  """`[R] bool` whether the mass strictly above each drawn token is below `target` (top-p's keep
  rule; compared on weights, which order tokens as their logits do). One masked reduction."""
  weight = sharded.take_along_vocab(cdf.weights, drawn[:, None])
  return jnp.where(cdf.weights > weight, cdf.weights, 0.0).sum(-1) < target


def _rejection_attempts(cdf: VocabCdf, tokens, accepted, target, step_keys):
  """Redraws the rows not yet `accepted` (attempts `1 .. MAX_REJECTION_ATTEMPTS - 1`) until each
  is accepted or the attempts run out. Returns `(tokens [R] int32, accepted [R] bool)`."""

  def attempt(carry):
    a, tokens, done = carry
    drawn = draw_from_cdf(cdf, attempt_uniform(step_keys, a))
    ok = _in_nucleus(cdf, drawn, target)
    return a + 1, jnp.where(~done & ok, drawn, tokens), done | ok

  def pending(carry):
    a, _, done = carry
    return (a < MAX_REJECTION_ATTEMPTS) & (~done).any()

  _, tokens, accepted = lax.while_loop(pending, attempt, (jnp.int32(1), tokens, accepted))
  return tokens, accepted


def _draw_at_exact_top_p(y_fn, row_max, threshold, top_p, stuck, step_keys, tokens):
  """The `stuck` rows' tokens drawn below their exact top-p cut (found by bisection), with a
  fresh uniform `fold_in(step_key, MAX_REJECTION_ATTEMPTS)`: the row's earlier ones are known to
  have landed outside the nucleus, so reusing any of them would bias the draw."""
  y = y_fn()  # recomputed here rather than kept as a branch operand
  cut = jnp.where(stuck, top_p_threshold(y, row_max, threshold, top_p), threshold)
  fresh_u = attempt_uniform(step_keys, MAX_REJECTION_ATTEMPTS)
  return jnp.where(stuck, draw_from_cdf(vocab_cdf(y, row_max, cut), fresh_u), tokens)


def _top_p_by_rejection(y_fn, cdf, tokens, row_max, threshold, top_p, rejecting, step_keys):
  """Exact top-p for the `rejecting` rows, starting from their first draw `tokens`.

  Acceptance has probability at least `top_p`, so a few attempts suffice; rows still refused after
  `MAX_REJECTION_ATTEMPTS` take `_draw_at_exact_top_p`.
  """
  target = top_p * cdf.total
  accepted = ~rejecting | _in_nucleus(cdf, tokens, target)
  tokens, accepted = _rejection_attempts(cdf, tokens, accepted, target, step_keys)
  stuck = ~accepted
  return lax.cond(
    stuck.any(),
    lambda: _draw_at_exact_top_p(y_fn, row_max, threshold, top_p, stuck, step_keys, tokens),
    lambda: tokens,
  )


def draw_from_vocab(x, inv_temperature, row_max, threshold, u, top_p, rejecting, step_keys):
  """Draws every row from its kept distribution over the vocabulary (`y >= threshold`), and
  exact top-p for the `rejecting` rows, whose nucleus lies beyond the candidates.

  Args:
    x: `[R, V] float32` processed logits.
    inv_temperature: `[R] float32`; `y = x * inv_temperature`.
    row_max: `[R] float32` the largest `y` of each row.
    threshold: `[R] float32` the kept threshold (before top-p for the rejecting rows).
    u: `[R] float32` each row's uniform for this step.
    top_p: `[R] float32`.
    rejecting: `[R] bool` rows whose top-p cut is still to be applied.
    step_keys: `[R]` each row's key for this step (rejection attempts fold into it).

  Returns:
    `[R] int32` tokens.
  """
  y_fn = lambda: x * inv_temperature[:, None]
  cdf = vocab_cdf(y_fn(), row_max, threshold)
  tokens = draw_from_cdf(cdf, u)
  return lax.cond(
    rejecting.any(),
    lambda: _top_p_by_rejection(y_fn, cdf, tokens, row_max, threshold, top_p, rejecting, step_keys),
    lambda: tokens,
  )
