"""Property tests: random batches through InputBatch.sample vs the float64 reference
(tests/helpers/reference.py).

Every request asks for logprobs=-1 in a batch built with max_num_logprobs=-1, so the logprob output
holds each row's whole vocabulary; in `processed_logprobs` mode that is log_softmax of the final
filtered logits, which is compared entry by entry (same -inf mask, values within 1e-4) with the
reference. Requests are added around removed "junk" requests with loud parameters so that any
per-row state a new request fails to overwrite shows up. Two steps are sampled so that output-token
bookkeeping (penalties, bad words, min_tokens) is exercised after an append.

Capacities are fixed (batch_utils.R, V, MML), so the sampler compiles once for the module.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from batch_utils import (
  RAW_ALL,
  SMALL_BUDGETS,
  V_WIDE,
  R,
  V,
  check_row,
  full_rows,
  make_batch,
  padded_logits,
)
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from reference import reference_row

DISCRETE_LOGITS = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0], dtype=np.float32)


@st.composite
def request(draw, vocab_size=V):
  """(prompt, outputs, SamplingParams kwargs) with a random mix of every row-level feature."""
  token = st.integers(0, vocab_size - 1)
  prompt = draw(st.lists(token, min_size=1, max_size=8))
  outputs = draw(st.lists(token, max_size=8))
  kw: dict = {"logprobs": -1}
  kw["temperature"] = draw(
    st.one_of(st.just(0.0), st.sampled_from([0.3, 0.5, 0.8, 1.0, 1.3, 2.0]), st.floats(0.3, 3.0))
  )
  if draw(st.booleans()):
    kw["top_k"] = draw(
      st.one_of(
        st.sampled_from([0, -1, vocab_size, vocab_size + 3]), st.integers(1, vocab_size - 1)
      )
    )
  if draw(st.booleans()):
    kw["top_p"] = draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0)))
  if draw(st.booleans()):
    kw["min_p"] = draw(st.one_of(st.just(1.0), st.floats(0.0, 0.9)))
  if draw(st.booleans()):
    kw["presence_penalty"] = draw(st.floats(-2.0, 2.0))
  if draw(st.booleans()):
    kw["frequency_penalty"] = draw(st.floats(-2.0, 2.0))
  if draw(st.booleans()):
    kw["repetition_penalty"] = draw(st.one_of(st.sampled_from([0.5, 2.0]), st.floats(0.1, 2.5)))
  if draw(st.booleans()):
    kw["logit_bias"] = draw(st.dictionaries(token, st.floats(-3.0, 3.0), min_size=1, max_size=6))
  if draw(st.integers(0, 3)) == 0:
    kw["allowed_token_ids"] = draw(st.lists(token, min_size=1, max_size=vocab_size, unique=True))
  if draw(st.booleans()):
    words = draw(st.lists(st.lists(token, min_size=1, max_size=3), min_size=1, max_size=4))
    if outputs and draw(st.booleans()):
      # A multi-token word whose prefix matches the output tail, so it must fire.
      n = draw(st.integers(1, min(2, len(outputs))))
      words.append(outputs[-n:] + [draw(token)])
    kw["bad_words_token_ids"] = words
  if draw(st.booleans()):
    kw["min_tokens"] = draw(st.integers(0, 10))
    kw["stop_token_ids"] = draw(st.lists(token, max_size=4))
  if draw(st.booleans()):
    kw["seed"] = draw(st.integers(0, 2**31 - 1))
  return prompt, outputs, kw


@dataclasses.dataclass
class Case:
  first: list  # live requests added before the junk is removed
  junk: list  # requests added then removed (their rows become holes)
  second: list  # live requests added afterwards (fill holes lowest-first, then append)
  order: list  # interleaving of first/junk adds: True = live, False = junk
  logit_seed: int
  discrete: bool
  vocab_size: int = V


@st.composite
def batch_case(draw, vocab_size=V):
  n_first = draw(st.integers(0, R))
  n_junk = draw(st.integers(0, R - n_first))
  n_second = draw(st.integers(1 if n_first == 0 else 0, R - n_first))
  first = [draw(request(vocab_size)) for _ in range(n_first)]
  junk = [draw(request(vocab_size)) for _ in range(n_junk)]
  second = [draw(request(vocab_size)) for _ in range(n_second)]
  order = draw(st.permutations([True] * n_first + [False] * n_junk))
  return Case(
    first,
    junk,
    second,
    list(order),
    draw(st.integers(0, 2**32 - 1)),
    draw(st.booleans()),
    vocab_size,
  )


def _logit_row(rng, discrete, vocab_size=V):
  if (
    discrete
  ):  # few distinct values -> many exact ties (top-k / top-p tie rules, greedy first index)
    return rng.choice(DISCRETE_LOGITS, size=vocab_size)
  return rng.uniform(-3.0, 3.0, size=vocab_size).astype(np.float32)


def _add(b, rid, prompt, kw, outputs):
  """Adds a generated request; cases the batch refuses as unsatisfiable (every token banned
  whatever the output) are discarded."""
  import jaxengine as je

  try:
    b.add_request(rid, prompt, je.SamplingParams(**kw), output_token_ids=outputs)
  except ValueError as error:
    if "could ever be sampled" in str(error) or "forbids stopping first" in str(error):
      reject()
    raise


def _build(case, mode, **batch_kwargs):
  vs = case.vocab_size
  b = make_batch(logprobs_mode=mode, vocab_size=vs, eos_token_ids=(vs - 1,), **batch_kwargs)
  live = {}
  it_first, it_junk = iter(case.first), iter(case.junk)
  junk_ids = []
  for n, is_live in enumerate(case.order):
    prompt, outputs, kw = next(it_first) if is_live else next(it_junk)
    rid = f"{'live' if is_live else 'junk'}-{n}"
    _add(b, rid, prompt, kw, outputs)
    if is_live:
      live[rid] = (prompt, list(outputs), kw)
    else:
      junk_ids.append(rid)
  for rid in junk_ids:
    b.remove_request(rid)
  for n, (prompt, outputs, kw) in enumerate(case.second):
    rid = f"second-{n}"
    _add(b, rid, prompt, kw, outputs)
    live[rid] = (prompt, list(outputs), kw)
  b.condense()
  assert sorted(b.req_ids) == sorted(live)
  assert b.num_reqs == len(live)
  assert b.req_id_to_index == {rid: i for i, rid in enumerate(b.req_ids)}
  return b, live


def _run_case(case, mode, **batch_kwargs):
  b, live = _build(case, mode, **batch_kwargs)
  vs = case.vocab_size
  rng = np.random.default_rng(case.logit_seed)
  for step in range(2):
    rows = {rid: _logit_row(rng, case.discrete, vs) for rid in live}
    # Rows >= num_reqs hold garbage that must be ignored.
    logits = padded_logits(rows, b, vocab_size=vs, fill=0.0)
    logits[b.num_reqs :] = rng.uniform(-50, 50, size=(R - b.num_reqs, vs))
    order = list(b.req_ids)
    out = b.sample(logits)
    assert out.sampled_token_ids.shape == (len(order),)
    got = full_rows(out, vs)
    for i, rid in enumerate(order):
      prompt, outputs, kw = live[rid]
      ref = reference_row(rows[rid], prompt=prompt, outputs=outputs, eos_token_ids=(vs - 1,), **kw)
      token = int(out.sampled_token_ids[i])
      assert int(out.logprobs.token_ids[i, 0]) == token
      check_row(
        ref,
        kw,
        token,
        got[i],
        int(out.logprobs.ranks[i]),
        out.logprobs.logprobs[i, 0],
        processed=(mode == "processed_logprobs"),
        vocab_size=vs,
        context=f"step {step} row {i} req {rid} params {kw} prompt {prompt} outputs {outputs}",
      )
      outputs.append(token)
    assert list(b.req_ids) == order
    assert [list(o) for o in b.req_output_token_ids] == [live[rid][1] for rid in order]


SETTINGS = dict(
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
  derandomize=False,
)


@settings(max_examples=50, **SETTINGS)
@given(case=batch_case())
def test_processed_logprobs_match_reference(case):
  _run_case(case, "processed_logprobs")


@settings(max_examples=15, **SETTINGS)
@given(case=batch_case())
def test_raw_mode_tokens_respect_reference(case):
  """raw_logprobs mode: tokens still obey every constraint; the rows are log_softmax of the input."""
  _run_case(case, "raw_logprobs")


# V_WIDE: a vocabulary wider than the sampler's default top-k candidate budget (64), so that deep
# top-k cuts (flat discrete logits, large k) go through the deep list (the default deep budgets
# clip to V_WIDE) and deep top-p cuts (p near 1) through the rejection draw.


@settings(max_examples=20, **SETTINGS)
@given(case=batch_case(V_WIDE))
def test_processed_logprobs_match_reference_wide_vocab(case):
  _run_case(case, "processed_logprobs")


# SMALL_BUDGETS: the shallow list (3), two deep lists (7 and 13) and, beyond them, the bisection;
# top-p nuclei deeper than 3 candidates are drawn by rejection.


@settings(max_examples=30, **SETTINGS)
@given(case=batch_case())
def test_processed_logprobs_match_reference_with_small_candidate_budgets(case):
  _run_case(case, "processed_logprobs", **SMALL_BUDGETS)


@settings(max_examples=10, **SETTINGS)
@given(case=batch_case())
def test_raw_mode_tokens_respect_reference_with_small_candidate_budgets(case):
  _run_case(case, "raw_logprobs", **SMALL_BUDGETS)


def test_raw_logprobs_are_log_softmax_of_input():
  from reference import log_softmax

  import jaxengine as je

  b = make_batch(**RAW_ALL)
  rng = np.random.default_rng(5)
  params = [
    dict(temperature=0.0, repetition_penalty=2.0, logit_bias={3: 2.0}),
    dict(temperature=0.7, top_k=3, min_p=0.2, allowed_token_ids=[1, 2, 3, 4]),
    dict(temperature=1.0, top_p=0.3, frequency_penalty=1.0, bad_words_token_ids=[[5]]),
  ]
  for n, kw in enumerate(params):
    b.add_request(f"r{n}", [1, 2, 3], je.SamplingParams(logprobs=-1, **kw), output_token_ids=[5, 5])
  logits = rng.uniform(-3, 3, size=(R, V)).astype(np.float32)
  out = b.sample(logits)
  got = full_rows(out)
  for i in range(3):
    np.testing.assert_allclose(got[i], log_softmax(logits[i]), atol=1e-5)
