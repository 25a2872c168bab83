"""Blocked reductions over the vocabulary: a row cut into blocks of `W` tokens.

XLA's CPU argmax and top-k cost far more per element than a max-reduction, so both are done in two
stages: a max over each block (`[R, V / W]` block maxima, as cheap as one max pass), then the
expensive operation only on the few blocks that can hold the answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample import sharded

NEG_INF = float("-inf")
#: Widest block of `blocked_argmax` and of the vocabulary draw (`jaxengine.sample.draw`). 256
#: divides 49152 and 128256.
WIDEST_BLOCK = 256
#: Block width of `blocked_top_k`'s first stage.
TOP_K_BLOCK = 32


def block_width(vocab: int, widest: int = WIDEST_BLOCK) -> int:
  """`W`: the widest power of two `<= widest` dividing `vocab` (so rows reshape into blocks
  without a padded copy), or `widest` when only small ones do (then the row is padded)."""
  width = widest
  while width > 16 and vocab % width:
    width //= 2
  return width if vocab % width == 0 else widest


def blocks(x: jax.Array, width: int, fill: float) -> jax.Array:
  """`[R, V]` -> `[R, ceil(V / W), W]` with `W = width`, padding the last block with `fill`."""
  pad = -x.shape[1] % width
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
  return x.reshape(x.shape[0], -1, width)


def blocked_argmax(x: jax.Array) -> jax.Array:
  """`[R] int32` first index of each row's maximum, as `jnp.argmax`, in about one max's time.

  The first block holding the maximum is found on the `[R, V / W]` block maxima, and only that
  block is searched.

  Args:
    x: `[R, V] float32`.
  """
  spec = sharded.current()
  if spec is not None:  # vocabulary-sharded: the top 1 of each shard's top 1 (same rule)
    return sharded.sharded_argmax(x, spec.mesh, spec.axis, spec.rows)
  _rows, vocab = x.shape
  width = block_width(vocab)
  x_blocks = blocks(x, width, NEG_INF)  # [R, V / W, W]
  best_block = jnp.argmax(x_blocks.max(-1), axis=-1)  # a small argmax: [R, V / W]
  chosen = jnp.take_along_axis(x_blocks, best_block[:, None, None], 1)[:, 0]  # [R, W]
  return (best_block * width + jnp.argmax(chosen, axis=-1)).astype(jnp.int32)


def blocked_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k` over the last axis of `[R, V]` in two stages: the same values, a third the time.

  The k blocks of `TOP_K_BLOCK` tokens with the largest maxima hold k values at least as large as
  any token outside them (each of those blocks has a maximum at least that large), so the top k of
  their `k * TOP_K_BLOCK` tokens are the top k of the row (among equal values, which ids are
  reported may differ from `lax.top_k`). XLA's CPU top-k costs about the same whatever k, per
  element scanned, so scanning `[R, V / W]` maxima and then `[R, k * W]` tokens is the cheaper
  way. Falls back to `lax.top_k` when the blocks would not save anything.

  Args:
    x: `[R, V] float32`.
    k: static number of entries.

  Returns:
    `(values [R, k] float32, indices [R, k] int32)`, values descending.
  """
  found = sharded.top_k_along_vocab(x, k)  # vocabulary-sharded: exactly `lax.top_k`'s result
  if found is not None:
    return found
  rows, vocab = x.shape
  if k == 0 or vocab % TOP_K_BLOCK or 4 * k * TOP_K_BLOCK > vocab:
    return lax.top_k(x, k)
  x_blocks = x.reshape(rows, -1, TOP_K_BLOCK)  # [R, V / W, W]
  _, best_blocks = lax.top_k(x_blocks.max(-1), k)  # [R, k]
  gathered = jnp.take_along_axis(x_blocks, best_blocks[:, :, None], 1)  # [R, k, W]
  values, index = lax.top_k(gathered.reshape(rows, k * TOP_K_BLOCK), k)
  block = jnp.take_along_axis(best_blocks, index // TOP_K_BLOCK, 1)
  return values, (block * TOP_K_BLOCK + index % TOP_K_BLOCK).astype(jnp.int32)
