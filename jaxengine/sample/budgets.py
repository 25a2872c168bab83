"""Candidate budgets: from which list of candidates each row's top-k / top-p cut and draw come.

Every step that filters builds the shallow list (`C = num_topk_candidates`, 64 by default) with the
cheap two-stage `blocked_top_k`. A row whose top_k exceeds it reads its cut off a deep list: the
smallest of `BatchConfig.candidate_budgets` that holds its top_k (its `candidate_level`). Each
level with rows builds its own list, for its own rows only (`rows_top_k`: those rows gathered in
chunks of an eighth of the batch, one loop iteration per chunk, so one executable serves every
mix). A row's `lax.top_k` list depends on that row alone, and lists are nested (equal values come
lowest index first, so the top `c` of a longer list are exactly the top `c` list: what an earlier
version, which built one list for the deepest level and let lower levels read its prefix, gave),
so a seeded row's token does not depend on its neighbours. Each list masks the tokens below a
sampled floor first (`floored_top_k`: XLA:CPU's top-k pays for the tokens that enter its heap),
and falls back to the plain search when the floor was too high. With the vocabulary sharded, a
step builds one `sharded_top_k` list for its deepest level and lower levels read its prefix. A
top_k beyond every budget is found by bisection (`jaxengine.sample.thresholds`) on the shallow
path, as before.

Top-p alone stays on the shallow list: a nucleus deeper than it is drawn by rejection, which on
XLA:CPU costs less than building a deep list for it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxengine.sample import sharded
from jaxengine.sample.draw import draw_from_candidates
from jaxengine.sample.filters import (
  Candidates,
  Cut,
  cut_with_candidates,
  find_candidates,
  scale_candidates,
)
from jaxengine.sample.metadata import SamplingMetadata

NEG_INF = float("-inf")


def restrict_filters(md: SamplingMetadata, rows, vocab_size: int, deep: bool) -> SamplingMetadata:
  """`md` with top-k and top-p switched off outside `rows` (`[R] bool`), for one list's rows.

  `deep`: the rows read a deep list, which holds their top_k (no bisection is ever needed).
  """
  top_k = jnp.where(rows, md.top_k, vocab_size)
  top_p = jnp.where(rows, md.top_p, 1.0)
  return dataclasses.replace(
    md,
    top_k=top_k,
    top_p=top_p,
    any_top_k=(top_k < vocab_size).any(),
    any_top_p=(top_p < 1.0).any(),
    any_top_k_beyond_candidates=jnp.bool_(False) if deep else md.any_top_k_beyond_candidates,
  )


def _no_cut(threshold: jax.Array) -> tuple[Cut, jax.Array]:
  nothing = jnp.zeros(threshold.shape, bool)
  cut = Cut(threshold=threshold, in_candidates=nothing, top_p_unresolved=nothing)
  return cut, jnp.zeros(threshold.shape, jnp.int32)


def _cut_and_draw(x, md, candidates: Candidates, row_max, threshold, u) -> tuple[Cut, jax.Array]:
  """The cut from `candidates` and each row's draw from them: `(Cut, tokens [R] int32)`."""
  cut = cut_with_candidates(x, md, candidates, row_max, threshold)
  return cut, draw_from_candidates(candidates, row_max, cut.threshold, u)


def _select(rows: jax.Array, chosen, other):
  """Per row, `chosen` where `rows` else `other` (pytrees of `[R]` arrays)."""
  return jax.tree.map(lambda a, b: jnp.where(rows, a, b), chosen, other)


def _shallow(x, md, row_max, threshold, u, num_candidates: int):
  """Rows of candidate level 0: the shallow list, under one `lax.cond` on the filters' flags."""
  rows = md.candidate_level == 0
  shallow_md = restrict_filters(md, rows, x.shape[-1], deep=False)
  return lax.cond(
    shallow_md.any_top_k | shallow_md.any_top_p,
    lambda: _cut_and_draw(
      x, shallow_md, find_candidates(x, md, num_candidates), row_max, threshold, u
    ),
    lambda: _no_cut(threshold),
  )


