"""Exact per-row thresholds without sorting: bisection over the float32 bit pattern.

A float32 maps to a uint32 with the same order, so 32 halvings of `[0, 2**32)` land exactly on a
value of the row; each halving is one masked reduction over `[R, V]`. The TPU samplers find their
top-k and top-p cuts the same way. Used for cuts deeper than the candidate budget
(`jaxengine.sample.filters`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def _ordered_bits(y: jax.Array) -> jax.Array:
  """float32 -> uint32 with the same order (for -0.0 == +0.0 too)."""
  bits = lax.bitcast_convert_type(jnp.where(y == 0, 0.0, y), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _from_ordered_bits(key: jax.Array) -> jax.Array:
  """The inverse of `_ordered_bits`."""
  bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
  return lax.bitcast_convert_type(bits, jnp.float32)


def largest_threshold(y: jax.Array, reaches: Callable[[jax.Array], jax.Array]) -> jax.Array:
  """`[R] float32` the largest value `t` of each row of `y` with `reaches(y >= t)` true.

  Args:
    y: `[R, V] float32`.
    reaches: `kept [R, V] bool -> [R] bool`; must be monotone (true for every smaller t) and
      true for the whole row.
  """
  keys = _ordered_bits(y)
  rows = y.shape[0]

  def halve(_, bounds):
    lo, hi = bounds  # invariant: reaches(lo); the answer lies in [lo, hi]
    gap = hi - lo
    mid = lo + gap // 2 + (gap & 1)
    ok = reaches(keys >= mid[:, None])
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

  lo = jnp.zeros((rows,), jnp.uint32)
  hi = jnp.full((rows,), 0xFFFFFFFF, jnp.uint32)
  lo, _ = lax.fori_loop(0, 32, halve, (lo, hi))
  return _from_ordered_bits(lo)


def kth_largest(y: jax.Array, k: jax.Array) -> jax.Array:
  """`[R] float32` the k-th largest value of each row of `y` (ties counted), exact, no sort.

  Args:
    y: `[R, V] float32`.
    k: `[R] int32`, each in `[1, V]`.
  """
  return largest_threshold(y, lambda kept: kept.sum(-1) >= k)


def top_p_threshold(y, row_max, threshold, top_p) -> jax.Array:
  """`[R] float32` the smallest value top-p keeps among the tokens with `y >= threshold`.

  A token is kept when the probability mass of the tokens strictly above its value is below
  `top_p` (vLLM's rule; tokens tied with the last one kept are kept too), so the cut is the largest
  `t` whose mass of `y >= t` reaches `top_p` of the total. Exact, no sort.

  Args:
    y: `[R, V] float32` temperature-scaled logits.
    row_max: `[R] float32` the maximum of each row of `y`.
    threshold: `[R] float32` the cut before top-p (min-p, top-k; `-inf` for none).
    top_p: `[R] float32` in `(0, 1]`.
  """
  weights = jnp.where(y >= threshold[:, None], jnp.exp(y - row_max[:, None]), 0.0)
  target = top_p * weights.sum(-1)
  return largest_threshold(y, lambda kept: jnp.where(kept, weights, 0.0).sum(-1) >= target)
