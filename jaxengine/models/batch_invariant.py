"""Batch-invariant arithmetic: a token's numbers do not depend on the other tokens of the call.

A matrix product on XLA:CPU picks its kernel by shape: for SmolLM2's ``576``-wide projections a
row's result has three bit patterns, one for 1 row, one for 2 to 32 rows, one for 33 rows and
more (measured on a 2-core AMD EPYC, jax 0.10; on other CPUs the boundaries move). So the same token
gets different logits when it decodes alone, beside 7 other requests or inside a prefill of 256
tokens, and a trainer's full-sequence forward pass disagrees with all of them in the last bits.
Everything else the decoder does per token is already invariant there: elementwise functions
(``exp``, ``rsqrt``, ``sin``, ...) and reductions along the last axis (RMSNorm's mean, a row's
log-softmax) give the same bits for a row whatever the number of rows and its place among them
(checked by ``tests/models/test_batch_invariant.py``).

`row_tiled_dot` fixes the kernel: it multiplies ``ROW_TILE`` rows at a time, padding the last
tile, inside a loop whose body is the same ``[ROW_TILE, in] x [in, out]`` product in every
program. A row's result then depends on its own values only: not on how many rows the call has,
nor on where in its tile the row sits (XLA computes each row of a product with the same
instruction sequence; the tests check this too). Optimization barriers keep the product out of
XLA's fusions, so a neighbouring add is never folded into its accumulation.

The cost is the padding and the lost sharing of weight reads between tiles: about 4x the
projections' time of a batch-1 decode step, 1.5x at 8 rows and 1.3x at 32 (``ROW_TILE = 16``,
a 30-layer stack of SmolLM2's matrices, 2-core AMD EPYC), 2x for long prefill chunks.
`jaxengine.models.paged_attention` has the attention half (``fixed_order=True``).
"""

from __future__ import annotations

import math
from typing import TypeVar, cast

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["ROW_TILE", "batch_invariant_model", "row_tiled_dot"]

M = TypeVar("M")

#: Rows multiplied per kernel call in batch-invariant mode (a multiple of 8, so the SIMD row
#: blocking of CPU GEMMs divides it).
ROW_TILE = 16


def row_tiled_dot(x: jax.Array, w: jax.Array, *, preferred_element_type=None) -> jax.Array:
  """``x @ w.T`` for an ``[out, in]`` weight, ``ROW_TILE`` rows of ``x`` at a time.

  Args:
    x: ``[..., in]`` activations (any number of rows, including 0-d leading shapes).
    w: ``[out, in]`` weight (PyTorch layout, as `jaxengine.models.layers.linear` takes it).
    preferred_element_type: accumulation and result dtype (None: the promoted input dtype).

  Returns:
    ``[..., out]``; each row's bits depend on that row of ``x`` and on ``w`` only.
  """
  dtype = jnp.result_type(x, w)
  x, w = x.astype(dtype), w.astype(dtype)
  lead, width = x.shape[:-1], x.shape[-1]
  rows = math.prod(lead)
  num_tiles = max(1, -(-rows // ROW_TILE))
  flat = jnp.pad(x.reshape(rows, width), ((0, num_tiles * ROW_TILE - rows), (0, 0)))
  tiles = flat.reshape(num_tiles, ROW_TILE, width)

  def tile_product(tile: jax.Array) -> jax.Array:
    tile, weight = jax.lax.optimization_barrier((tile, w))
    product = jax.lax.dot_general(
      tile, weight, (((1,), (1,)), ((), ())), preferred_element_type=preferred_element_type
    )
    return jax.lax.optimization_barrier(product)

  out = jax.lax.map(tile_product, tiles)  # [num_tiles, ROW_TILE, out]
  return out.reshape(num_tiles * ROW_TILE, -1)[:rows].reshape(*lead, -1)


def batch_invariant_model(model: M) -> M:
  """A copy of `model` in batch-invariant mode, sharing its weight arrays; `model` is unchanged.

  The copy has ``batch_invariant=True`` on every submodule that declares the attribute
  (`jaxengine.models.Llama`'s decoder, attention and MLP blocks), Flax's ``set_attributes``
  idiom for modes such as ``deterministic``. Works inside `nnx.jit` / `nnx.grad` too: gradients
  flow to `model`'s parameters.

  Raises:
    ValueError: no submodule of `model` has a ``batch_invariant`` attribute (naming its type).
  """
  modules = nnx.iter_modules(cast(nnx.Module, model))
  if not any(hasattr(module, "batch_invariant") for _, module in modules):
    raise ValueError(
      f"batch_invariant=True needs a model whose modules declare a batch_invariant attribute "
      f"(jaxengine.models.Llama does); {type(model).__name__} has none"
    )
  graphdef, state = nnx.split(model)
  copy = cast(nnx.Module, nnx.merge(graphdef, state))
  copy.set_attributes(batch_invariant=True)
  return cast(M, copy)
