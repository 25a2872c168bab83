"""The grouped matmul of a mixture of experts: each row of a sorted batch times its group's
matrix (`grouped_linear`), one `jax.lax.ragged_dot_general` on GPU and TPU, every group then a
pick on CPU, and row-tiled under batch invariance (`jaxengine.models.moe`'s module docstring says
why each). Its own module so that the experts (`jaxengine.models.moe`) and their LoRA
(`jaxengine.models.moe_lora`) both build on it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxengine.models.batch_invariant import ROW_TILE
from jaxengine.models.target_device import target_platform

__all__ = ["grouped_linear"]

# lhs [M, in] ragged along M; rhs [X, in, out] grouped along X, contracting `in` with `in`.
_RAGGED = jax.lax.RaggedDotDimensionNumbers(
  dot_dimension_numbers=(((1,), (1,)), ((), ())),
  lhs_ragged_dimensions=[0],
  rhs_group_dimensions=[0],
)


def grouped_linear(
  x: jax.Array,
  w: jax.Array,
  group_sizes: jax.Array,
  *,
  scale: jax.Array | None = None,
  batch_invariant: bool = False,
) -> jax.Array:
  """Row ``r`` of `x` times the ``[in, out]`` matrix of the group it lies in (a grouped matmul).

  On GPU and TPU one `jax.lax.ragged_dot_general` (a grouped-matmul kernel); on CPU
  `_every_group_then_pick` (see the module docstring for why).

  With `scale` (experts quantized per output row, `jaxengine.models.quantization`) the values
  are cast to the activations' dtype, the grouped product runs in it, and row ``r``'s ``[out]``
  result is multiplied by its own group's scales, ``scale[group(r)]``: exact per output
  channel, ``x @ (q * s) == (x @ q) * s``, as `jaxengine.models.layers.linear` does for one
  matrix.

  Args:
    x: ``[M, in]`` rows sorted by group: the first ``group_sizes[0]`` rows belong to group 0,
      the next ``group_sizes[1]`` to group 1, and so on.
    w: ``[X, in, out]`` one matrix per group: float, or int8 / float8_e4m3fn with `scale`.
    group_sizes: ``[X] int32`` rows per group, summing to at most ``M`` (rows past the sum
      give zeros).
    scale: None, or ``[X, out] float32`` per-output-channel scales of a quantized `w`.
    batch_invariant: multiply ``ROW_TILE`` rows at a time (see the module docstring).

  Returns:
    ``[M, out]`` in the promoted dtype of `x` and `w`; with `scale`, in ``x.dtype``.
  """
  platform = target_platform()
  if scale is not None:
    # TPU's ragged dot takes int8 values as they are (a cast first is a copy of the whole stack
    # in the activations' dtype on every call); elsewhere, and float8 values, are cast first.
    in_place = platform == "tpu" and jnp.issubdtype(w.dtype, jnp.integer)
    narrow = w if in_place else w.astype(x.dtype)
    out = _grouped(x, narrow, group_sizes, platform, batch_invariant)
    group = jnp.minimum(_row_groups(group_sizes, x.shape[0]), w.shape[0] - 1)  # [M]
    return (out * scale[group]).astype(x.dtype)  # rows past the groups stay 0
  dtype = jnp.result_type(x, w)
  return _grouped(x.astype(dtype), w.astype(dtype), group_sizes, platform, batch_invariant)


def _grouped(
  x: jax.Array, w: jax.Array, group_sizes: jax.Array, platform: str, batch_invariant: bool
) -> jax.Array:
  """`grouped_linear` without scales, ``[M, out]`` in ``x.dtype`` (`w` in it, or narrow on
  TPU), on `platform`'s product."""
  product = _every_group_then_pick if platform == "cpu" else _ragged
  if not batch_invariant:
    return product(x, w, group_sizes)
  rows = x.shape[0]
  num_tiles = max(1, math.ceil(rows / ROW_TILE))
  tiles = jnp.pad(x, ((0, num_tiles * ROW_TILE - rows), (0, 0))).reshape(num_tiles, ROW_TILE, -1)
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  tile_start = (jnp.arange(num_tiles, dtype=ends.dtype) * ROW_TILE)[:, None]  # [tiles, 1]
  clip = lambda bound: jnp.clip(bound[None, :], tile_start, tile_start + ROW_TILE)
  tile_sizes = (clip(ends) - clip(starts)).astype(group_sizes.dtype)  # [tiles, X]

  def tile_product(args):
    tile, sizes = args
    tile, weight = jax.lax.optimization_barrier((tile, w))
    return jax.lax.optimization_barrier(product(tile, weight, sizes))

  out = jax.lax.map(tile_product, (tiles, tile_sizes))  # [tiles, ROW_TILE, out]
  return out.reshape(num_tiles * ROW_TILE, -1)[:rows]


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`grouped_linear` as one ragged product (a grouped-matmul kernel on GPU and TPU), in
  ``x.dtype`` (`w` may be narrower: int8 / float8 values, widened inside the kernel)."""
  return jax.lax.ragged_dot_general(x, w, group_sizes, _RAGGED, preferred_element_type=x.dtype)


#: Bytes of the ``[X, rows, out]`` products `_every_group_then_pick` computes at once; more rows
#: are taken a chunk at a time (a prefill chunk of a large model would otherwise hold gigabytes).
CPU_PRODUCT_BYTES = 64 << 20


def _every_group_then_pick(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """`grouped_linear` as XLA:CPU runs it best: every row times every group's matrix, batched
  over the groups (``[X, M, out]``, each matrix read in place), then each row's own group's
  result (exact: a selection, no sum); rows past the groups give zeros. At most
  `CPU_PRODUCT_BYTES` of products at once: more rows go a chunk at a time (a row's result does
  not depend on its chunk's other rows: the rows of one product are computed alike)."""
  num_groups, rows = w.shape[0], x.shape[0]
  group = _row_groups(group_sizes, rows)  # [M]
  per_row = num_groups * w.shape[2] * jnp.dtype(x.dtype).itemsize
  chunk = max(8, CPU_PRODUCT_BYTES // per_row // 8 * 8)
  if rows <= chunk:
    return _pick(x, w, group)
  num_chunks = math.ceil(rows / chunk)
  pad = num_chunks * chunk - rows
  xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(num_chunks, chunk, -1)
  groups = jnp.pad(group, (0, pad), constant_values=num_groups).reshape(num_chunks, chunk)
  out = jax.lax.map(lambda args: _pick(args[0], w, args[1]), (xs, groups))
  return out.reshape(num_chunks * chunk, -1)[:rows]


def _row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
  """``[rows] int32`` the group each sorted row lies in (``X`` for rows past the groups)."""
  return jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right")


def _pick(x: jax.Array, w: jax.Array, group: jax.Array) -> jax.Array:
  """Rows ``[C, in]`` times every ``[X, in, out]`` matrix, each row's ``group`` kept (zeros for
  ``group >= X``)."""
  num_groups = w.shape[0]
  # One [C, in] @ [in, out] product per group, looped ([X, C, out]): XLA:CPU reads each matrix
  # in place. As one product batched over X it copied the [X, in, out] weights first (2-core
  # CPU, 8 groups of 512 -> 512, 2 / 16 / 64 / 256 rows: 3.2 / 1.9 / 3.5 / 25 ms batched, 0.41 /
  # 0.78 / 2.1 / 10.9 ms looped; 0.26 / 0.83 / 1.4 / 11.6 ms batched over the earlier [X, out,
  # in] layout).
  every = jax.lax.map(lambda matrix: x @ matrix, w)
  picked = jnp.take_along_axis(every, jnp.minimum(group, num_groups - 1)[None, :, None], axis=0)
  return jnp.where((group < num_groups)[:, None], picked[0], 0)
