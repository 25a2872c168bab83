"""Stages 9-11 of the sampler: the min-p, top-k and top-p cuts, found from a few candidates.

Each filter keeps the tokens whose temperature-scaled logit `y = x / T` is at or above a per-row
threshold, so the three combine into one threshold. Top-k and top-p are read off the `C` largest
values of each row (`blocked_top_k`, a static budget), never from a sort of the vocabulary:

- top-k with `k <= C` is the k-th candidate; a deeper one is read off a deep list
  (`jaxengine.sample.budgets`), and beyond every budget an exact bisection (`kth_largest`) finds it;
- top-p is resolved from the candidates when they hold the kept mass; rows whose nucleus lies
  beyond them are reported unresolved (the draw samples them exactly by rejection, or the
  processed_* logprobs modes find the cut by bisection).

A token outside the candidates is never above the last candidate, so a row's kept set
`y >= threshold` lies inside its candidates when the threshold is above the last candidate, may
not when it is below, and is decided by counting the whole row only when the two are equal (ties):
that count runs under `lax.cond`, so a typical step never reads the vocabulary again.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample.blocked import blocked_top_k
from jaxengine.sample.metadata import SamplingMetadata, inverse_temperature
from jaxengine.sample.thresholds import kth_largest

NEG_INF = float("-inf")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidates:
  """The `C` largest scaled logits of each row, best first.

  Attributes:
    values: `[R, C] float32` the values of `y = x / T`, descending.
    ids: `[R, C] int32` their token ids.
  """

  values: jax.Array
  ids: jax.Array

  @property
  def last(self) -> jax.Array:
    """`[R] float32` the smallest candidate value of each row."""
    return self.values[:, -1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Cut:
  """Where min-p, top-k and top-p cut each row, as far as the candidates tell.

  Attributes:
    threshold: `[R] float32` the row keeps `y >= threshold` (before top-p where unresolved).
    in_candidates: `[R] bool` rows filtered by top-k or top-p whose kept set lies inside their
      candidates (so they are drawn from them).
    top_p_unresolved: `[R] bool` top-p rows whose nucleus lies beyond their candidates.
  """

  threshold: jax.Array
  in_candidates: jax.Array
  top_p_unresolved: jax.Array


def scale_candidates(top_logits, ids, md: SamplingMetadata) -> Candidates:
  """`Candidates` from the top processed logits `[R, C]` (descending) and their ids `[R, C]`:
  the values scaled by `1 / T` (which keeps their order)."""
  return Candidates(values=top_logits * inverse_temperature(md)[:, None], ids=ids)


def find_candidates(x: jax.Array, md: SamplingMetadata, num_candidates: int) -> Candidates:
  """The top `num_candidates` of each row of `y = x / T` (`blocked_top_k`: the shallow list).

  Args:
    x: `[R, V] float32` processed logits.
    md: the metadata (temperatures).
    num_candidates: static `C`.
  """
  return scale_candidates(*blocked_top_k(x, num_candidates), md)


def _num_outside(x, md: SamplingMetadata, candidates: Candidates, threshold) -> jax.Array:
  """`[R] int32` tokens with `y >= threshold` that are not candidates (exact where it matters:
  `V` stands for "unknown, possibly many" where the threshold lies below the last candidate)."""
  vocab = x.shape[-1]
  filtered = (md.top_k < vocab) | (md.top_p < 1.0)
  last = candidates.last
  at_edge = filtered & (last == threshold)

  def count():
    y = x * inverse_temperature(md)[:, None]
    kept = (y >= threshold[:, None]).sum(-1)
    outside = kept - (candidates.values >= threshold[:, None]).sum(-1)
    return jnp.where(at_edge, outside, 0)

  beyond = jnp.where(last > threshold, vocab, 0)
  return beyond + lax.cond(at_edge.any(), count, lambda: jnp.zeros_like(beyond))


def top_k_threshold(x, md: SamplingMetadata, candidates: Candidates) -> jax.Array:
  """`[R] float32` the k-th largest `y` of each top-k row (all ties kept), `-inf` elsewhere.

  Read off the candidates for `k <= C`; found by bisection over the row for deeper k.
  """
  vocab = x.shape[-1]
  num_candidates = candidates.values.shape[-1]
  k = md.top_k
  index = jnp.clip(k - 1, 0, num_candidates - 1)[:, None]
  kth = jnp.take_along_axis(candidates.values, index, 1)[:, 0]
  cut = jnp.where(k < vocab, kth, NEG_INF)
  beyond = (k < vocab) & (k > num_candidates)
  return lax.cond(
    md.any_top_k_beyond_candidates,
    lambda: jnp.where(beyond, kth_largest(x * inverse_temperature(md)[:, None], k), cut),
    lambda: cut,
  )


def _top_p_from_candidates(x, md, candidates: Candidates, row_max, threshold):
  """`(threshold [R], unresolved [R] bool)` after top-p, for the rows the candidates resolve.

  The mass of the kept set is known from the candidates when every kept token is a candidate or
  ties with the last candidate (then the missing tokens all weigh `exp(threshold - max)`).
  """
  values, last = candidates.values, candidates.last
  kept = values >= threshold[:, None]
  weights = jnp.where(kept, jnp.exp(values - row_max[:, None]), 0.0)
  ties_last = last == threshold
  known = last <= threshold
  missing = jnp.where(ties_last, _num_outside(x, md, candidates, threshold), 0)
  total = weights.sum(-1) + missing * jnp.exp(threshold - row_max)
  reached = jnp.cumsum(weights, -1) >= (md.top_p * total)[:, None]
  cut = jnp.where(
    reached.any(-1),
    jnp.take_along_axis(values, jnp.argmax(reached, -1)[:, None], 1)[:, 0],
    threshold,
  )  # not reached inside: the cut is the tied tail, `threshold` itself
  active = md.top_p < 1.0
  resolved = jnp.where(known, jnp.maximum(threshold, cut), threshold)
  return jnp.where(active, resolved, threshold), active & ~known


def cut_with_candidates(x, md: SamplingMetadata, candidates: Candidates, row_max, threshold) -> Cut:
  """Top-k, then top-p, on top of the min-p `threshold`.

  Args:
    x: `[R, V] float32` processed logits.
    md: the metadata.
    candidates: the rows' candidates (`find_candidates`).
    row_max: `[R] float32` the largest `y` of each row.
    threshold: `[R] float32` the min-p cut (`-inf` for none).

  Returns:
    The `Cut`. Top-k is always resolved exactly; top-p where the candidates hold its mass. Whether
    a row is drawn from its candidates depends on the row alone, so a seeded row's token never
    depends on its neighbours.
  """
  threshold = jnp.maximum(threshold, top_k_threshold(x, md, candidates))
  threshold, unresolved = lax.cond(
    md.any_top_p,
    lambda t: _top_p_from_candidates(x, md, candidates, row_max, t),
    lambda t: (t, jnp.zeros(t.shape, bool)),
    threshold,
  )
  filtered = (md.top_k < x.shape[-1]) | (md.top_p < 1.0)
  fits = _num_outside(x, md, candidates, threshold) == 0
  return Cut(
    threshold=threshold, in_candidates=filtered & fits & ~unresolved, top_p_unresolved=unresolved
  )
