"""The rejection sampler (speculative decoding): vLLM V1's scenarios (behaviour.md §4.5), the
processors with a draft history, the theorem (emitted tokens follow the target distribution),
seeded reproducibility, filters, overflow, compile count and host validation."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import jaxengine as je
from jaxengine.sample import rejection_sample, sample

V = 32
P = 3  # draft positions
RUNNER_UP = 15
_device = jax.jit(rejection_sample)  # not donating: tests read the state afterwards
_sample = jax.jit(sample)


def _batch(params, *, rows=4, max_model_len=64, prompts=None, outputs=None, **kw):
  batch = je.InputBatch(rows, max_model_len, V, -1, kw.pop("logprobs_mode", "raw_logprobs"), **kw)
  for i, p in enumerate(params):
    prompt = prompts[i] if prompts else [3, 4]
    batch.add_request(f"r{i}", prompt, p, outputs[i] if outputs else ())
  return batch


def _greedy_logits(targets, rows=4, positions=P + 1, runner_up=True):
  """[rows, positions, V]: 100 at each listed token, 99 at the runner-up (token 15)."""
  logits = np.zeros((rows, positions, V), np.float32)
  for i, row in enumerate(targets):
    for j, token in enumerate(row):
      if runner_up:
        logits[i, j, RUNNER_UP] = 99.0
      logits[i, j, token] = 100.0
  return logits


def _drafts(drafts, rows=4, num_spec=P):
  ids = np.zeros((rows, num_spec), np.int32)
  num = np.zeros((rows,), np.int32)
  for i, row in enumerate(drafts):
    ids[i, : len(row)] = row
    num[i] = len(row)
  return ids, num


def _run(batch, logits, drafts, draft_probs=None):
  ids, num = _drafts(drafts, batch.max_num_reqs, logits.shape[1] - 1)
  state, out = _device(batch.state, batch.sampling_metadata, logits, ids, num, draft_probs)
  return state, jax.device_get(out)


GREEDY_TABLE = [
  ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
  ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, -1, -1]]),
  ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5, -1], [3, 4, -1, -1]]),
  ([[1]], [[1, 2]], [[1, 2, -1, -1]]),
  ([[]], [[5]], [[5, -1, -1, -1]]),
  ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, -1], [4, 8, -1, -1]]),
  ([[1]], [[2, 3]], [[2, -1, -1, -1]]),
  ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, -1, -1], [3, 4, 7, -1]]),
]


@pytest.mark.parametrize("drafts, targets, expected", GREEDY_TABLE)
def test_greedy_table(drafts, targets, expected):
  batch = _batch([je.SamplingParams(temperature=0)] * len(drafts))
  state, out = _run(batch, _greedy_logits(targets), drafts)
  rows = len(drafts)
  np.testing.assert_array_equal(out.sampled_token_ids[:rows], expected)
  np.testing.assert_array_equal(out.sampled_token_ids[rows:], -1)
  num = (np.asarray(expected) >= 0).sum(1)
  np.testing.assert_array_equal(out.num_sampled[:rows], num)
  assert (out.num_sampled[rows:] == 0).all()
  # Every emitted token is appended (tokens, counts, num_tokens).
  state = jax.device_get(state)
  for i, row in enumerate(expected):
    emitted = [t for t in row if t >= 0]
    assert state.num_tokens[i] == 2 + len(emitted)
    assert state.token_ids[i, 2 : 2 + len(emitted)].tolist() == emitted
    assert state.output_token_counts[i].sum() == len(emitted)


def test_frequency_penalty_counts_the_draft_prefix():
  params = [je.SamplingParams(temperature=0, frequency_penalty=f) for f in (1.5, 1.5, 0.7)]
  batch = _batch(params, outputs=[[2], [3], [4]])
  targets = [[1, 1, 1, 4], [7], [1, 1, 1, 4]]
  _, out = _run(batch, _greedy_logits(targets), [[1, 1, 1], [], [1, 1, 1]])
  np.testing.assert_array_equal(
    out.sampled_token_ids[:3], [[1, 15, -1, -1], [7, -1, -1, -1], [1, 1, 15, -1]]
  )


def test_bad_words_see_the_draft_prefix():
  params = [
    je.SamplingParams(temperature=0, bad_words_token_ids=[[2]]),
    je.SamplingParams(temperature=0),
    je.SamplingParams(temperature=0, bad_words_token_ids=[[1, 2]]),  # prefix 1 is a draft
    je.SamplingParams(temperature=0, bad_words_token_ids=[[3, 2]]),  # never matches
  ]
  batch = _batch(params)
  targets = [[1, 2, 3, 4], [1, 15, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
  _, out = _run(batch, _greedy_logits(targets), [[1, 2, 3], [1, 15, 3], [1, 2, 3], [1, 2, 3]])
  np.testing.assert_array_equal(
    out.sampled_token_ids,
    [[1, 15, -1, -1], [1, 15, 3, 4], [1, 15, -1, -1], [1, 2, 3, 4]],
  )


def test_allowed_token_ids_and_min_tokens_by_position():
  params = [
    je.SamplingParams(temperature=0, allowed_token_ids=[i for i in range(V) if not 0 <= i < 5]),
    je.SamplingParams(temperature=0),
    # min_tokens=2 with stop id 3: position 0 and 1 ban 3, position 2 allows it.
    je.SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
    je.SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
  ]
  batch = _batch(params)
  targets = [[1, 2, 10, 5], [10, 5, 10, 6], [7, 10, 3, 5], [3, 10, 12, 5]]
  drafts = [[1, 2, 10], [10, 5, 3], [7, 10, 3], [3, 10, 12]]
  _, out = _run(batch, _greedy_logits(targets), drafts)
  np.testing.assert_array_equal(
    out.sampled_token_ids,
    [[15, -1, -1, -1], [10, 5, 10, -1], [7, 10, 3, 5], [15, -1, -1, -1]],
  )


def test_max_model_len_overflow_emits_what_fits():
  params = [je.SamplingParams(temperature=0)] * 3
  prompts = [[3] * 6, [3] * 7, [3] * 8]  # room 2, 1 and 0 in a row of 8 tokens
  batch = _batch(params, max_model_len=8, prompts=prompts)
  state, out = _run(batch, _greedy_logits([[1, 2, 3, 4]] * 3), [[1, 2, 3]] * 3)
  np.testing.assert_array_equal(
    out.sampled_token_ids[:3], [[1, 2, -1, -1], [1, -1, -1, -1], [-1, -1, -1, -1]]
  )
  np.testing.assert_array_equal(out.num_sampled[:3], [2, 1, 0])
  np.testing.assert_array_equal(jax.device_get(state.num_tokens)[:3], [8, 8, 8])


def _mixed_params(rng, count):
  params = []
  for _ in range(count):
    kw = dict(temperature=float(rng.choice([0.0, 0.7, 1.0, 1.5])), logprobs=int(rng.integers(0, 4)))
    if rng.random() < 0.5:
      kw["seed"] = int(rng.integers(0, 2**31))
    if rng.random() < 0.4:
      kw["top_k"] = int(rng.integers(1, V))
    if rng.random() < 0.4:
      kw["top_p"] = float(rng.uniform(0.2, 1.0))
    if rng.random() < 0.3:
      kw["min_p"] = float(rng.uniform(0.0, 0.3))
    if rng.random() < 0.4:
      kw["frequency_penalty"] = float(rng.uniform(-1, 1))
      kw["repetition_penalty"] = float(rng.uniform(0.7, 1.5))
    if rng.random() < 0.3:
      kw["logit_bias"] = {int(rng.integers(V)): float(rng.uniform(-2, 2))}
    params.append(je.SamplingParams(**kw))
  return params


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_zero_drafts_equal_the_normal_sampler(mode):
  rng = np.random.default_rng(0)
  params = _mixed_params(rng, 8)
  batch = _batch(params, rows=8, outputs=[[5, 6]] * 8, logprobs_mode=mode)
  logits = rng.normal(size=(8, P + 1, V)).astype(np.float32) * 2
  state, out = _run(batch, logits, [[]] * 8)
  ref_state, ref = jax.device_get(_sample(batch.state, batch.sampling_metadata, logits[:, 0]))
  np.testing.assert_array_equal(out.sampled_token_ids[:, 0], ref.sampled_token_ids)
  assert (out.sampled_token_ids[:, 1:] == -1).all()
  np.testing.assert_array_equal(out.logprobs.token_ids[:, 0], ref.logprobs.token_ids)
  np.testing.assert_allclose(out.logprobs.logprobs[:, 0], ref.logprobs.logprobs, rtol=1e-6)
  np.testing.assert_array_equal(out.logprobs.ranks[:, 0], ref.logprobs.ranks)
  np.testing.assert_array_equal(jax.device_get(state.token_ids), ref_state.token_ids)
  np.testing.assert_array_equal(
    jax.device_get(state.output_token_counts), ref_state.output_token_counts
  )


def test_logprobs_of_accepted_drafts():
  batch = _batch([je.SamplingParams(temperature=0, logprobs=2)])
  logits = _greedy_logits([[1, 2, 3, 4]])
  _, out = _run(batch, logits, [[1, 2, 3]])
  expected = jax.nn.log_softmax(logits[0], -1)
  for j, token in enumerate([1, 2, 3, 4]):
    assert out.logprobs.token_ids[0, j, 0] == token
    assert out.logprobs.ranks[0, j] == 1
    np.testing.assert_allclose(out.logprobs.logprobs[0, j, 0], expected[j, token], rtol=1e-5)
    assert out.logprobs.token_ids[0, j, 1:3].tolist() == [token, RUNNER_UP]


def _chi2_ok(counts, p):
  n = counts.sum()
  big = n * p > 5
  chi2 = float((((counts - n * p) ** 2) / np.where(big, n * p, 1.0))[big].sum())
  df = int(big.sum()) - 1
  assert (counts[p == 0] == 0).all(), "a token of probability 0 was emitted"
  return chi2 <= df + 6 * math.sqrt(2 * df), (chi2, df)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("given_probs", [False, True])
def test_emitted_tokens_follow_the_target_distribution(given_probs):
  """The theorem: with any draft distribution q, the first emitted token follows p_0 and the
  second (where the first draft was accepted) p_1, for point-mass and given drafts alike."""
  rows, vocab, num_spec, calls = 256, 8, 2, 24
  rng = np.random.default_rng(1)
  target = rng.normal(size=(num_spec + 1, vocab)) * 1.2
  target[0, 3] = -np.inf  # a token the target never emits
  q = _softmax(rng.normal(size=(num_spec, vocab)) * 1.5)
  batch = je.InputBatch(rows, 4 + 3 * calls, vocab, 0)
  for i in range(rows):
    batch.add_request(f"r{i}", [0], je.SamplingParams(temperature=1.0))
  logits = np.broadcast_to(target, (rows, num_spec + 1, vocab)).astype(np.float32)
  probs = np.broadcast_to(q, (rows, num_spec, vocab)).astype(np.float32) if given_probs else None
  step = jax.jit(rejection_sample, donate_argnames=("state",))
  state, md = batch.state, batch.sampling_metadata
  first, second = np.zeros(vocab, np.int64), np.zeros(vocab, np.int64)
  for _ in range(calls):
    drafts = np.stack([rng.choice(vocab, size=rows, p=q[j]) for j in range(num_spec)], 1)
    state, out = step(state, md, logits, drafts.astype(np.int32), np.full(rows, 2, np.int32), probs)
    tokens, num = jax.device_get((out.sampled_token_ids, out.num_sampled))
    first += np.bincount(tokens[:, 0], minlength=vocab)
    second += np.bincount(tokens[num >= 2, 1], minlength=vocab)
  p = _softmax(target)
  for counts, dist in ((first, p[0]), (second, p[1])):
    ok, detail = _chi2_ok(counts, dist)
    assert ok, detail
