"""Non-finite logits (NaN, +inf, -inf) never give a token outside the vocabulary or the allowed set.

The defined result (see `sample_step`): NaN counts as -inf; a row whose largest value is +inf takes
its first +inf token; a row with nothing left takes the best allowed token by raw logit.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxengine as je

#: Rows of every batch here: each vocabulary's sampler compiles once for the module.
ROWS = 4

PARAMS = {
  "greedy": dict(temperature=0.0),
  "random": dict(temperature=1.0),
  "top_k": dict(temperature=1.0, top_k=5),
  "top_p": dict(temperature=1.0, top_p=0.9),
  "min_p": dict(temperature=1.0, min_p=0.1),
  "all_filters": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
  "penalties": dict(temperature=1.0, presence_penalty=0.5, top_p=0.9),
}


def _sample(vocab, params, row, allowed=None):
  """The token one seeded request draws from `row` (next to a greedy row; two rows empty)."""
  batch = je.InputBatch(ROWS, 16, vocab)
  batch.add_request("r", [1], je.SamplingParams(seed=7, allowed_token_ids=allowed, **params))
  batch.add_request("g", [1], je.SamplingParams(temperature=0.0))
  logits = np.zeros((ROWS, vocab), np.float32)
  logits[0] = row
  return int(batch.sample(logits).sampled_token_ids[0])


def _row(vocab, seed=0):
  return np.random.default_rng(seed).normal(size=vocab).astype(np.float32)


@pytest.mark.parametrize("vocab", [1000, 1024])
@pytest.mark.parametrize("name", list(PARAMS))
def test_all_nan_or_all_masked_rows_give_the_first_allowed_token(vocab, name):
  for fill in (np.nan, -np.inf):
    row = np.full(vocab, fill, np.float32)
    assert _sample(vocab, PARAMS[name], row) == 0
    assert _sample(vocab, PARAMS[name], row, allowed=[vocab - 3, 17]) == 17


@pytest.mark.parametrize("vocab", [1000, 1024])
@pytest.mark.parametrize("name", list(PARAMS))
def test_a_nan_logit_counts_as_minus_inf(vocab, name):
  row = _row(vocab)
  nan_at = [int(np.argmax(row)), 3, vocab - 1]  # the best token among them
  with_nan, with_neg_inf = row.copy(), row.copy()
  with_nan[nan_at], with_neg_inf[nan_at] = np.nan, -np.inf
  token = _sample(vocab, PARAMS[name], with_nan)
  assert 0 <= token < vocab and token not in nan_at
  assert token == _sample(vocab, PARAMS[name], with_neg_inf)
  allowed = [5, 6, vocab - 1]
  assert _sample(vocab, PARAMS[name], with_nan, allowed=allowed) in (5, 6)


@pytest.mark.parametrize("vocab", [1000, 1024])
@pytest.mark.parametrize("name", list(PARAMS))
def test_plus_inf_rows_take_their_first_plus_inf_token(vocab, name):
  row = _row(vocab)
  row[[vocab - 2, 9]] = np.inf
  assert _sample(vocab, PARAMS[name], row) == 9
  assert _sample(vocab, PARAMS[name], row, allowed=[4, vocab - 2]) == vocab - 2
  row[[11, 12]] = np.nan
  assert _sample(vocab, PARAMS[name], row) == 9


def test_nan_rows_do_not_change_their_neighbours():
  vocab = 1000
  params = je.SamplingParams(temperature=1.0, top_p=0.9, seed=3)
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(ROWS, vocab)).astype(np.float32)

  def tokens(poison):
    batch = je.InputBatch(ROWS, 16, vocab)
    for i in range(ROWS):
      batch.add_request(f"r{i}", [1], params.replace(seed=i))
    x = logits.copy()
    if poison:
      x[1] = np.nan
      x[2, :10] = np.inf
    return batch.sample(x).sampled_token_ids

  clean, poisoned = tokens(False), tokens(True)
  np.testing.assert_array_equal(clean[[0, 3]], poisoned[[0, 3]])
  assert poisoned[1] == 0 and poisoned[2] == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nans_behind_the_best_token_count_as_minus_inf(temperature):
  """Each row's best token (10.0) is followed in its block of 256 by NaN at strides 8 to 64, and
  a runner-up (6.0) sits in another block: the token is the one drawn with those NaN at -inf. A
  vectorised max that restarts its lane after a NaN (XLA:CPU's does) sees the best token's block
  top out near 3 and would pick the runner-up, a token no NaN check on the result can catch.
  Sixteen rows, sampled `ROWS` at a time."""
  rows, vocab = 16, 1024
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(rows, vocab)).astype(np.float32)
  best = 256 * rng.integers(0, vocab // 256, rows) + rng.integers(0, 128, rows)
  runner_up = (best + 512) % vocab
  everyone = np.arange(rows)
  logits[everyone, best], logits[everyone, runner_up] = 10.0, 6.0
  for stride in (8, 16, 32, 64):
    logits[everyone, best + stride] = np.nan

  def tokens(x):
    out = []
    for first in range(0, rows, ROWS):
      batch = je.InputBatch(ROWS, 16, vocab)
      for i in range(first, first + ROWS):
        batch.add_request(f"r{i}", [1], je.SamplingParams(temperature=temperature, seed=i))
      out.extend(batch.sample(x[first : first + ROWS]).sampled_token_ids)
    return np.array(out)

  with_neg_inf = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)
  expected = tokens(with_neg_inf)
  np.testing.assert_array_equal(tokens(logits), expected)
  if temperature == 0.0:
    np.testing.assert_array_equal(expected, best)
