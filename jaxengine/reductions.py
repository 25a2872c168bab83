"""Float sums in an order fixed by the summed length alone, for batch-invariant arithmetic.

XLA:CPU picks a reduction's loop structure by the whole operand's shape: the sum of one row of
``[M, n]`` comes out in different bits for different ``M`` (measured for ``n`` from 16 to 49,152
on a 2-core AMD EPYC, jax 0.10: rows of 1 to 120 against rows of 300), although at one fixed shape a
row's place among the others does not matter. `fixed_sum` writes the order out instead, as
pairwise sums of halves (elementwise adds, which XLA neither reorders nor fuses into other
arithmetic), so a row's sum depends on the row alone. Maxima need nothing: a maximum is exact in
any order.

Used by ``LLM(..., batch_invariant=True)`` (RMSNorm, the paged attention's ``fixed_order``, the
sampler's logprobs) and `jaxengine.models.token_logprobs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["fixed_logsumexp", "fixed_sum"]


def fixed_sum(x: jax.Array, axis: int = -1, *, keepdims: bool = False) -> jax.Array:
  """Sum along `axis` by halves: ``x[:h] + x[h:2h]`` repeatedly (an odd last entry is carried
  to the next level), so the order depends on the length of `axis` only.

  Args:
    x: any float array.
    axis: the summed axis.
    keepdims: keep `axis` with length 1.

  Returns:
    `x`'s shape without `axis` (or with length 1), in `x`'s dtype; 0 for an empty axis.
  """
  moved = jnp.moveaxis(x, axis, -1)
  if moved.shape[-1] == 0:
    total = jnp.zeros(moved.shape[:-1], x.dtype)
  else:
    while (n := moved.shape[-1]) > 1:
      half = n // 2
      paired = moved[..., :half] + moved[..., half : 2 * half]
      moved = paired if n % 2 == 0 else jnp.concatenate([paired, moved[..., 2 * half :]], -1)
    total = moved[..., 0]
  return jnp.expand_dims(total, axis) if keepdims else total


def fixed_logsumexp(x: jax.Array, axis: int = -1, *, keepdims: bool = False) -> jax.Array:
  """``log(sum(exp(x - max))) + max`` along `axis` with `fixed_sum`; a row of all ``-inf``
  gives ``-inf``, a row holding ``+inf`` gives ``+inf``, a NaN gives NaN (as
  `jax.nn.logsumexp`).

  Args:
    x: float array.
    axis: the reduced axis.
    keepdims: keep `axis` with length 1.
  """
  peak = jnp.max(x, axis=axis, keepdims=True)
  finite_peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
  total = fixed_sum(jnp.exp(x - finite_peak), axis, keepdims=True)
  out = jnp.log(total) + finite_peak
  return out if keepdims else jnp.squeeze(out, axis)
