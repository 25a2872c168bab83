"""The rejection sampler (speculative decoding): vLLM V1's scenarios (docs/sampling.md §1.4), the
processors with a draft history, the theorem (emitted tokens follow the target distribution),
seeded reproducibility, filters, overflow, logprobs, compile count and host validation.

Every test uses one batch configuration, so the step compiles once (twice with draft_probs)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxengine as je
from jaxengine.sample import rejection_sample_step

R, V, MML, P = 32, 32, 64, 3  # rows, vocabulary, max_model_len, draft positions
RUNNER_UP = 15
GREEDY = je.SamplingParams(temperature=0)


class NoRepeat(je.LogitsProcessor):
  """Bans the row's previous token (state: that token), for rows with `extra_args["no_repeat"]`:
  a processor whose state must advance one step per draft."""

  def init_state(self, max_num_reqs, vocab_size):
    return {"last": jnp.zeros((max_num_reqs,), jnp.int32)}

  def row_state(self, params, prompt_token_ids):
    return {"last": prompt_token_ids[-1]} if (params.extra_args or {}).get("no_repeat") else None

  def apply(self, state, active, logits):
    banned = jnp.arange(logits.shape[-1]) == state["last"][:, None]
    return jnp.where(active[:, None] & banned, -jnp.inf, logits)

  def update_state(self, state, sampled_token_ids, active):
    return {"last": jnp.where(active, sampled_token_ids, state["last"])}


NO_REPEAT = NoRepeat()  # one instance: one BatchConfig, so every test shares the executables


def _batch(params, *, prompts=None, outputs=None):
  batch = je.InputBatch(
    R, MML, V, -1, "processed_logprobs", max_spec_len=P, logits_processors=[NO_REPEAT]
  )
  for i, p in enumerate(params):
    batch.add_request(f"r{i}", prompts[i] if prompts else [3, 4], p, outputs[i] if outputs else ())
  return batch


def _greedy_logits(targets):
  """[R, P + 1, V]: 100 at each listed token, 99 at the runner-up (token 15)."""
  logits = np.zeros((R, P + 1, V), np.float32)
  for i, row in enumerate(targets):
    for j, token in enumerate(row):
      logits[i, j, RUNNER_UP] = 99.0
      logits[i, j, token] = 100.0
  return logits


def _padded(rows, width=P + 1):
  return np.array([list(row) + [-1] * (width - len(row)) for row in rows], np.int32)


GREEDY_TABLE = [
  ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),
  ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5]]),
  ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4]]),
  ([[1]], [[1, 2]], [[1, 2]]),
  ([[]], [[5]], [[5]]),
  ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7], [4, 8]]),
  ([[1]], [[2, 3]], [[2]]),
  ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5], [3, 4, 7]]),
]


@pytest.mark.parametrize("drafts, targets, expected", GREEDY_TABLE)
def test_greedy_table(drafts, targets, expected):
  batch = _batch([GREEDY] * len(drafts))
  out = batch.rejection_sample(_greedy_logits(targets), drafts)
  np.testing.assert_array_equal(out.sampled_token_ids, _padded(expected))
  np.testing.assert_array_equal(out.num_sampled, [len(row) for row in expected])
  assert out.logprobs is None
  state = jax.device_get(batch.state)
  for i, row in enumerate(expected):  # appended on the host and on the device
    assert batch.req_output_token_ids[i] == row
    assert state.num_tokens[i] == 2 + len(row)
    assert state.token_ids[i, 2 : 2 + len(row)].tolist() == row
    assert state.output_token_counts[i].sum() == len(row)


def test_frequency_penalty_counts_the_draft_prefix():
  params = [je.SamplingParams(temperature=0, frequency_penalty=f) for f in (1.5, 1.5, 0.7)]
  batch = _batch(params, outputs=[[2], [3], [4]])
  logits = _greedy_logits([[1, 1, 1, 4], [7], [1, 1, 1, 4]])
  out = batch.rejection_sample(logits, [[1, 1, 1], [], [1, 1, 1]])
  np.testing.assert_array_equal(out.sampled_token_ids, _padded([[1, 15], [7], [1, 1, 15]]))


def test_bad_words_see_the_draft_prefix():
  params = [
    je.SamplingParams(temperature=0, bad_words_token_ids=[[2]]),
    GREEDY,
    je.SamplingParams(temperature=0, bad_words_token_ids=[[1, 2]]),  # prefix 1 is a draft
    je.SamplingParams(temperature=0, bad_words_token_ids=[[3, 2]]),  # never matches
  ]
  batch = _batch(params)
  logits = _greedy_logits([[1, 2, 3, 4], [1, 15, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
  out = batch.rejection_sample(logits, [[1, 2, 3], [1, 15, 3], [1, 2, 3], [1, 2, 3]])
  expected = [[1, 15], [1, 15, 3, 4], [1, 15], [1, 2, 3, 4]]
  np.testing.assert_array_equal(out.sampled_token_ids, _padded(expected))


def test_allowed_token_ids_and_min_tokens_by_position():
  params = [
    je.SamplingParams(temperature=0, allowed_token_ids=[i for i in range(V) if not 0 <= i < 5]),
    GREEDY,
    # min_tokens=2 with stop id 3: positions 0 and 1 ban 3, position 2 allows it.
    je.SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
    je.SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
  ]
  batch = _batch(params)
  logits = _greedy_logits([[1, 2, 10, 5], [10, 5, 10, 6], [7, 10, 3, 5], [3, 10, 12, 5]])
  out = batch.rejection_sample(logits, [[1, 2, 10], [10, 5, 3], [7, 10, 3], [3, 10, 12]])
  expected = [[15], [10, 5, 10], [7, 10, 3, 5], [15]]
  np.testing.assert_array_equal(out.sampled_token_ids, _padded(expected))


def test_custom_processor_state_advances_per_draft():
  params = je.SamplingParams(temperature=0, extra_args={"no_repeat": True})
  batch = _batch([params, GREEDY])
  # Position 0 bans 4 (the prompt's last token); position 1 bans draft 5, so 15 wins there.
  out = batch.rejection_sample(_greedy_logits([[5, 5, 7, 8], [5, 5, 7, 8]]), [[5, 5, 7]] * 2)
  np.testing.assert_array_equal(out.sampled_token_ids, _padded([[5, 15], [5, 5, 7, 8]]))
  # The state followed the emitted tokens: 15 is banned at the next step's first position.
  logits = _greedy_logits([[15, 9], [15, 9]])
  logits[:, 0, 8] = 99.5
  out = batch.rejection_sample(logits, [[15], [15]])
  np.testing.assert_array_equal(out.sampled_token_ids, _padded([[8], [15, 9]]))


def test_rows_with_structured_outputs_ignore_their_drafts():
  batch = _batch([GREEDY, GREEDY])
  state = jax.tree.map(jnp.copy, batch.state)
  state = dataclasses.replace(state, has_grammar=state.has_grammar.at[0].set(True))
  ids, num = np.ones((R, P), np.int32), np.full((R,), P, np.int32)
  logits = _greedy_logits([[1, 1, 1, 1]] * 2)
  _, out = rejection_sample_step(state, batch.sampling_metadata, logits, ids, num, None)
  np.testing.assert_array_equal(out.sampled_token_ids[:2], _padded([[1], [1, 1, 1, 1]]))


def test_max_model_len_overflow_emits_what_fits():
  prompts = [[3] * (MML - 2), [3] * (MML - 1), [3] * 2]  # room for 2, 1 and many tokens
  batch = _batch([GREEDY] * 3, prompts=prompts)
  out = batch.rejection_sample(_greedy_logits([[1, 2, 3, 4]] * 3), [[1, 2, 3]] * 3)
  np.testing.assert_array_equal(out.sampled_token_ids, _padded([[1, 2], [1], [1, 2, 3, 4]]))
  np.testing.assert_array_equal(jax.device_get(batch.state.num_tokens)[:3], [MML, MML, 6])
  with pytest.raises(ValueError, match="max_model_len"):  # full rows are refused, as by sample
    batch.rejection_sample(_greedy_logits([]), [[], [], []])


def _mixed_params(rng, count, seeded=0.5):
  params = []
  for _ in range(count):
    kw = dict(temperature=float(rng.choice([0.0, 0.7, 1.0, 1.5])), logprobs=int(rng.integers(0, 4)))
    if rng.random() < seeded:
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
    if rng.random() < 0.2:
      kw["bad_words_token_ids"] = [rng.integers(0, V, size=2).tolist()]
    params.append(je.SamplingParams(**kw))
  return params


def test_zero_drafts_equal_the_normal_sampler():
  rng = np.random.default_rng(0)
  params = _mixed_params(rng, R)
  outputs = [rng.integers(0, V, size=3).tolist() for _ in range(R)]
  spec, plain = _batch(params, outputs=outputs), _batch(params, outputs=outputs)
  logits = (rng.normal(size=(R, P + 1, V)) * 2).astype(np.float32)
  out = spec.rejection_sample(logits, [[]] * R)
  ref = plain.sample(logits[:, 0])
  np.testing.assert_array_equal(out.sampled_token_ids[:, 0], ref.sampled_token_ids)
  assert (out.sampled_token_ids[:, 1:] == -1).all()
  assert out.logprobs is not None and ref.logprobs is not None
  np.testing.assert_array_equal(out.logprobs.token_ids[:, 0], ref.logprobs.token_ids)
  np.testing.assert_allclose(out.logprobs.logprobs[:, 0], ref.logprobs.logprobs, rtol=1e-5)
  np.testing.assert_array_equal(out.logprobs.ranks[:, 0], ref.logprobs.ranks)
  assert spec.req_output_token_ids == plain.req_output_token_ids
  for name in ("token_ids", "num_tokens", "output_token_counts"):
    np.testing.assert_array_equal(getattr(spec.state, name), getattr(plain.state, name))


def test_logprobs_of_every_emitted_position():
  batch = _batch([je.SamplingParams(temperature=0, logprobs=2), GREEDY])
  logits = _greedy_logits([[1, 2, 3, 4], [6]])
  out = batch.rejection_sample(logits[:2], [[1, 2, 3], []])  # num_reqs rows: padded on device
  assert out.logprobs is not None and out.logprobs.token_ids.shape == (2, P + 1, 3)
  expected = jax.nn.log_softmax(logits[0], -1)
  for j, token in enumerate([1, 2, 3, 4]):
    assert out.logprobs.token_ids[0, j].tolist() == [token, token, RUNNER_UP]
    assert out.logprobs.ranks[0, j] == 1
    np.testing.assert_allclose(out.logprobs.logprobs[0, j, 0], expected[j, token], rtol=1e-5)


def _independent_calls(batch, logits, drafts, num_drafts, calls, draft_probs=None, seed=0):
  """Runs the step `calls` times on copies of the batch state with fresh random request keys:
  independent draws of every row. Yields `(sampled_token_ids, num_sampled)` as NumPy."""
  rng = np.random.default_rng(seed)
  md = batch.sampling_metadata
  for c in range(calls):
    state = jax.tree.map(jnp.copy, batch.state)
    keys = rng.integers(0, 2**32, size=state.key_data.shape, dtype=np.uint32)
    state = dataclasses.replace(state, key_data=jnp.asarray(keys))
    d = drafts(c) if callable(drafts) else drafts
    _, out = rejection_sample_step(state, md, logits, d, num_drafts, draft_probs)
    yield jax.device_get((out.sampled_token_ids, out.num_sampled))


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _assert_chi2(counts, p):
  n = counts.sum()
  assert (counts[p == 0] == 0).all(), "a token of probability 0 was emitted"
  big = n * p > 5
  chi2 = float((((counts - n * p) ** 2) / np.where(big, n * p, 1.0))[big].sum())
  df = int(big.sum()) - 1
  assert chi2 <= df + 6 * math.sqrt(2 * df), (chi2, df, n)


@pytest.mark.parametrize("given_probs", [False, True])
def test_emitted_tokens_follow_the_target_distribution(given_probs):
  """The theorem: whatever the draft distribution q, the first emitted token follows p_0 and the
  second (where the first draft was accepted) p_1; with q given and with point-mass drafts."""
  rng = np.random.default_rng(1)
  target = rng.normal(size=(P + 1, V)) * 1.5
  target[0, :4] = -np.inf  # tokens the target never emits (the drafts often propose them)
  q = _softmax(rng.normal(size=(P, V)) * 1.5)
  q[0, :4] += 0.3
  q /= q.sum(-1, keepdims=True)
  batch = _batch([je.SamplingParams(temperature=1.0)] * R)
  logits = np.broadcast_to(target, (R, P + 1, V)).astype(np.float32)
  probs = np.broadcast_to(q, (R, P, V)).astype(np.float32) if given_probs else None
  draw = lambda c: np.stack([rng.choice(V, size=R, p=q[j]) for j in range(P)], 1).astype(np.int32)
  first, second = np.zeros(V, np.int64), np.zeros(V, np.int64)
  for tokens, num in _independent_calls(batch, logits, draw, np.full(R, P, np.int32), 300, probs):
    first += np.bincount(tokens[:, 0], minlength=V)
    second += np.bincount(tokens[num >= 2, 1], minlength=V)
  p = _softmax(target)
  _assert_chi2(first, p[0])
  _assert_chi2(second, p[1])


def _kept(logits, top_k, top_p):
  """[V] bool the tokens top-k then top-p keep (vLLM's rules)."""
  kth = np.sort(logits)[::-1][top_k - 1]
  y = np.where(logits >= kth, logits, -np.inf)
  p = _softmax(y)
  above = np.array([p[p > pt].sum() for pt in p])
  return (y > -np.inf) & (above < top_p)


def test_every_emitted_token_respects_top_k_and_top_p():
  rng = np.random.default_rng(2)
  settings = [(k, p) for k in (1, 5, V) for p in (0.5, 0.9, 1.0)]
  params = [
    je.SamplingParams(temperature=1.0, top_k=settings[i % 9][0], top_p=settings[i % 9][1])
    for i in range(R)
  ]
  batch = _batch(params)
  logits = (rng.normal(size=(R, P + 1, V)) * 2).astype(np.float32)
  drafts = lambda c: rng.integers(0, V, size=(R, P)).astype(np.int32)
  num = rng.integers(0, P + 1, size=R).astype(np.int32)
  kept = np.array([[_kept(logits[i, j], *settings[i % 9]) for j in range(P + 1)] for i in range(R)])
  for tokens, count in _independent_calls(batch, logits, drafts, num, 20):
    for i in range(R):
      for j in range(count[i]):
        assert kept[i, j, tokens[i, j]], (i, j, tokens[i, j], settings[i % 9])


def test_seeded_rows_do_not_depend_on_their_neighbours():
  rng = np.random.default_rng(3)
  seeded = je.SamplingParams(temperature=1.0, top_k=12, seed=1234, frequency_penalty=0.5)
  row_logits = (rng.normal(size=(P + 1, V)) * 1.5).astype(np.float32)
  row_drafts = rng.integers(0, V, size=P).tolist()
  results = []
  for trial, row in enumerate((0, 5, 17)):
    params = _mixed_params(np.random.default_rng(10 + trial), R - 1)
    params.insert(row, seeded)
    batch = _batch(params)
    logits = (rng.normal(size=(R, P + 1, V)) * 2).astype(np.float32)
    logits[row] = row_logits
    drafts = [rng.integers(0, V, size=rng.integers(0, P + 1)).tolist() for _ in range(R)]
    drafts[row] = row_drafts
    outs = [batch.rejection_sample(logits, drafts).sampled_token_ids[row] for _ in range(2)]
    results.append(np.concatenate(outs))
  for other in results[1:]:
    np.testing.assert_array_equal(other, results[0])


def test_one_executable_for_every_mix(compile_counter):
  rng = np.random.default_rng(4)
  batch = _batch(_mixed_params(rng, R // 2))
  logits = lambda: (rng.normal(size=(R, P + 1, V)) * 2).astype(np.float32)
  drafts = lambda n: [rng.integers(0, V, size=rng.integers(0, P + 1)).tolist() for _ in range(n)]
  batch.rejection_sample(logits(), drafts(batch.num_reqs))  # warm-up
  batch.remove_request("r0")
  batch.condense()  # compiles move_rows
  before = compile_counter.count
  for step in range(6):
    for req_id in list(batch.req_id_to_index)[: rng.integers(0, 3)]:
      batch.remove_request(req_id)
    for k, params in enumerate(_mixed_params(rng, int(rng.integers(0, 4)), seeded=0.5)):
      batch.add_request(f"s{step}.{k}", [1, 2, 3], params)
    batch.condense()
    batch.rejection_sample(logits(), drafts(batch.num_reqs))
  assert compile_counter.count == before


BAD_INPUTS = [
  ("target_logits", dict(target_logits=np.zeros((R, P + 2, V), np.float32))),
  ("target_logits", dict(target_logits=np.zeros((5, P + 1, V), np.float32))),
  ("target_logits", dict(target_logits=np.zeros((R, P + 1, V), np.int32))),
  ("draft_token_ids", dict(draft_token_ids=[[1]])),
  ("draft_token_ids", dict(draft_token_ids="abc")),
  (r"draft_token_ids\[1\] has 4 tokens", dict(draft_token_ids=[[1], [1, 2, 3, 4]])),
  (r"draft_token_ids\[0\]\[1\]", dict(draft_token_ids=[[1, V], []])),
  (r"draft_token_ids\[0\]\[0\]", dict(draft_token_ids=[[-1], []])),
  (r"draft_token_ids\[1\]\[0\]", dict(draft_token_ids=[[1], [True]])),
  (r"draft_token_ids\[1\]\[0\]", dict(draft_token_ids=[[1], [1.0]])),
  ("draft_probs", dict(draft_probs=np.full((R, P + 1, V), 1 / V, np.float32))),
  (r"draft_probs\[0\]", dict(draft_probs=np.full((R, P, V), -1 / V, np.float32))),
  (r"draft_probs\[0\]\[0\] must sum to 1", dict(draft_probs=np.full((R, P, V), 0.5, np.float32))),
  (r"draft_probs\[0\]", dict(draft_probs=np.full((R, P, V), np.nan, np.float32))),
]


@pytest.mark.parametrize("match, change", BAD_INPUTS)
def test_bad_inputs_are_value_errors_that_change_nothing(match, change):
  batch = _batch([GREEDY] * 3)
  batch.remove_request("r1")  # a hole: a failed call must not even condense
  args = dict(
    target_logits=_greedy_logits([[1, 2]] * 2),
    draft_token_ids=[[1], []],
    draft_probs=None,
  )
  args.update(change)
  before = jax.device_get(batch.state)
  with pytest.raises(ValueError, match=match):
    batch.rejection_sample(**args)
  assert batch.req_ids == ["r0", None, "r2"]
  assert batch.req_output_token_ids == [[], None, []]
  after = jax.device_get(batch.state)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("value", [-1, 129, True, 2.0, "4", None])
def test_bad_max_spec_len_is_a_value_error(value):
  with pytest.raises(ValueError, match=r"^max_spec_len must be an int in \[0, 128\], got "):
    je.BatchConfig(max_num_reqs=2, max_model_len=8, vocab_size=V, max_spec_len=value)
