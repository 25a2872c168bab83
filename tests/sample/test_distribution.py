"""Statistical and reproducibility tests of the random draw.

* Empirical token frequencies vs the exact float64 reference distribution for temperature, top-k
  (with ties at the cut), top-p, min-p, all three combined, and seeded rows. 10 rows per
  configuration x 100 steps = 1000 draws each;
  every token's frequency must lie within 4.5 binomial standard deviations (+ 2e-3) of its
  probability, tokens of probability 0 must never appear, and the chi-square statistic over tokens
  with expected count >= 5 must stay below df + 6 sqrt(2 df) (about a 1e-5 tail for these df).
  The batch seed is fixed, so the test is deterministic for a given implementation.
* Seeded requests: the same seed gives the same tokens whatever the slot, neighbours, swaps,
  condenses and whichever batch (or batch seed) it runs in.
* Unseeded requests with identical logits in one batch produce distinct streams.
"""

from __future__ import annotations

import math

import numpy as np
from batch_utils import R, V, make_batch, padded_logits
from reference import reference_row

import jaxengine as je

RD = 64  # rows of the distribution batch
STEPS = 100
GROUPS = [
  dict(temperature=0.7),
  dict(temperature=1.0, top_k=5),
  dict(temperature=1.3, top_p=0.6),
  dict(temperature=0.9, min_p=0.15),
  dict(temperature=1.0, top_k=12, top_p=0.8, min_p=0.05),
  dict(temperature=0.8, top_p=0.9, seed=None),  # seeded rows: seed = 1000 + row (see below)
]
SEEDED_GROUP = len(GROUPS) - 1
ROWS_PER_GROUP = RD // len(GROUPS)


def _group_logits(rng, g):
  if g == 1:  # ties at the 5th largest value: 7 tokens survive top-k 5
    row = np.full(V, -1.0, dtype=np.float32)
    row[[3, 8]] = 2.0
    row[[1, 10, 11, 20, 30]] = 1.0
    row[[4, 5]] = 0.5
    return row
  return rng.normal(0.0, 1.2, size=V).astype(np.float32)


def test_empirical_distribution_matches_reference():
  rng = np.random.default_rng(2024)
  b = make_batch(
    max_num_reqs=RD,
    max_model_len=STEPS + 8,
    logprobs_mode="raw_logprobs",
    max_num_logprobs=20,
    seed=1234,
  )
  group_of, logits_rows = {}, {}
  group_logits = [_group_logits(rng, g) for g in range(len(GROUPS))]
  for g, kw in enumerate(GROUPS):
    for j in range(ROWS_PER_GROUP):
      rid = f"g{g}-{j}"
      seed = 1000 + j if g == SEEDED_GROUP else None
      b.add_request(rid, [0], je.SamplingParams(max_tokens=STEPS + 1, **dict(kw, seed=seed)))
      group_of[rid] = g
      logits_rows[rid] = group_logits[g]
  logits = padded_logits(logits_rows, b, vocab_size=V, max_num_reqs=RD)
  counts = np.zeros((len(GROUPS), V))
  for _ in range(STEPS):
    toks = b.sample(logits).sampled_token_ids
    for i, rid in enumerate(b.req_ids):
      counts[group_of[rid], toks[i]] += 1
  failures = []
  for g, kw in enumerate(GROUPS):
    p = reference_row(group_logits[g], **kw).probs
    n = counts[g].sum()
    freq = counts[g] / n
    sigma = np.sqrt(p * (1 - p) / n)
    bad = np.nonzero(np.abs(freq - p) > 4.5 * sigma + 2e-3)[0]
    if len(bad):
      failures.append(f"group {kw}: tokens {bad.tolist()} freq {freq[bad]} vs p {p[bad]}")
    zero = (p == 0) & (counts[g] > 0)
    if zero.any():
      failures.append(f"group {kw}: sampled zero-probability tokens {np.nonzero(zero)[0].tolist()}")
    big = n * p >= 5
    chi2 = float((((counts[g] - n * p) ** 2) / np.where(big, n * p, 1.0))[big].sum())
    df = int(big.sum()) - 1
    if df > 0 and chi2 > df + 6 * math.sqrt(2 * df):
      failures.append(f"group {kw}: chi2 {chi2:.1f} with df {df}")
  assert not failures, "\n".join(failures)


def _seeded_stream(b, rid, logits_per_step, neighbours_rng, *, mutate=None):
  """Samples len(logits_per_step) steps; returns the tokens emitted by `rid`."""
  toks = []
  for t, row in enumerate(logits_per_step):
    if mutate is not None:
      mutate(t)
    b.condense()
    logits = neighbours_rng.uniform(-3, 3, size=(R, V)).astype(np.float32)
    logits[b.req_id_to_index[rid]] = row
    out = b.sample(logits)
    toks.append(int(out.sampled_token_ids[b.req_ids.index(rid)]))
  return toks