def _list_width(budget: int, vocab_size: int) -> int:
  """Entries of a deep list: one beyond its budget where the row has one, so that a top_k equal
  to the budget sees the next value and needs no count of ties beyond the list."""
  return min(budget + 1, vocab_size)


#: A deep list is built for its rows in chunks of this fraction of the batch (rounded up): the
#: rows of its level gathered, chunk by chunk (the last padded with copies of one of them), in one
#: loop, so the top-k is compiled once however many rows a level has.
ROW_BUCKETS = 8
#: Narrower vocabularies search every row: a gather saves little there, and the loop costs a small
#: step a few microseconds (measured with the earlier `lax.switch` on eighths: the 8 x 256 greedy
#: call 3-5% slower).
BUCKETED_VOCAB = 4096


def row_chunk(rows: int) -> int:
  """Rows of one chunk of a deep list's search: `ceil(rows / ROW_BUCKETS)`."""
  return -(-rows // ROW_BUCKETS)


def _top_k_list(x: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x, width)` kept as XLA:CPU's top-k kernel. Used through more than one slice, a
  top-k falls back to a full sort of the row (~20x slower); the barrier prevents that. On several
  devices it is left out (XLA aborts compiling it inside a cond there)."""
  values, ids = lax.top_k(x, width)
  if sharded.multi_device():
    return values, ids
  return lax.optimization_barrier((values, ids))


#: The deep list's floor is the `ceil(FLOOR_MARGIN * width / FLOOR_STRIDE)`-th largest of every
#: `FLOOR_STRIDE`-th token: about `FLOOR_MARGIN * width` tokens of a row lie above it.
FLOOR_STRIDE = 8
FLOOR_MARGIN = 1.5


def floored_top_k(x: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x, width)` of `x [n, V]` (no NaN), exactly, with the tokens below a floor set to
  `-inf` first when the vocabulary is wide enough for the floor to pay.

  XLA:CPU's top-k keeps a heap of `width` entries and pays mostly for the tokens that enter it:
  about `width * ln(V / width)` of a row in random order (1025 of 49,152: ~5,000; the same row in
  descending order costs a fifth as much). A floor `f` under which only `-inf` remains leaves
  about `FLOOR_MARGIN * width` tokens to enter. `f` comes from a strided sample of the row, so it
  may be too high: the list is exact when its last value is `>= f` (then at least `width` tokens
  are `>= f`, every token below `f` lies below all of them, and ties keep their order, the masked
  row keeping every position); otherwise, for any row, the step searches the rows unmasked.
  """
  vocab = x.shape[-1]
  sample_rank = math.ceil(FLOOR_MARGIN * width / FLOOR_STRIDE)
  if sharded.multi_device() or vocab < 4 * sample_rank * FLOOR_STRIDE:
    return _top_k_list(x, width)
  floor = lax.optimization_barrier(tuple(lax.top_k(x[:, ::FLOOR_STRIDE], sample_rank)))[0][:, -1]
  values, ids = _top_k_list(jnp.where(x >= floor[:, None], x, NEG_INF), width)
  return lax.cond(
    (values[:, -1] >= floor).all(), lambda: (values, ids), lambda: _top_k_list(x, width)
  )


def rows_top_k(x: jax.Array, selected: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """`lax.top_k(x, width)` on the `selected` rows (`[R] bool`) of `x [R, V]` (no NaN); other rows
  hold zeros.

  XLA:CPU's top-k costs about the same for every row it is given, whatever the row's neighbours,
  and a row's result depends on that row alone. So (from `BUCKETED_VOCAB` tokens on) only the
  selected rows are searched: gathered in chunks of `row_chunk(R)` rows, one chunk per iteration
  of a loop that runs `ceil(count / chunk)` times (none when no row is selected); the last chunk
  is padded with copies of the first selected row, which scatter back the same values. One loop
  body is compiled, where a `lax.switch` over row-count buckets compiled a search per bucket
  (about a third of the sampler's compile time at 8 x 49,152, for the same steady-state cost).
  The result is exactly `lax.top_k`'s for every selected row.

  Returns:
    `(values [R, width] float32, ids [R, width] int32)`.
  """
  rows, vocab = x.shape
  empty = (jnp.zeros((rows, width), x.dtype), jnp.zeros((rows, width), jnp.int32))
  if vocab < BUCKETED_VOCAB:
    return lax.cond(selected.any(), lambda: floored_top_k(x, width), lambda: empty)
  chunk = row_chunk(rows)
  num_chunks = -(-rows // chunk)
  (order,) = jnp.nonzero(selected, size=num_chunks * chunk, fill_value=jnp.argmax(selected))

  def search(i, found):
    index = lax.dynamic_slice_in_dim(order, i * chunk, chunk)
    values, ids = floored_top_k(x[index], width)
    return found[0].at[index].set(values), found[1].at[index].set(ids)

  return lax.fori_loop(0, -(-selected.sum() // chunk), search, empty)


def _deep(x, md, row_max, threshold, u, budgets: tuple[int, ...]):
  """Rows of candidate levels `1 ..`: each level's rows from their own budget's list.

  Lists are nested (see the module doc), so a row's list, built for its own level's rows only,
  holds exactly what the prefix of a deeper list would. A level without rows builds nothing.
  """
  vocab_size = x.shape[-1]
  result = _no_cut(threshold)
  for level in range(1, len(budgets)):
    width = _list_width(budgets[level], vocab_size)
    rows = md.candidate_level == level
    candidates = scale_candidates(*rows_top_k(x, rows, width), md)
    level_md = restrict_filters(md, rows, vocab_size, deep=True)
    result = _select(rows, _cut_and_draw(x, level_md, candidates, row_max, threshold, u), result)
  return result


def _deep_sharded(x, md, row_max, threshold, u, budgets: tuple[int, ...], level: int):
  """`_deep` with the vocabulary sharded: one `sharded_top_k` list of every row, for
  `budgets[level]` (the step's deepest level), whose prefixes serve the lower levels."""
  vocab_size = x.shape[-1]
  found = sharded.top_k_along_vocab(x, _list_width(budgets[level], vocab_size))
  assert found is not None  # traced under `vocab_sharded` only
  values, ids = found
  result = _no_cut(threshold)
  for lower in range(1, level + 1):
    width = _list_width(budgets[lower], vocab_size)
    candidates = scale_candidates(values[:, :width], ids[:, :width], md)
    rows = md.candidate_level == lower
    level_md = restrict_filters(md, rows, vocab_size, deep=True)
    result = _select(rows, _cut_and_draw(x, level_md, candidates, row_max, threshold, u), result)
  return result


def cut_and_draw(x, md: SamplingMetadata, row_max, threshold, u, budgets: tuple[int, ...]):
  """Stages 10-11 from the candidates, and each row's draw from them.

  Args:
    x: `[R, V] float32` processed logits.
    md: the metadata (filters, candidate levels).
    row_max: `[R] float32` the largest `y = x / T` of each row.
    threshold: `[R] float32` the min-p cut (`-inf` for none).
    u: `[R] float32` each row's uniform for this step.
    budgets: static `BatchConfig.candidate_budgets`.

  Returns:
    `(Cut, tokens [R] int32)`: each row's cut, and its draw from its candidates (meaningful
    where `Cut.in_candidates`).
  """
  result = _shallow(x, md, row_max, threshold, u, budgets[0])
  if len(budgets) == 1:
    return result
  if sharded.current() is None:
    deep = lax.cond(
      md.max_candidate_level > 0,
      lambda: _deep(x, md, row_max, threshold, u, budgets),
      lambda: _no_cut(threshold),
    )
  else:  # one list, for the step's deepest level (`lax.switch` on it)
    branches = [lambda: _no_cut(threshold)] + [
      (lambda level=level: _deep_sharded(x, md, row_max, threshold, u, budgets, level))
      for level in range(1, len(budgets))
    ]
    deep = lax.switch(md.max_candidate_level, branches)
  return _select(md.candidate_level > 0, deep, result)
