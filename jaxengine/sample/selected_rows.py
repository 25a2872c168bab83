"""Row-wise work on some rows of the batch only: the rows gathered into a bucket of eighths.

Several stages of the sampler compute something per row that only some rows use: the greedy
argmax (greedy rows), the draw over the whole vocabulary (random rows whose kept set is not inside
their candidates), a deep top-k list (rows whose top_k needs it). Computed on every row, each
costs a pass over `[R, V]`; on its rows only, a pass over `[n, V]`. `on_selected_rows` gathers
the selected rows into the smallest of a few static row counts that holds them (`lax.switch` on
their count, so one executable serves every batch mix) and scatters the results back. A row's
result depends on that row's operands alone (every function given to it works row by row), so a
row gets the same result whichever bucket, and whichever neighbours, it is computed with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample import sharded

#: The selected rows are gathered (padded with copies of the first of them) into the smallest of
#: these fractions of the batch, in eighths, that holds them.
ROW_BUCKETS = 8
#: Narrower vocabularies compute every row: a gather saves little there, and each bucket's branch
#: costs a small step a few microseconds (measured: the 8 x 256 greedy call 3-5% slower).
BUCKETED_VOCAB = 4096


def row_buckets(rows: int) -> tuple[int, ...]:
  """The static row counts work is gathered into: `ceil(rows * i / ROW_BUCKETS)` for `i` in
  `1 .. ROW_BUCKETS` (fewer when `rows < ROW_BUCKETS`), the last `rows`."""
  return tuple(sorted({-(-rows * i // ROW_BUCKETS) for i in range(1, ROW_BUCKETS + 1)}))


def on_selected_rows(
  fn: Callable[..., Any],
  selected: jax.Array,
  operands: Any,
  vocab_size: int,
  any_selected: jax.Array | None = None,
  *,
  gather: bool = True,
) -> Any:
  """`fn(operands)` for the `selected` rows, computed on those rows only.

  Args:
    fn: row-wise function of a pytree of `[n, ...]` arrays (typed key arrays allowed) returning a
      pytree of `[n, ...]` arrays, for any `n`: row `i` of its result depends on row `i` of its
      operands alone.
    selected: `[R] bool` the rows whose results are read.
    operands: a pytree of `[R, ...]` arrays.
    vocab_size: static `V`: from `BUCKETED_VOCAB` on (and on one device) the rows are gathered
      into a bucket; below it every row is computed.
    any_selected: `[] bool` `selected.any()` where the caller has it already (it saves small
      steps computing it); only read when every row is computed.
    gather: static; False calls `fn(operands, index)` with the whole operands and `index`
      (`[n] int32` the rows to compute, or None for every row), for a function that gathers
      them itself (fused into its first pass rather than written out).

  Returns:
    `fn`'s results `[R, ...]`: exactly `fn(operands)`'s on the selected rows; zeros, or what
    `fn` computed, on the others. Nothing is computed when no row is selected.
  """
  rows = selected.shape[0]
  on_rows = (
    (lambda index: fn(operands, index))
    if not gather
    else (
      lambda index: fn(operands if index is None else jax.tree.map(lambda a: a[index], operands))
    )
  )
  result = jax.eval_shape(lambda: on_rows(None))
  empty = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), result)
  if vocab_size < BUCKETED_VOCAB or sharded.current() is not None:
    flag = selected.any() if any_selected is None else any_selected
    return lax.cond(flag, lambda: on_rows(None), empty)

  def bucket(size: int):
    if size == rows:
      return lambda: on_rows(None)

    def gathered():
      (index,) = jnp.nonzero(selected, size=size, fill_value=jnp.argmax(selected))  # [size]
      values = on_rows(index)
      return jax.tree.map(lambda base, v: base.at[index].set(v), empty(), values)

    return gathered

  buckets = row_buckets(rows)
  count = selected.sum()
  # Branch 0 computes nothing; branch i + 1 the i-th bucket, the smallest holding `count` rows.
  branch = jnp.where(count > 0, jnp.searchsorted(jnp.asarray(buckets), count) + 1, 0)
  return lax.switch(branch, [empty] + [bucket(size) for size in buckets])