def test_seeded_request_is_batch_invariant():
  rng = np.random.default_rng(77)
  steps = [rng.normal(0, 1.0, size=V).astype(np.float32) for _ in range(12)]
  params = dict(seed=42, temperature=1.0, top_p=0.95)

  # Batch 1: S alone in row 0.
  b1 = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20, seed=0)
  b1.add_request("S", [1, 2], je.SamplingParams(**params))
  s1 = _seeded_stream(b1, "S", steps, np.random.default_rng(1))

  # Batch 2: different batch seed, S in row 5 among unseeded/seeded neighbours; neighbours come
  # and go, rows are swapped, S moves around.
  b2 = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20, seed=99)
  for i in range(5):
    b2.add_request(f"n{i}", [3], je.SamplingParams(temperature=0.8, seed=(7 if i == 2 else None)))
  assert b2.add_request("S", [1, 2], je.SamplingParams(**params)) == 5

  def mutate(t):
    if t == 3:
      b2.remove_request("n0")
      b2.remove_request("n3")  # condense moves S (row 5) into a lower row
    if t == 5:
      b2.swap_states(0, b2.num_reqs - 1)
    if t == 7:
      b2.add_request(f"late{t}", [4], je.SamplingParams(temperature=1.5))

  s2 = _seeded_stream(b2, "S", steps, np.random.default_rng(2), mutate=mutate)
  assert s1 == s2, "a seeded request's tokens must not depend on slot, neighbours or batch"

  # Two requests with the same seed in the same batch emit the same stream; another seed differs.
  b3 = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20, seed=5)
  b3.add_request("x", [9], je.SamplingParams(temperature=0.5))
  b3.add_request("S", [1, 2], je.SamplingParams(**params))
  b3.add_request("S-twin", [1, 2], je.SamplingParams(**params))
  b3.add_request("S-other", [1, 2], je.SamplingParams(**dict(params, seed=43)))
  streams = {rid: [] for rid in ("S", "S-twin", "S-other")}
  for row in steps:
    logits = np.tile(row, (R, 1))
    out = b3.sample(logits)
    for rid in streams:
      streams[rid].append(int(out.sampled_token_ids[b3.req_id_to_index[rid]]))
  assert streams["S"] == s1
  assert streams["S-twin"] == s1
  assert streams["S-other"] != s1


def test_seed_stream_depends_on_output_count():
  """Seeded stream position is the request's output count, including outputs given at add time."""
  rng = np.random.default_rng(8)
  steps = [rng.normal(0, 1.0, size=V).astype(np.float32) for _ in range(6)]
  params = je.SamplingParams(seed=3, temperature=1.0)
  b1 = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20)
  b1.add_request("S", [1], params)
  first = _seeded_stream(b1, "S", steps, np.random.default_rng(0))
  # Resume after two tokens (as after preemption): the continuation must match.
  b2 = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20, seed=17)
  b2.add_request("filler", [1], je.SamplingParams(temperature=1.0))
  b2.add_request("S", [1], params, output_token_ids=first[:2])
  rest = _seeded_stream(b2, "S", steps[2:], np.random.default_rng(1))
  assert rest == first[2:]


def test_unseeded_requests_do_not_share_a_stream():
  b = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20)
  for i in range(R):
    b.add_request(f"u{i}", [1], je.SamplingParams(temperature=1.0))
  logits = np.zeros((R, V), dtype=np.float32)  # uniform over the vocabulary
  streams = np.stack([b.sample(logits).sampled_token_ids for _ in range(10)], axis=1)
  distinct = {tuple(s) for s in streams.tolist()}
  assert len(distinct) == R, f"identical unseeded streams: {streams}"
  # and a request's stream is not constant over steps
  assert all(len(set(s)) > 1 for s in streams.tolist())


def test_unseeded_replacement_gets_a_fresh_stream():
  """A request placed in the row of a removed request must not replay the old request's stream."""
  b = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20)
  b.add_request("a", [1], je.SamplingParams(temperature=1.0))
  logits = np.zeros((R, V), dtype=np.float32)
  first = [int(b.sample(logits).sampled_token_ids[0]) for _ in range(8)]
  b.remove_request("a")
  b.add_request("b", [1], je.SamplingParams(temperature=1.0))
  second = [int(b.sample(logits).sampled_token_ids[0]) for _ in range(8)]
  assert first != second


def test_large_seeds_are_accepted_and_distinct():
  """Every int64 seed is accepted (docs/sampling.md §2.2); seeds differing only above bit 32 must differ."""
  b = make_batch(logprobs_mode="raw_logprobs", max_num_logprobs=20)
  seeds = [5, 5 + 2**32, 2**40, 2**63 - 1, -5, 0]
  for i, s in enumerate(seeds):
    b.add_request(f"s{i}", [1], je.SamplingParams(temperature=1.0, seed=s))
  logits = np.zeros((R, V), dtype=np.float32)
  streams = np.stack([b.sample(logits).sampled_token_ids for _ in range(8)], axis=1)
  assert len({tuple(s) for s in streams.tolist()}) == len(seeds), streams
