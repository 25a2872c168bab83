"""Small helpers shared by the core tests: standard capacities (so each executable compiles once per
test session) and readers for the sampler's logprob output."""

from __future__ import annotations

import numpy as np
from hypothesis import event as _event
from reference import assert_rows_match, full_row_from_logprobs, rank_of

import jaxengine as je

# Standard capacities. Every test that can uses these, so the jitted functions compile once.
R = 8  # max_num_reqs
V = 32  # vocab_size
MML = 64  # max_model_len
EOS = (V - 1,)  # eos_token_ids of the standard batch

# Standard sampler configurations. Each (capacities, vocabulary, logprobs mode and count, candidate
# budgets, processors, logits dtype) is an executable of its own, which the run's persistent
# compilation cache shares between modules: a test that needs no particular setting uses one of
# these (`make_batch(**RAW)`), and a test that needs a special one (to reach a code path) shares
# it with the others that need the same. The batch's seed and EOS ids are data, not part of it.
#: make_batch's default: `processed_logprobs` over the whole vocabulary (logprobs=-1 reads a row).
PROCESSED = dict(logprobs_mode="processed_logprobs", max_num_logprobs=-1)
#: `processed_logits` over the whole vocabulary: a greedy row reads its post-penalty logits.
PROCESSED_LOGITS = dict(logprobs_mode="processed_logits", max_num_logprobs=-1)
#: vLLM's default mode and a top-20 limit (no full sort of the rows).
RAW = dict(logprobs_mode="raw_logprobs", max_num_logprobs=20)
#: `raw_logprobs` over the whole vocabulary.
RAW_ALL = dict(logprobs_mode="raw_logprobs", max_num_logprobs=-1)
#: `raw_logits` over the whole vocabulary.
RAW_LOGITS_ALL = dict(logprobs_mode="raw_logits", max_num_logprobs=-1)
#: Small candidate budgets over the standard vocabulary: the shallow list (3), two deep lists (7
#: and 13) and, beyond them, the bisection; top-p nuclei deeper than 3 candidates are drawn by
#: rejection.
SMALL_BUDGETS = dict(num_topk_candidates=3, deep_candidate_budgets=(7, 13))
#: A vocabulary wider than the default shallow candidate budget (64): deep top-k cuts read the deep
#: list (the default deep budgets clip to it), deep top-p nuclei are drawn by rejection.
V_WIDE = 160


def make_batch(
  *,
  max_num_reqs=R,
  vocab_size=V,
  max_model_len=MML,
  max_num_logprobs=-1,
  logprobs_mode="processed_logprobs",
  eos_token_ids=EOS,
  seed=0,
  **kw,
):
  return je.InputBatch(
    max_num_reqs,
    max_model_len,
    vocab_size,
    max_num_logprobs,
    logprobs_mode,
    eos_token_ids=eos_token_ids,
    seed=seed,
    **kw,
  )


def padded_logits(rows_by_req, batch, vocab_size=V, max_num_reqs=R, fill=0.0):
  """[max_num_reqs, V] float32 logits with row i = rows_by_req[batch.req_ids[i]] (post-condense order).

  Call after `batch.condense()` so that req_ids is the row order sample() will use.
  """
  logits = np.full((max_num_reqs, vocab_size), fill, dtype=np.float32)
  for i, rid in enumerate(batch.req_ids):
    logits[i] = np.asarray(rows_by_req[rid], dtype=np.float32)
  return logits


def full_rows(out, vocab_size=V):
  """[num_reqs, V] float64: each row's whole-vocabulary logprob/logit vector (needs logprobs=-1)."""
  lp = out.logprobs
  assert lp is not None, "expected logprobs output"
  return np.stack(
    [
      full_row_from_logprobs(lp.token_ids[i], lp.logprobs[i], vocab_size)
      for i in range(lp.token_ids.shape[0])
    ]
  )


def expected_condense(rows):
  """Plain-Python condense rule on a list of row occupants (None = hole).

  Repeatedly moves the highest live row into the lowest hole while the hole is below it; then
  truncates to the number of live rows. Returns the new list (no None).
  """
  rows = list(rows)
  while True:
    live = [i for i, r in enumerate(rows) if r is not None]
    holes = [i for i, r in enumerate(rows) if r is None]
    if not live or not holes:
      break
    hi, lo = live[-1], holes[0]
    if lo > hi:
      break
    rows[lo], rows[hi] = rows[hi], None
  n = sum(r is not None for r in rows)
  assert all(r is not None for r in rows[:n])
  return rows[:n]


def event(msg):
  try:
    _event(msg)
  except Exception:  # outside a hypothesis test
    pass


def check_row(ref, kw, token, got_vec, rank, col0_value, *, processed, context, vocab_size=V):
  """Checks one sampled row against its reference result (see test_sampler_reference)."""
  allowed = kw.get("allowed_token_ids")
  if allowed is not None:
    assert token in allowed, f"{context}: token {token} outside allowed_token_ids {allowed}"
  assert 0 <= token < vocab_size
  if ref.all_masked:
    event("fully masked row")
    return
  # Logprob format, whatever the mode: rank = #entries >= the sampled value; col 0 = sampled value.
  # The rank is counted on the scores, the vector is normalised (`score - logsumexp`): rounding is
  # monotone, so normalising can merge two values a float32 ulp apart but never reorders them.
  values = np.asarray(got_vec, dtype=np.float64)
  strictly_above = int(np.sum(values > values[token]))
  assert strictly_above < rank <= rank_of(got_vec, token), (
    f"{context}: rank {rank} vs recount {strictly_above} above, {rank_of(got_vec, token)} >="
  )
  np.testing.assert_allclose(col0_value, got_vec[token], rtol=1e-6, atol=1e-6)
  if ref.ambiguous:
    event("ambiguous row (threshold within tolerance)")
    assert np.isfinite(ref.penalized[token]), f"{context}: sampled a masked token {token}"
    return
  if ref.is_greedy:
    assert token in ref.greedy_candidates, (
      f"{context}: greedy token {token}, reference argmax {ref.greedy_token} "
      f"(penalized row {ref.penalized})"
    )
    if ref.greedy_ties_genuine:
      assert token == ref.greedy_token, f"{context}: greedy ties must resolve to the first index"
  else:
    assert ref.probs[token] > 0, (
      f"{context}: sampled token {token} has reference probability 0; final {ref.final}"
    )
  if processed:
    assert_rows_match(got_vec, ref.processed_logprobs, context=context)
