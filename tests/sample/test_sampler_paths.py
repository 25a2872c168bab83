"""The sorting-free top-k / top-p paths agree with each other and with exact probabilities.

The sampler resolves top-k and top-p from a static budget of candidates (the shallow list), reads
deeper top-k cuts off larger lists (the deep budgets, one list per level built on that level's
rows only, `rows_top_k`),
and falls back to exact methods beyond them: bisection over the float bit pattern for the
threshold (processed logprobs modes, top-k beyond every budget) and a rejection draw for top-p.
With small vocabularies the default budgets cover everything, so these tests shrink the budgets
(`num_topk_candidates`, `deep_candidate_budgets`) to force every path.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_row

import jaxengine as je
from jaxengine.sample.step import ALWAYS_COPIED_LOGITS

V = 48
R = 16
#: The deep lists of the draw tests (`_assert_draws_match_exact`) and of the batch-invariance
#: tests: top-p alone never reads them (`jaxengine.sample.budgets`), so the rejection tests share
#: the deep-list tests' sampler executable instead of compiling one of their own.
DRAW_DEEP = (8, 24)
INVARIANCE_DEEP = (4, 8, 20)
#: `max_model_len` of the draw tests' batches: one shape for all of them.
DRAW_MAX_MODEL_LEN = 64
#: The second deep-list case of the processed-rows tests, shared by the top-k cut tests (one
#: executable per budget pair).
PROCESSED_DEEP = (2, (4, 21, 30))


def _batch(num_topk_candidates: int, mode: str = "processed_logprobs", deep=()) -> je.InputBatch:
  return je.InputBatch(
    R,
    64,
    V,
    max_num_logprobs=-1,
    logprobs_mode=mode,
    num_topk_candidates=num_topk_candidates,
    deep_candidate_budgets=deep,
  )


def _full_rows(out: je.HostSamplerOutput) -> np.ndarray:
  rows = np.full((len(out.sampled_token_ids), V), -np.inf)
  for i, (ids, values) in enumerate(zip(out.logprobs.token_ids, out.logprobs.logprobs)):
    rows[i, ids[1:]] = values[1:]
  return rows


def _params(rng: np.random.Generator) -> je.SamplingParams:
  return je.SamplingParams(
    temperature=float(rng.choice([0.5, 1.0, 1.7])),
    top_k=int(rng.choice([0, 1, 3, 7, 20, 40])),
    top_p=float(rng.choice([1.0, 0.3, 0.7, 0.95, 0.999])),
    min_p=float(rng.choice([0.0, 0.0, 0.02])),
    logprobs=-1,
    seed=int(rng.integers(1 << 30)),
  )


@pytest.mark.parametrize(
  "num_topk_candidates, deep", [(1, ()), (2, ()), (5, ()), (1, (3, 9)), PROCESSED_DEEP]
)
def test_small_candidate_budget_gives_the_same_processed_rows(num_topk_candidates, deep):
  rng = np.random.default_rng(num_topk_candidates + len(deep))
  # Few distinct values: ties at the top-k and top-p cuts are common.
  logits = rng.choice(np.linspace(-3, 3, 9), size=(R, V)).astype(np.float32)
  params = [_params(rng) for _ in range(R)]
  outputs = []
  for budget, deep_budgets in ((num_topk_candidates, deep), (V, ())):
    batch = _batch(budget, deep=deep_budgets)
    for i, p in enumerate(params):
      batch.add_request(f"r{i}", [1, 2], p)
    outputs.append(batch.sample(logits))
  narrow, wide = map(_full_rows, outputs)
  np.testing.assert_array_equal(np.isneginf(narrow), np.isneginf(wide))
  np.testing.assert_allclose(narrow, wide, atol=1e-5)
  for i, p in enumerate(params):
    ref = reference_row(logits[i], prompt=[1, 2], **dataclasses.asdict(p))
    if not ref.ambiguous:
      np.testing.assert_array_equal(
        np.isneginf(narrow[i]), np.isneginf(ref.final), err_msg=f"row {i} {p}"
      )


def _assert_draws_match_exact(row_logits, params, rows, steps, **batch_kwargs):
  """Samples `rows` seeded copies of one request for `steps` steps and compares the token counts
  with the reference distribution: nothing outside it, and a chi-square with (kept - 1) degrees of
  freedom below dof + 5 sqrt(2 dof) (beyond its 99.9th percentile)."""
  vocab = len(row_logits)
  assert steps + 1 <= DRAW_MAX_MODEL_LEN  # the prompt's token and the sampled ones
  batch = je.InputBatch(rows, DRAW_MAX_MODEL_LEN, vocab, **batch_kwargs)
  for i in range(rows):
    batch.add_request(f"r{i}", [0], params.replace(seed=i))
  logits = np.tile(row_logits, (rows, 1))
  counts = np.zeros(vocab)
  for _ in range(steps):
    counts += np.bincount(batch.sample(logits).sampled_token_ids, minlength=vocab)
  ref = reference_row(row_logits, prompt=[0], **dataclasses.asdict(params))
  expected = ref.probs * rows * steps
  assert counts[expected == 0].sum() == 0, "a token outside the kept set was drawn"
  kept = expected > 0
  chi2 = (((counts - expected) ** 2)[kept] / expected[kept]).sum()
  dof = kept.sum() - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof, counts[kept], expected[kept])


def test_rejection_top_p_draw_matches_exact_probabilities():
  """Raw mode with a 2-token budget: every top-p row is drawn by rejection (the deep lists are
  for top-k rows only)."""
  row_logits = np.random.default_rng(7).normal(size=V).astype(np.float32) * 1.5
  _assert_draws_match_exact(
    row_logits,
    je.SamplingParams(temperature=1.0, top_p=0.8),
    rows=256,
    steps=24,
    num_topk_candidates=2,
    deep_candidate_budgets=DRAW_DEEP,
  )


@pytest.mark.parametrize("top_k, top_p", [(7, 1.0), (11, 0.7), (20, 0.95)])
def test_deep_list_draw_matches_exact_probabilities(top_k, top_p):
  """A 2-token shallow list and deep lists of 8 and 24: the rows draw from a deep list."""
  row_logits = np.random.default_rng(top_k).normal(size=V).astype(np.float32)
  row_logits[[3, 9, 30]] = row_logits[5]  # ties
  _assert_draws_match_exact(
    row_logits,
    je.SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p),
    rows=256,
    steps=12,
    num_topk_candidates=2,
    deep_candidate_budgets=DRAW_DEEP,
  )


@pytest.mark.parametrize("top_k", [3, 6, 15])
def test_deep_list_rows_are_batch_invariant(top_k):
  """A seeded row reads its own budget's list whichever deep list its neighbours make the step
  build (or none): the lists are nested, ties included."""
  params = je.SamplingParams(temperature=1.0, top_k=top_k, top_p=0.9, seed=77)
  rng = np.random.default_rng(top_k)
  # Few distinct values: many ties inside and at the edge of every list.
  steps = [rng.choice(np.linspace(-1, 1, 5), size=(8, V)).astype(np.float32) for _ in range(12)]

  def stream(neighbour_top_k):
    batch = je.InputBatch(8, 32, V, num_topk_candidates=2, deep_candidate_budgets=INVARIANCE_DEEP)
    batch.add_request("seeded", [0], params)
    for i in range(5):
      neighbour = je.SamplingParams(temperature=0.7, top_k=neighbour_top_k)
      batch.add_request(f"n{i}", [0], neighbour)
    return [int(batch.sample(logits).sampled_token_ids[0]) for logits in steps]

  levels = {k: stream(k) for k in (0, 2, 4, 8, 20, 40)}  # none, shallow, each list, beyond
  assert all(tokens == levels[0] for tokens in levels.values()), levels


def test_rejection_draw_is_batch_invariant():
  """A seeded top-p row drawn by rejection (its nucleus beyond the 2-token list; top-p alone
  reads no deep list) draws the same tokens whatever its row and neighbours."""
  params = je.SamplingParams(temperature=1.0, top_p=0.9, seed=123)
  rng = np.random.default_rng(3)
  row_logits = rng.normal(size=V).astype(np.float32)

  def stream(position, neighbours):
    batch = je.InputBatch(8, 32, V, num_topk_candidates=2, deep_candidate_budgets=INVARIANCE_DEEP)
    for i in range(8):
      if i == position:
        batch.add_request("seeded", [0], params)
      elif i < neighbours:
        batch.add_request(f"n{i}", [0], je.SamplingParams(temperature=0.7, top_p=0.5))
    tokens = []
    for _ in range(10):
      logits = rng.normal(size=(8, V)).astype(np.float32)
      logits[batch.req_id_to_index["seeded"]] = row_logits
      out = batch.sample(logits)
      tokens.append(int(out.sampled_token_ids[batch.req_id_to_index["seeded"]]))
    return tokens

  assert stream(0, 0) == stream(5, 8) == stream(3, 4)


@pytest.mark.parametrize("deep", [(), PROCESSED_DEEP[1], (5, 9, 13, 30, 46)])
def test_top_k_beyond_the_budget_is_exact(deep):
  """Ties at every cut; the cut is read off a deep list where one holds it, else bisected. (A
  2-token shallow list: the first two cases share the executables of the processed-rows test.)"""
  rng = np.random.default_rng(11)
  logits = rng.choice(np.linspace(-2, 2, 7), size=(R, V)).astype(np.float32)
  batch = _batch(PROCESSED_DEEP[0], deep=deep)
  ks = [5, 6, 9, 13, 20, 30, 47, 1, 2, 3, 4, 8, 10, 16, 24, 40]
  for i, k in enumerate(ks):
    batch.add_request(f"r{i}", [1], je.SamplingParams(top_k=k, logprobs=-1))
  rows = _full_rows(batch.sample(logits))
  for i, k in enumerate(ks):
    kth = np.sort(logits[i])[::-1][k - 1]
    np.testing.assert_array_equal(np.isfinite(rows[i]), logits[i] >= kth, err_msg=f"k={k}")


@pytest.mark.parametrize("k", [1, 5, 20, 64])
def test_two_stage_top_k_matches_lax_top_k(k):
  from jax import lax

  from jaxengine.sample.blocked import blocked_top_k as top_k

  rng = np.random.default_rng(k)
  # Few distinct values (many ties) and some -inf, across a vocabulary wide enough for two stages.
  x = rng.choice(
    np.array([-np.inf, -1.0, 0.0, 0.5, 2.0, 3.0], np.float32),
    size=(6, 8192),
    p=[0.1, 0.5, 0.3, 0.07, 0.02, 0.01],
  )
  x[0] = rng.normal(size=8192)
  values, ids = top_k(x, k)
  want, _ = lax.top_k(x, k)
  np.testing.assert_array_equal(values, want)
  np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), 1), values)
  assert all(len(set(row)) == k for row in np.asarray(ids).tolist())


_ROWS_TOP_K = {}  # (rows, width) -> the jitted `rows_top_k`, compiled once per shape


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
  rows=st.sampled_from([1, 5, 16]),
  width=st.sampled_from([1, 9, 33]),
  seed=st.integers(0, 2**32 - 1),
  fraction=st.floats(0.0, 1.0),
)
def test_deep_list_of_some_rows_is_lax_top_k_of_those_rows(rows, width, seed, fraction):
  """`rows_top_k` (the deep lists, built on gathered rows, chunk by chunk) gives every selected row
  exactly `lax.top_k`'s values and ids: ties, -0.0 against +0.0, infinities, any selection (none,
  a few, a whole chunk, every row)."""
  import jax
  from jax import lax

  from jaxengine.sample.budgets import BUCKETED_VOCAB, rows_top_k

  rng = np.random.default_rng(seed)
  pool = np.array([-np.inf, -1.0, -0.0, 0.0, 0.5, 2.0, np.inf], np.float32)
  x = rng.choice(pool, size=(rows, BUCKETED_VOCAB), p=[0.1, 0.3, 0.15, 0.15, 0.2, 0.08, 0.02])
  x[0] = rng.normal(size=BUCKETED_VOCAB).astype(np.float32)
  selected = rng.random(rows) < fraction
  key = (rows, width)
  if key not in _ROWS_TOP_K:
    _ROWS_TOP_K[key] = jax.jit(lambda x, s, w=width: rows_top_k(x, s, w))
  values, ids = _ROWS_TOP_K[key](x, selected)
  want_values, want_ids = lax.top_k(x, width)
  np.testing.assert_array_equal(
    np.asarray(values)[selected].view(np.int32), np.asarray(want_values)[selected].view(np.int32)
  )
  np.testing.assert_array_equal(np.asarray(ids)[selected], np.asarray(want_ids)[selected])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), sampled_high=st.booleans(), ties=st.booleans())
def test_floored_top_k_is_lax_top_k(seed, sampled_high, ties):
  """The deep list's floor (the tokens below a sampled floor masked before the top-k) changes
  nothing: the same values and ids as `lax.top_k`, including when the floor is too high (the
  sampled tokens, every 8th, the row's largest: fewer than `width` above it) and with ties."""
  import jax
  from jax import lax

  from jaxengine.sample.budgets import FLOOR_STRIDE, floored_top_k

  rng = np.random.default_rng(seed)
  x = rng.normal(size=(4, 2048)).astype(np.float32)
  if ties:
    x = np.round(x * 2) / 2
    x[1, rng.random(2048) < 0.3] = -np.inf
  if sampled_high:
    x[::2, ::FLOOR_STRIDE] += 10.0
  values, ids = jax.jit(floored_top_k, static_argnums=1)(x, 33)
  want_values, want_ids = lax.top_k(x, 33)
  np.testing.assert_array_equal(
    np.asarray(values).view(np.int32), np.asarray(want_values).view(np.int32)
  )
  np.testing.assert_array_equal(ids, want_ids)


def test_top_p_after_rejection_gives_up_is_unbiased():
  """A nearly flat row with a small top_p (its nucleus beyond the draw tests' 2-token list, and
  their executable): about 18% of draws exhaust the rejection attempts and
  take the exact cut, which must draw a fresh uniform (reusing the first one, known to have
  landed outside the nucleus, under-samples the lowest ids)."""
  row_logits = np.linspace(0.0, -0.1, V).astype(np.float32)
  _assert_draws_match_exact(
    row_logits,
    je.SamplingParams(top_p=0.1),
    rows=256,
    steps=40,
    num_topk_candidates=2,
    deep_candidate_budgets=DRAW_DEEP,
  )


def _lowered_sampler(rows: int, vocab: int):
  """`sample_step` lowered for a batch of `rows` x `vocab` with one greedy request."""
  batch = je.InputBatch(rows, 64, vocab)
  batch.add_request("r", [1], je.SamplingParams(temperature=0.0))
  logits = np.zeros((rows, vocab), np.float32)
  return je.sample_step.lower(batch.state, batch.sampling_metadata, logits)


def test_a_step_without_processing_reads_the_logits_in_place():
  """The compiled step's top level holds no `lax.cond` with an `[R, V]` float32 result: a batch
  that needs no stage 0-6 draws from the logits where they are. A branch that returned them
  unchanged (or NaN-cleaned) would write a copy of the logits every step whatever the mix
  (issue 36: it tripled a greedy step at 256 x 49,152)."""
  rows, vocab = 8, ALWAYS_COPIED_LOGITS // 8 + 1  # above ALWAYS_COPIED_LOGITS
  hlo = _lowered_sampler(rows, vocab).compile().as_text()
  entry = hlo[hlo.index("\nENTRY") :]
  entry = entry[: entry.index("\n}")]
  results = [
    line.split(" conditional(")[0] for line in entry.splitlines() if " conditional(" in line
  ]
  assert len(results) >= 3  # the copy choice, the draw, the logprobs: still one executable
  assert not [r for r in results if f"f32[{rows},{vocab}]" in r]


def test_small_logits_compile_the_draw_once():
  """At most `ALWAYS_COPIED_LOGITS` elements: no in-place twin of stages 7-12 (half the
  conditionals and loops of one more row), and the same tokens and logprobs as read in place."""
  vocab = 16384
  rows = ALWAYS_COPIED_LOGITS // vocab
  small, large = (_lowered_sampler(r, vocab).as_text() for r in (rows, rows + 1))
  for op in ("stablehlo.case", "stablehlo.while"):
    assert small.count(op) < large.count(op), op
  assert 2 * small.count("stablehlo.case") == large.count("stablehlo.case")
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((rows + 1, vocab)).astype(np.float32) * 3
  outputs = []
  for num_rows in (rows, rows + 1):
    batch = je.InputBatch(num_rows, 64, vocab)
    for i in range(rows):  # the same requests; the larger batch keeps its last row empty
      params = je.SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i, logprobs=3)
      batch.add_request(f"r{i}", [1, 2], params)
    out = batch.sample(logits[:num_rows])
    outputs.append((out.sampled_token_ids, out.logprobs.logprobs))
  np.testing.assert_array_equal(outputs[0][0], outputs[1][0])
  np.testing.assert_allclose(outputs[0][1], outputs[1][1], rtol=0, atol=1e-6)
