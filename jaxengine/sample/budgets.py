"""Candidate budgets: from which list of candidates each row's top-k / top-p cut and draw come.

Every step that filters builds the shallow list (`C = num_topk_candidates`, 64 by default) with the
cheap two-stage `blocked_top_k`. A row whose top_k exceeds it reads its cut off a deep list: the
smallest of `BatchConfig.candidate_budgets` that holds its top_k (its `candidate_level`). A step
builds one deep list, for the largest level among its rows (`lax.switch` on a traced index, so one
executable serves every mix), and a row of a lower level reads the prefix of its own budget:
`lax.top_k` lists are nested (equal values come lowest index first, so the top `c` of a longer
list are exactly the top `c` list), so a seeded row's token does not depend on which deep list
its neighbours made the step build. A top_k beyond every budget is found by bisection
(`jaxengine.sample.thresholds`) on the shallow path, as before.

Top-p alone stays on the shallow list: a nucleus deeper than it is drawn by rejection, which on
XLA:CPU costs less than building a deep list for it.
"""

from __future__ import annotations

import dataclasses

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


def _deep(x, md, row_max, threshold, u, budgets: tuple[int, ...], level: int):
  """Rows of candidate levels `1 .. level`, from one list for `budgets[level]`."""
  vocab_size = x.shape[-1]
  # Nested for every budget (see the module doc). The barrier keeps XLA:CPU's top-k kernel: used
  # through more than one slice, a top-k falls back to a full sort of the row (~20x slower). On
  # several devices it is left out (XLA aborts compiling it inside a cond there) and, with the
  # vocabulary sharded, the list is `sharded_top_k`'s.
  width = _list_width(budgets[level], vocab_size)
  found = sharded.top_k_along_vocab(x, width)
  if found is None:
    found = lax.top_k(x, width)
    found = found if sharded.multi_device() else lax.optimization_barrier(found)
  values, ids = found
  result = _no_cut(threshold)
  for lower in range(1, level + 1):
    width = _list_width(budgets[lower], vocab_size)
    candidates = scale_candidates(values[:, :width], ids[:, :width], md)
    rows = md.candidate_level == lower
    level_md = restrict_filters(md, rows, x.shape[-1], deep=True)
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
  branches = [lambda: _no_cut(threshold)] + [
    (lambda level=level: _deep(x, md, row_max, threshold, u, budgets, level))
    for level in range(1, len(budgets))
  ]
  deep = lax.switch(md.max_candidate_level, branches)
  return _select(md.candidate_level > 0, deep, result)
