"""Deterministic scenarios of vLLM V1's batch and sampler: the worked example of docs/sampling.md §1.5,
batch metadata, processor scenarios, exact top-k/top-p cases, a worked bookkeeping scenario
(§3.2), logprob format and ranks.

Processed rows are read through logprobs=-1 in a batch built with max_num_logprobs=-1: in
`processed_logits` mode a greedy row's output is its post-penalty logits and a random row's output
is its final filtered logits (masked entries -inf), so each processor's effect is visible directly.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_utils import (
  EOS,
  MML,
  PROCESSED,
  PROCESSED_LOGITS,
  RAW,
  RAW_LOGITS_ALL,
  V_WIDE,
  R,
  V,
  check_row,
  expected_condense,
  full_rows,
  make_batch,
  padded_logits,
)
from reference import log_softmax, rank_of, reference_row

import jaxengine as je

NEG = -np.inf


def add(b, rid, prompt=(1,), outputs=(), **kw):
  return b.add_request(rid, list(prompt), je.SamplingParams(**kw), output_token_ids=list(outputs))


def one_hot_logits(token, vocab_size=V, hi=5.0, lo=0.0):
  row = np.full(vocab_size, lo, dtype=np.float32)
  row[token] = hi
  return row


# --------------------------------------------------------------------------------------------------
# §1.10 golden example (V = 8), in the standard batch: the other tokens' logits are -inf, which
# leaves every softmax, rank and cut of the example as it is (and each of them -inf).

GV = 8
GOLD_LOGITS = np.array([2.0, -1.0, 0.5, 1.5, 0.0, -0.5, 1.2, 0.8], dtype=np.float32)
GOLD_PROMPT = [1, 2]
GOLD_OUTPUTS = [2, 3, 3]
GOLD_KW = dict(
  repetition_penalty=1.2,
  frequency_penalty=0.3,
  presence_penalty=0.1,
  logit_bias={4: 0.5},
  temperature=0.8,
  min_p=0.05,
  top_k=4,
  top_p=0.85,
)
GOLD_RAW = np.array([-1.0464, -4.0464, -2.5464, -1.5464, -3.0464, -3.5464, -1.8464, -2.2464])
GOLD_PROCESSED = np.array([-0.46437, NEG, NEG, NEG, NEG, NEG, -1.46437, -1.96437])
GOLD_AFTER_PENALTIES = np.array([2.0, -1.2, 0.01667, 0.55, 0.5, -0.5, 1.2, 0.8])


def golden_batch(config):
  return make_batch(**config, eos_token_ids=())


def golden_logits():
  """The golden row in every row of the standard batch, -inf past the example's 8 tokens."""
  logits = np.full((R, V), NEG, dtype=np.float32)
  logits[:, :GV] = GOLD_LOGITS
  return logits


def golden_rows(out, n):
  """The first `n` rows' whole-vocabulary vectors, cut to the example's 8 tokens (the others must
  be -inf)."""
  rows = full_rows(out)[:n]
  assert np.isneginf(rows[:, GV:]).all(), rows
  return rows[:, :GV]


def add_golden(b, n, **overrides):
  kw = dict(GOLD_KW, **overrides)
  for i in range(n):
    add(b, f"g{i}", GOLD_PROMPT, GOLD_OUTPUTS, **kw)


def test_golden_raw_logprobs_top2():
  b = golden_batch(RAW)
  add_golden(b, R, logprobs=2)
  out = b.sample(golden_logits())
  lp = out.logprobs
  assert lp.token_ids.shape == (R, 3) and lp.logprobs.shape == (R, 3) and lp.ranks.shape == (R,)
  assert (
    lp.token_ids.dtype == np.int32
    and lp.logprobs.dtype == np.float32
    and lp.ranks.dtype == np.int32
  )
  expected_rank = {0: 1, 6: 3, 7: 4}
  for i in range(R):
    tok = int(out.sampled_token_ids[i])
    assert tok in (0, 6, 7), f"token {tok} is outside the golden final support {{0, 6, 7}}"
    assert lp.token_ids[i].tolist() == [tok, 0, 3]
    np.testing.assert_allclose(lp.logprobs[i], [GOLD_RAW[tok], GOLD_RAW[0], GOLD_RAW[3]], atol=1e-4)
    assert int(lp.ranks[i]) == expected_rank[tok]


def test_golden_processed_logprobs_full_row():
  b = golden_batch(PROCESSED)
  add_golden(b, R, logprobs=-1)
  out = b.sample(golden_logits())
  rows = golden_rows(out, R)
  for i in range(R):
    tok = int(out.sampled_token_ids[i])
    assert tok in (0, 6, 7)
    assert np.array_equal(np.isneginf(rows[i]), np.isneginf(GOLD_PROCESSED)), rows[i]
    fin = np.isfinite(GOLD_PROCESSED)
    np.testing.assert_allclose(rows[i][fin], GOLD_PROCESSED[fin], atol=1e-4)
    assert int(out.logprobs.ranks[i]) == {0: 1, 6: 2, 7: 3}[tok]
    # the final distribution the token was drawn from
    np.testing.assert_allclose(np.exp(rows[i][[0, 6, 7]]), [0.62853, 0.23122, 0.14024], atol=1e-4)


def test_golden_processed_logprobs_top2():
  b = golden_batch(PROCESSED)
  add_golden(b, 4, logprobs=2)
  out = b.sample(golden_logits())
  lp = out.logprobs
  assert lp.token_ids.shape == (4, 3)
  for i in range(4):
    tok = int(out.sampled_token_ids[i])
    assert lp.token_ids[i].tolist() == [tok, 0, 6]
    np.testing.assert_allclose(lp.logprobs[i], [GOLD_PROCESSED[tok], -0.46437, -1.46437], atol=1e-4)
    assert int(lp.ranks[i]) == {0: 1, 6: 2, 7: 3}[tok]


def test_golden_greedy_processed_is_post_penalty():
  b = golden_batch(PROCESSED)
  add_golden(b, 2, temperature=0.0, logprobs=-1)
  out = b.sample(golden_logits())
  assert out.sampled_token_ids.tolist() == [0, 0]
  rows = golden_rows(out, 2)
  want = log_softmax(GOLD_AFTER_PENALTIES)
  for i in range(2):
    np.testing.assert_allclose(rows[i], want, atol=2e-4)


def test_golden_processed_logits_and_raw_logits():
  b = golden_batch(PROCESSED_LOGITS)
  add_golden(b, 2, logprobs=-1)
  out = b.sample(golden_logits())
  rows = golden_rows(out, 2)
  want = np.array([2.5, NEG, NEG, NEG, NEG, NEG, 1.5, 1.0])
  for i in range(2):
    assert np.array_equal(np.isneginf(rows[i]), np.isneginf(want))
    np.testing.assert_allclose(rows[i][np.isfinite(want)], want[np.isfinite(want)], atol=1e-4)

  b = golden_batch(RAW_LOGITS_ALL)
  add_golden(b, 2, logprobs=-1)
  out = b.sample(golden_logits())
  rows = golden_rows(out, 2)
  for i in range(2):
    np.testing.assert_allclose(rows[i], GOLD_LOGITS, atol=1e-6)
    assert int(out.logprobs.ranks[i]) == rank_of(GOLD_LOGITS, int(out.sampled_token_ids[i]))


# --------------------------------------------------------------------------------------------------
# §4.1 sampling metadata in the input batch: rows follow requests through remove + condense


@pytest.mark.parametrize("batch_size", [1, 2, R])
def test_sampling_metadata_in_input_batch(batch_size):
  rng = np.random.default_rng(100 + batch_size)
  b = make_batch()
  reqs = {}
  for i in range(batch_size):
    prompt = rng.integers(0, V, size=int(rng.integers(1, 10))).tolist()
    outputs = rng.integers(0, V, size=int(rng.integers(0, 6))).tolist()
    kw = dict(
      top_k=int(rng.integers(1, 10)),
      top_p=float(rng.uniform(0.05, 1.0)),
      presence_penalty=float(rng.uniform(-2, 2)),
      frequency_penalty=float(rng.uniform(-2, 2)),
      repetition_penalty=float(rng.uniform(0.05, 2)),
      min_tokens=int(rng.integers(1, 10)),
      stop_token_ids=rng.integers(0, V, size=int(rng.integers(0, 10))).tolist(),
      logit_bias={0: float(rng.uniform(-3, 3))},
      logprobs=-1,
    )
    assert add(b, f"req_{i}", prompt, outputs, **kw) == i
    reqs[f"req_{i}"] = (prompt, outputs, kw)
  rows = list(reqs)
  n_remove = int(rng.integers(0, batch_size))  # keep at least one
  for i in sorted(rng.choice(batch_size, size=n_remove, replace=False).tolist()):
    assert b.remove_request(f"req_{i}") == i
    rows[i] = None
    del reqs[f"req_{i}"]
  b.condense()
  want_order = expected_condense(rows)
  assert b.req_ids == want_order
  assert b.num_reqs == len(want_order)
  assert b.req_id_to_index == {rid: i for i, rid in enumerate(want_order)}
  assert [list(o) for o in b.req_output_token_ids] == [reqs[r][1] for r in want_order]

  logits_rows = {rid: rng.uniform(-2, 2, size=V) for rid in reqs}
  out = b.sample(padded_logits(logits_rows, b))
  got = full_rows(out)
  for i, rid in enumerate(want_order):
    prompt, outputs, kw = reqs[rid]
    ref = reference_row(logits_rows[rid], prompt=prompt, outputs=outputs, eos_token_ids=EOS, **kw)
    check_row(
      ref,
      kw,
      int(out.sampled_token_ids[i]),
      got[i],
      int(out.logprobs.ranks[i]),
      out.logprobs.logprobs[i, 0],
      processed=True,
      context=f"row {i} {rid}",
    )


def test_metadata_identity_follows_composition_changes():
  b = make_batch(**RAW)
  for rid in "ABC":
    add(b, rid, temperature=0.0)
  logits = np.zeros((R, V), dtype=np.float32)
  m = b.sampling_metadata
  assert b.sampling_metadata is m
  b.sample(logits)
  assert b.sampling_metadata is m, (
    "a step without composition change must reuse the metadata object"
  )
  b.sample(logits)
  assert b.sampling_metadata is m
  assert b.remove_request("unknown") is None
  assert b.sampling_metadata is m, "removing an unknown id is not a composition change"
  b.condense()  # no holes: nothing moves
  assert b.sampling_metadata is m, "condense without holes is not a composition change"

  add(b, "D", temperature=0.0)
  m_add = b.sampling_metadata
  assert m_add is not m, "add must rebuild the metadata"
  b.sample(logits)
  assert b.sampling_metadata is m_add

  assert b.remove_request("B") == 1
  m_rm = b.sampling_metadata
  assert m_rm is not m_add, "remove must rebuild the metadata"
  b.condense()  # D moves 3 -> 1
  assert b.req_ids == ["A", "D", "C"]
  m_cond = b.sampling_metadata
  assert m_cond is not m_add
  b.sample(logits)
  assert b.sampling_metadata is m_cond

  b.swap_states(0, 2)
  assert b.req_ids == ["C", "D", "A"]
  m_swap = b.sampling_metadata
  assert m_swap is not m_cond, "swap must rebuild the metadata"
  b.sample(logits)
  assert b.sampling_metadata is m_swap


def test_condense_example_from_spec():
  """[A,B,C,D,E], remove B and D -> E moves to row 1 -> [A,E,C]."""
  b = make_batch(**RAW)
  for n, rid in enumerate("ABCDE"):
    assert add(b, rid, temperature=0.0, allowed_token_ids=[n]) == n
  assert b.remove_request("B") == 1
  assert b.remove_request("D") == 3
  b.condense()
  assert b.req_ids == ["A", "E", "C"]
  assert b.req_id_to_index == {"A": 0, "E": 1, "C": 2}
  out = b.sample(np.zeros((R, V), dtype=np.float32))
  assert out.sampled_token_ids.tolist() == [0, 4, 2]  # each row still carries its own allowlist


def test_sample_condenses_holes_first():
  b = make_batch(**RAW)
  for n, rid in enumerate("ABCD"):
    add(b, rid, temperature=0.0, allowed_token_ids=[10 + n])
  b.remove_request("A")
  out = b.sample(np.zeros((R, V), dtype=np.float32))
  assert b.req_ids == ["D", "B", "C"]
  assert out.sampled_token_ids.tolist() == [13, 11, 12]


def test_add_fills_lowest_hole_first():
  b = make_batch(**RAW)
  for rid in "ABCDE":
    add(b, rid, temperature=0.0)
  assert b.remove_request("D") == 3
  assert b.remove_request("B") == 1
  assert add(b, "F", temperature=0.0) == 1
  assert add(b, "G", temperature=0.0) == 3
  assert add(b, "H", temperature=0.0) == 5
  b.condense()
  assert b.req_ids == ["A", "F", "C", "G", "E", "H"]


# --------------------------------------------------------------------------------------------------
# §3.3 worked scenario: stale per-row state must not leak; swap keeps state with its request


def test_worked_scenario_no_stale_state_and_swap():
  b = make_batch(**RAW)
  assert add(b, "A", temperature=1.0, seed=1234) == 0
  assert add(b, "B", temperature=0.0) == 1
  assert add(b, "C", temperature=0.0, bad_words_token_ids=[[7]]) == 2
  assert add(b, "D", temperature=0.0, allowed_token_ids=[5]) == 3
  assert b.req_ids == ["A", "B", "C", "D"]

  assert b.remove_request("B") == 1
  assert add(b, "E", temperature=0.0) == 1
  b.condense()
  assert b.req_ids == ["A", "E", "C", "D"]

  assert b.remove_request("A") == 0
  assert b.remove_request("C") == 2
  b.condense()
  assert b.req_ids == ["D", "E"]
  assert b.req_id_to_index == {"D": 0, "E": 1}
  out = b.sample(padded_logits({"D": one_hot_logits(9), "E": one_hot_logits(9)}, b))
  assert out.sampled_token_ids.tolist() == [5, 9]

  assert add(b, "F", temperature=0.0) == 2  # row 2 used to hold C (bad word 7)
  assert add(b, "G", temperature=0.0) == 3  # row 3 used to hold D (allowlist [5])
  b.condense()
  assert b.req_ids == ["D", "E", "F", "G"]
  rows = {
    "D": one_hot_logits(9),
    "E": one_hot_logits(9),
    "F": one_hot_logits(7),
    "G": one_hot_logits(12),
  }
  out = b.sample(padded_logits(rows, b))
  assert out.sampled_token_ids.tolist() == [5, 9, 7, 12], (
    "F must not inherit C's bad word and G must not inherit D's allowlist"
  )

  b.swap_states(0, 1)
  assert b.req_ids == ["E", "D", "F", "G"]
  assert b.req_id_to_index == {"E": 0, "D": 1, "F": 2, "G": 3}
  out = b.sample(padded_logits(rows, b))
  assert out.sampled_token_ids.tolist() == [9, 5, 7, 12], (
    "D's allowlist must follow D through the swap"
  )
  assert [list(o) for o in b.req_output_token_ids] == [[9, 9, 9], [5, 5, 5], [7, 7], [12, 12]]


# --------------------------------------------------------------------------------------------------
# §4.3 processor scenarios, read through processed_logits (greedy rows -> post-penalty logits)


def processed_logits_batch():
  return make_batch(**PROCESSED_LOGITS)


@pytest.mark.parametrize("penalty", [2.0, -2.0])
def test_presence_penalty(penalty):
  rng = np.random.default_rng(1)
  b = processed_logits_batch()
  outs = []
  for i in range(R):
    outputs = rng.integers(0, V - 1, size=20).tolist()
    prompt = rng.integers(0, V, size=5).tolist()  # the prompt must not count
    add(b, f"r{i}", prompt, outputs, temperature=0.0, presence_penalty=penalty, logprobs=-1)
    outs.append(outputs)
  out = b.sample(np.full((R, V), 0.01, dtype=np.float32))
  rows = full_rows(out)
  for i in range(R):
    seen = np.bincount(outs[i], minlength=V) > 0
    np.testing.assert_allclose(rows[i], 0.01 - penalty * seen, atol=1e-6)
    if penalty > 0:
      assert seen[np.argmin(rows[i])] and not seen[np.argmax(rows[i])]
    else:
      assert seen[np.argmax(rows[i])] and not seen[np.argmin(rows[i])]


@pytest.mark.parametrize("penalty", [2.0, -2.0])
def test_frequency_penalty(penalty):
  rng = np.random.default_rng(2)
  b = processed_logits_batch()
  counts = []
  for i in range(R):
    m = int(rng.integers(1, 10))
    ids = rng.choice(V, size=m, replace=False)
    outputs = [int(t) for j, t in enumerate(ids) for _ in range(j + 1)]
    rng.shuffle(outputs)
    add(
      b,
      f"r{i}",
      rng.integers(0, V, size=5).tolist(),
      outputs,
      temperature=0.0,
      frequency_penalty=penalty,
      logprobs=-1,
    )
    counts.append(np.bincount(outputs, minlength=V))
  out = b.sample(np.full((R, V), 0.01, dtype=np.float32))
  rows = full_rows(out)
  for i in range(R):
    np.testing.assert_allclose(rows[i], 0.01 - penalty * counts[i], atol=1e-5)
    most = int(np.argmax(counts[i]))
    if penalty > 0:
      assert counts[i][np.argmax(rows[i])] == 0 and int(np.argmin(rows[i])) == most
    else:
      assert int(np.argmax(rows[i])) == most and counts[i][np.argmin(rows[i])] == 0


@pytest.mark.parametrize("penalty", [0.1, 1.9])
def test_repetition_penalty(penalty):
  rng = np.random.default_rng(3)
  b = processed_logits_batch()
  seen, logit_rows = [], {}
  for i in range(R):
    prompt = rng.integers(0, V, size=int(rng.integers(1, 40))).tolist()
    outputs = rng.integers(0, V, size=20).tolist()
    add(b, f"r{i}", prompt, outputs, temperature=0.0, repetition_penalty=penalty, logprobs=-1)
    s = np.zeros(V, dtype=bool)
    s[prompt] = True
    s[outputs] = True
    seen.append(s)
    row = np.full(V, 0.5, dtype=np.float32)  # even rows: all equal and positive
    if i % 2:  # odd rows: random, and also exercise the x <= 0 branch
      row = rng.uniform(0.1, 1.0, size=V).astype(np.float32)
      row[::3] *= -1
      row[1] = 0.0
    logit_rows[f"r{i}"] = row
  out = b.sample(padded_logits(logit_rows, b))
  rows = full_rows(out)
  for i in range(R):
    x = logit_rows[f"r{i}"].astype(np.float64)
    want = np.where(seen[i] & (x > 0), x / penalty, np.where(seen[i], x * penalty, x))
    np.testing.assert_allclose(rows[i], want, rtol=1e-5, atol=1e-6)
    if i % 2 == 0 and not seen[i].all():  # all-positive rows: vLLM's argmax/argmin property
      if penalty > 1:
        assert not seen[i][np.argmax(rows[i])] and seen[i][np.argmin(rows[i])]
      else:
        assert seen[i][np.argmax(rows[i])] and not seen[i][np.argmin(rows[i])]


@pytest.mark.parametrize("min_p", [0.0, 0.1])
def test_min_p(min_p):
  b = processed_logits_batch()
  for i in range(R):
    add(b, f"r{i}", temperature=1.0, min_p=min_p, logprobs=-1)
  logits = np.full((R, V), 0.01, dtype=np.float32)
  logits[:, 0] = 10.0
  out = b.sample(logits)
  rows = full_rows(out)
  assert out.sampled_token_ids.tolist() == [0] * R or min_p == 0.0
  for i in range(R):
    if min_p > 0:
      assert rows[i][0] == pytest.approx(10.0, abs=1e-5)
      assert np.isneginf(rows[i][1:]).all()
    else:
      np.testing.assert_allclose(rows[i], logits[i], atol=1e-6)


@pytest.mark.parametrize("bias", [-0.1, 1.2])
def test_logit_bias(bias):
  b = processed_logits_batch()
  for i in range(R):
    add(b, f"r{i}", temperature=0.0, logit_bias={min(i, V - 1): bias}, logprobs=-1)
  out = b.sample(np.full((R, V), 0.01, dtype=np.float32))
  rows = full_rows(out)
  for i in range(R):
    want = np.full(V, 0.01)
    want[min(i, V - 1)] += bias
    np.testing.assert_allclose(rows[i], want, atol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_allowed_token_ids(n):
  b = processed_logits_batch()
  forbidden = {}
  for i in range(R):
    if i % 2 == 0:
      forbidden[i] = set(range(i, min(i + n, V)))
      add(
        b,
        f"r{i}",
        temperature=0.0,
        logprobs=-1,
        allowed_token_ids=[t for t in range(V) if t not in forbidden[i]],
      )
    else:
      forbidden[i] = set()
      add(b, f"r{i}", temperature=0.0, logprobs=-1)
  out = b.sample(np.full((R, V), 0.01, dtype=np.float32))
  rows = full_rows(out)
  for i in range(R):
    assert set(np.nonzero(np.isneginf(rows[i]))[0].tolist()) == forbidden[i]
    assert int(out.sampled_token_ids[i]) not in forbidden[i]


@pytest.mark.parametrize("lengths", [(1,), (1, 3), (2, 2)])
def test_bad_words(lengths):
  rng = np.random.default_rng(sum(lengths) * 7 + len(lengths))
  b = processed_logits_batch()
  no_words_row = int(rng.integers(0, R))
  expected = {}
  for i in range(R):
    outputs = rng.integers(0, V, size=6).tolist()
    words = None
    banned = set()
    if i != no_words_row:
      words = [rng.integers(0, V, size=L).tolist() for L in lengths]
      multi = [w for w in words if len(w) > 1]
      if multi and rng.random() < 0.5:
        w = multi[int(rng.integers(0, len(multi)))]
        outputs[len(outputs) - (len(w) - 1) :] = w[:-1]  # force the tail to match the prefix
      elif multi:
        starts = {w[-2] for w in multi}
        outputs[-1] = next(t for t in range(V) if t not in starts)  # no multi-token word fires
      for w in words:
        if outputs[len(outputs) - (len(w) - 1) :] == w[:-1] or len(w) == 1:
          banned.add(w[-1])
    expected[i] = banned
    add(b, f"r{i}", [1, 2], outputs, temperature=0.0, logprobs=-1, bad_words_token_ids=words)
  out = b.sample(np.full((R, V), 0.01, dtype=np.float32))
  rows = full_rows(out)
  for i in range(R):
    assert set(np.nonzero(np.isneginf(rows[i]))[0].tolist()) == expected[i], f"row {i}"


def test_bad_words_match_outputs_not_prompt():
  b = processed_logits_batch()
  add(b, "prompt-only", [3, 4], [], temperature=0.0, logprobs=-1, bad_words_token_ids=[[4, 9]])
  add(b, "boundary", [3], [4], temperature=0.0, logprobs=-1, bad_words_token_ids=[[3, 4, 9]])
  add(b, "fires", [3], [3, 4], temperature=0.0, logprobs=-1, bad_words_token_ids=[[3, 4, 9]])
  out = b.sample(np.full((R, V), 0.01, dtype=np.float32))
  rows = full_rows(out)
  assert np.isfinite(rows[0]).all()
  assert np.isfinite(rows[1]).all(), "a prefix spanning the prompt/output boundary is not detected"
  assert set(np.nonzero(np.isneginf(rows[2]))[0].tolist()) == {9}


def test_min_tokens_masks_stop_ids_and_eos():
  rng = np.random.default_rng(4)
  b = processed_logits_batch()
  expected = {}
  for i in range(R):
    outputs = rng.integers(0, V - 1, size=5).tolist()
    stop = rng.integers(0, V - 1, size=int(rng.integers(1, 6))).tolist()
    if i % 2 == 0:  # penalised: too few outputs
      min_tokens = int(rng.integers(6, 12))
      expected[i] = set(stop) | set(EOS)
    else:  # minimum already reached (min_tokens == len(outputs) included)
      min_tokens = [0, 3, 5, 5][i // 2]
      expected[i] = set()
    add(
      b,
      f"r{i}",
      [1],
      outputs,
      temperature=0.0,
      logprobs=-1,
      min_tokens=min_tokens,
      stop_token_ids=stop,
      ignore_eos=(i % 4 == 0),
    )
  out = b.sample(np.full((R, V), 0.01, dtype=np.float32))
  rows = full_rows(out)
  for i in range(R):
    assert set(np.nonzero(np.isneginf(rows[i]))[0].tolist()) == expected[i], f"row {i}"


def test_min_tokens_counts_steps_and_initial_outputs():
  b = make_batch(**RAW)
  eos = EOS[0]
  logits_row = np.zeros(V, dtype=np.float32)
  logits_row[[eos, 5, 7]] = [3.0, 2.0, 1.0]
  add(b, "eos", temperature=0.0, min_tokens=2)
  add(b, "eos-ignore", temperature=0.0, min_tokens=2, ignore_eos=True)
  add(b, "stop", temperature=0.0, min_tokens=2, stop_token_ids=[5])
  add(b, "prior", [1], [9], temperature=0.0, min_tokens=2)
  logits = np.tile(logits_row, (R, 1))
  got = [b.sample(logits).sampled_token_ids.tolist() for _ in range(3)]
  streams = {rid: [g[i] for g in got] for i, rid in enumerate(b.req_ids)}
  assert streams["eos"] == [5, 5, eos]
  assert streams["eos-ignore"] == [5, 5, eos], (
    "EOS joins the min_tokens stop set even with ignore_eos"
  )
  assert streams["stop"] == [7, 7, eos]
  assert streams["prior"] == [5, eos, eos]


def test_frequency_penalty_counts_sampled_tokens():
  b = make_batch(**RAW)
  add(b, "f", temperature=0.0, frequency_penalty=2.0)
  add(b, "r", [3], temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0)
  row = np.zeros(V, dtype=np.float32)
  row[3], row[4] = 1.0, 0.5
  logits = np.tile(row, (R, 1))
  toks = [b.sample(logits).sampled_token_ids.tolist() for _ in range(4)]
  assert [t[0] for t in toks] == [3, 4, 0, 1]
  # r: 3 is in the prompt -> 0.5 (ties 4 -> first index 3); then 3 gets presence: -0.5 -> 4; ...
  assert [t[1] for t in toks] == [3, 4, 0, 1]
  assert [list(o) for o in b.req_output_token_ids] == [[3, 4, 0, 1], [3, 4, 0, 1]]


# --------------------------------------------------------------------------------------------------
# §4.9 exact top-k / top-p cases (three or four real tokens, the rest excluded by allowed_token_ids)


def _topkp_rows(cases):
  """cases: list of (probs, top_k, top_p). Returns the processed rows (T = 1 -> final logits)."""
  b = processed_logits_batch()
  logits = np.full((R, V), 5.0, dtype=np.float32)  # excluded tokens are the largest: mask first
  for i, (probs, k, p) in enumerate(cases):
    add(
      b,
      f"r{i}",
      temperature=1.0,
      top_k=k,
      top_p=p,
      logprobs=-1,
      allowed_token_ids=list(range(len(probs))),
    )
    logits[i, : len(probs)] = np.log(probs)
  out = b.sample(logits)
  rows = full_rows(out)
  for i, (probs, _, _) in enumerate(cases):
    assert np.isneginf(rows[i][len(probs) :]).all()
    assert int(out.sampled_token_ids[i]) < len(probs)
  return [rows[i][: len(probs)] for i, (probs, _, _) in enumerate(cases)], out


def _kept(row):
  return np.isfinite(row).tolist()


def test_topk_topp_exact_cases():
  a, c = [0.2, 0.3, 0.5], [0.5, 0.1, 0.4]
  ties = [0.3, 0.3, 0.3, 0.1]
  rows, out = _topkp_rows(
    [
      (a, 3, 0.79),
      (c, 3, 0.79),  # smallest entry of each row masked
      (a, 0, 1.0),
      (c, 0, 1.0),  # unchanged
      (ties, 0, 0.2),  # only the 0.1 entry masked: all ties kept
      (a, 1, 0.79),
      (c, 3, 0.79),  # k = [1, 3]: row keeps only 0.5 / loses 0.1
      ([0.4, 0.2, 0.2, 0.2], 0, 0.5),  # cut inside a tie group keeps the whole group
    ]
  )
  assert _kept(rows[0]) == [False, True, True]
  assert _kept(rows[1]) == [True, False, True]
  assert _kept(rows[2]) == [True, True, True]
  assert _kept(rows[3]) == [True, True, True]
  np.testing.assert_allclose(rows[2], np.log(a), atol=1e-6)
  assert _kept(rows[4]) == [True, True, True, False]
  assert _kept(rows[5]) == [False, False, True]
  assert int(out.sampled_token_ids[5]) == 2
  assert _kept(rows[6]) == [True, False, True]
  assert _kept(rows[7]) == [True, True, True, True]


def test_topk_keeps_ties_and_topp_tie_groups():
  rows, _ = _topkp_rows(
    [
      ([0.3, 0.3, 0.3, 0.1], 2, 1.0),  # k = 2 with a three-way tie at the cut: all three kept
      ([0.3, 0.3, 0.3, 0.1], 1, 1.0),  # k = 1 with a tie at the maximum
      ([0.4, 0.2, 0.2, 0.2], 0, 0.3),  # 0.4 alone reaches 0.3: the tie group is dropped whole
      ([0.1, 0.2, 0.3, 0.4], 2, 0.6),  # top-k first (0.3, 0.4 renormalised to .43/.57), then top-p
      ([0.1, 0.2, 0.3, 0.4], 2, 0.5),
    ]
  )
  assert _kept(rows[0]) == [True, True, True, False]
  assert _kept(rows[1]) == [True, True, True, False]
  assert _kept(rows[2]) == [True, False, False, False]
  assert _kept(rows[3]) == [False, False, True, True]
  assert _kept(rows[4]) == [False, False, False, True]


@pytest.mark.parametrize("top_k", [0, -1, V, V + 5])
def test_top_k_disabled_values(top_k):
  rng = np.random.default_rng(6)
  b = make_batch()
  for i in range(4):
    add(b, f"r{i}", temperature=0.7, top_k=top_k, logprobs=-1)
  logits = rng.choice(np.array([-1.0, 0.0, 0.5, 1.0], dtype=np.float32), size=(R, V))
  out = b.sample(logits)
  rows = full_rows(out)
  for i in range(4):
    np.testing.assert_allclose(rows[i], log_softmax(logits[i] / 0.7), atol=1e-5)


# --------------------------------------------------------------------------------------------------
# greedy in a mixed batch, fully masked rows, padding rows


def test_greedy_rows_in_mixed_batch():
  rng = np.random.default_rng(7)
  b = make_batch()
  for i in range(R):
    add(b, f"r{i}", temperature=0.0 if i % 2 == 0 else 1.5, top_k=5 if i % 2 else 0, logprobs=-1)
  for _step in range(4):
    logits = rng.choice(np.array([-1.0, 0.0, 1.0, 2.0], dtype=np.float32), size=(R, V))
    out = b.sample(logits)
    rows = full_rows(out)
    for i in range(0, R, 2):
      assert int(out.sampled_token_ids[i]) == int(np.argmax(logits[i])), "greedy = first argmax"
      np.testing.assert_allclose(rows[i], log_softmax(logits[i]), atol=1e-5)
    for i in range(1, R, 2):
      ref = reference_row(logits[i], temperature=1.5, top_k=5)
      assert ref.probs[int(out.sampled_token_ids[i])] > 0
      np.testing.assert_allclose(rows[i], ref.processed_logprobs, atol=1e-5)


def test_tiny_temperature_is_random_not_greedy():
  """docs/sampling.md §2.1: 0 < T < 0.01 is raised to 0.01 *before* the greedy test, so only T == 0
  is greedy; "a 'tiny' temperature like 1e-6 becomes random sampling at T = 0.01, not greedy"."""
  p = je.SamplingParams(temperature=1e-6)
  assert p.temperature == pytest.approx(0.01)
  b = make_batch()
  add(b, "tiny", temperature=1e-6, logprobs=-1)
  logits = np.zeros((R, V), dtype=np.float32)
  logits[0, :3] = [1.0, 1.0, 0.99]
  out = b.sample(logits)
  row = full_rows(out)[0]
  np.testing.assert_allclose(row[:3], log_softmax(logits[0] / 0.01)[:3], atol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fully_masked_row_stays_inside_allowlist(temperature):
  b = make_batch(**RAW)
  # Constraints that ban everything whatever the output are refused when the request is added...
  for kw in (
    dict(allowed_token_ids=[4], bad_words_token_ids=[[4]]),
    dict(allowed_token_ids=[6, 8], min_tokens=3, stop_token_ids=[6, 8]),
    dict(bad_words_token_ids=[[t] for t in range(V)]),
  ):
    with pytest.raises(ValueError):
      add(b, "refused", temperature=temperature, **kw)
  # ...those that ban everything only after some outputs fall back to the allowed set.
  add(
    b,
    "a",
    outputs=[9],
    temperature=temperature,
    allowed_token_ids=[4, 5],
    bad_words_token_ids=[[4], [9, 5]],
  )
  add(
    b,
    "b",
    outputs=[9],
    temperature=temperature,
    bad_words_token_ids=[[t] for t in range(1, V)] + [[9, 0]],
  )
  add(b, "d", temperature=temperature)
  rng = np.random.default_rng(8)
  toks = b.sample(rng.uniform(-1, 1, size=(R, V)).astype(np.float32)).sampled_token_ids.tolist()
  assert toks[0] in (4, 5)
  assert 0 <= toks[1] < V


def test_padding_rows_are_ignored():
  b = make_batch(**RAW)
  for i in range(3):
    add(b, f"r{i}", temperature=0.0, logprobs=2, presence_penalty=1.0)
  logits = np.full((R, V), np.nan, dtype=np.float32)
  logits[3:5] = np.inf
  for i in range(3):
    logits[i] = one_hot_logits(10 + i)
  out = b.sample(logits)
  assert out.sampled_token_ids.tolist() == [10, 11, 12]
  assert np.isfinite(out.logprobs.logprobs).all()


def test_num_reqs_shaped_logits_match_padded():
  rng = np.random.default_rng(9)
  logits = rng.uniform(-2, 2, size=(R, V)).astype(np.float32)
  results = []
  for shape in ("padded", "exact"):
    b = make_batch(**RAW)
    for i in range(3):
      add(b, f"r{i}", temperature=0.0 if i != 1 else 0.9, seed=11, logprobs=3)
    out = b.sample(logits if shape == "padded" else logits[:3])
    results.append((out.sampled_token_ids.tolist(), out.logprobs.token_ids.tolist()))
  assert results[0] == results[1]


# --------------------------------------------------------------------------------------------------
# logprob format and ranks (raw_logprobs mode, max_num_logprobs = 20)


def test_logprob_format_and_ranks_with_ties():
  b = make_batch(**RAW)
  add(b, "zero", temperature=0.0, logprobs=0)
  add(b, "none", temperature=0.0)
  add(b, "three", temperature=1.0, logprobs=3)
  # the prompt makes repetition push 4, 9, 20 down to 2/3, so greedy picks 1 (tied with 2)
  add(
    b,
    "five",
    [4, 9, 20],
    temperature=0.0,
    logprobs=5,
    repetition_penalty=3.0,
    frequency_penalty=1.0,
  )
  logits = np.zeros((R, V), dtype=np.float32)
  # three-way tie at the maximum for the greedy rows: first index wins, rank counts the ties
  logits[:, [4, 9, 20]] = 2.0
  logits[:, [1, 2]] = 1.0
  logits[2] = np.random.default_rng(10).uniform(-2, 2, size=V)
  out = b.sample(logits)
  lp = out.logprobs
  assert lp.token_ids.shape == (4, 6) and lp.logprobs.shape == (4, 6) and lp.ranks.shape == (4,)
  toks = out.sampled_token_ids.tolist()
  assert toks[0] == 4 and toks[1] == 4
  assert toks[3] == 1, "penalties must not touch the reported raw logprobs but do steer greedy"
  for i in range(4):
    raw = log_softmax(logits[i])
    assert lp.token_ids[i, 0] == toks[i]
    np.testing.assert_allclose(lp.logprobs[i], raw[lp.token_ids[i]], atol=1e-5)
    assert int(lp.ranks[i]) == rank_of(raw, toks[i])
    np.testing.assert_allclose(np.sort(lp.logprobs[i, 1:])[::-1], np.sort(raw)[::-1][:5], atol=1e-5)
    assert len(set(lp.token_ids[i, 1:].tolist())) == 5
  assert int(lp.ranks[0]) == 3  # ties count against the token
  assert set(lp.token_ids[0, 1:4].tolist()) == {4, 9, 20}
  assert set(lp.token_ids[0, 4:6].tolist()) == {1, 2}
  assert int(lp.ranks[3]) == 5


def test_logprobs_zero_gives_one_column_and_none_when_unrequested():
  b = make_batch(**RAW)
  add(b, "zero", temperature=0.0, logprobs=0)
  add(b, "none", temperature=0.0)
  logits = np.zeros((R, V), dtype=np.float32)
  logits[:, 7] = 1.0
  out = b.sample(logits)
  assert out.logprobs.token_ids.shape == (2, 1)
  assert out.logprobs.token_ids[:, 0].tolist() == [7, 7]
  np.testing.assert_allclose(out.logprobs.logprobs[:, 0], log_softmax(logits[0])[7], atol=1e-5)
  assert out.logprobs.ranks.tolist() == [1, 1]

  b.remove_request("zero")
  out = b.sample(logits)
  assert out.logprobs is None
  add(b, "true", temperature=0.0, logprobs=True)
  out = b.sample(logits)
  assert out.logprobs.token_ids.shape == (2, 2)


def test_sampled_token_ids_dtype_and_output_lists():
  b = make_batch(**RAW)
  add(b, "a", [1, 2], [3], temperature=0.0)
  add(b, "b", [1], temperature=0.0)
  out = b.sample(np.tile(one_hot_logits(6), (R, 1)))
  assert isinstance(out.sampled_token_ids, np.ndarray)
  assert out.sampled_token_ids.dtype == np.int32 and out.sampled_token_ids.shape == (2,)
  assert [list(o) for o in b.req_output_token_ids] == [[3, 6], [6]]


# --------------------------------------------------------------------------------------------------
# deep top-k / top-p cuts on a vocabulary wider than the default candidate budget (64)

VW = V_WIDE


def test_deep_topk_topp_cuts_wide_vocab():
  b = make_batch(vocab_size=VW, eos_token_ids=(VW - 1,))
  logits = np.zeros((R, VW), dtype=np.float32)
  logits[:, :100] = 1.0  # 100 tokens tied at the top
  logits[:, 100:] = np.linspace(-1.0, 0.5, VW - 100, dtype=np.float32)
  cases = [
    dict(top_k=90),
    dict(top_k=120),
    dict(top_p=0.97),
    dict(top_p=0.5),
    dict(top_k=150, top_p=0.99),
    dict(min_p=0.5, top_p=0.999),
    dict(top_k=101),
    dict(top_p=0.9999),
  ]
  for i, kw in enumerate(cases):
    add(b, f"r{i}", temperature=1.0, logprobs=-1, **kw)
  out = b.sample(logits)
  rows = full_rows(out, VW)
  for i, kw in enumerate(cases):
    ref = reference_row(logits[i], temperature=1.0, **kw)
    assert not ref.ambiguous, ref.ambiguous
    check_row(
      ref,
      kw,
      int(out.sampled_token_ids[i]),
      rows[i],
      int(out.logprobs.ranks[i]),
      out.logprobs.logprobs[i, 0],
      processed=True,
      context=f"{kw}",
      vocab_size=VW,
    )
  assert np.isfinite(rows[0][:100]).all() and np.isneginf(rows[0][100:]).all()  # ties at k kept


# --------------------------------------------------------------------------------------------------
# the pure jitted step underneath InputBatch.sample


def test_sample_step_matches_input_batch_and_runs_in_scan():
  import jax
  import jax.numpy as jnp

  def build():
    b = make_batch(**RAW)
    add(b, "g", [1, 2], temperature=0.0, frequency_penalty=1.0)
    add(b, "s", [3], temperature=0.8, seed=9, top_k=5, logprobs=2)
    add(b, "t", [4], temperature=1.2, seed=10, min_p=0.1, bad_words_token_ids=[[7]])
    b.condense()
    return b

  rng = np.random.default_rng(12)
  steps = [rng.normal(0, 1.5, size=(R, V)).astype(np.float32) for _ in range(4)]
  b1 = build()
  want = [b1.sample(l).sampled_token_ids.tolist() for l in steps]

  b2 = build()
  state = jax.tree.map(jnp.copy, b2.state)
  meta = b2.sampling_metadata
  state, out = je.sample_step(state, meta, jnp.asarray(steps[0]))
  assert np.asarray(out.sampled_token_ids)[:3].tolist() == want[0]

  def body(st, logits):
    st, o = je.sample_step(st, meta, logits)
    return st, o.sampled_token_ids

  _, toks = jax.jit(lambda st, ls: jax.lax.scan(body, st, ls))(state, jnp.stack(steps[1:]))
  assert np.asarray(toks)[:, :3].tolist() == want[1:]


def test_sample_step_in_scan_reports_rows_that_reached_max_model_len():
  """A row at max_model_len inside a caller's scan: nothing appended, and the output says so."""
  import jax
  import jax.numpy as jnp

  b = make_batch(max_num_logprobs=20)
  add(b, "long", [1] * (MML - 3), temperature=0.0)  # room for 3 more tokens
  add(b, "short", [1], temperature=0.0)
  meta = b.sampling_metadata
  state = jax.tree.map(jnp.copy, b.state)
  logits = jnp.asarray(np.tile(one_hot_logits(5), (R, 1)))

  def body(st, _):
    st, o = je.sample_step(st, meta, logits)
    return st, (o.is_appended, st.num_tokens)

  state, (appended, num_tokens) = jax.lax.scan(body, state, None, length=5)
  appended, num_tokens = np.asarray(appended), np.asarray(num_tokens)
  assert appended[:, 0].tolist() == [True, True, True, False, False]
  assert num_tokens[:, 0].tolist() == [MML - 2, MML - 1, MML, MML, MML]
  assert appended[:, 1].all() and num_tokens[-1, 1] == 6
  assert not appended[:, 2:].any()  # rows without a request
  assert np.asarray(state.token_ids)[0, MML - 3 :].tolist() == [5, 5, 5]


# --------------------------------------------------------------------------------------------------
# -inf already in the incoming logits (a grammar bitmask applied by the model runner), min_p = 1


def test_negative_infinity_input_logits():
  b = make_batch()
  rng = np.random.default_rng(13)
  kws = [
    dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=-2.0, frequency_penalty=-2.0),
    dict(temperature=1.0, top_p=0.7, presence_penalty=-2.0, frequency_penalty=-2.0),
    dict(temperature=0.5, min_p=0.2, top_k=3, repetition_penalty=0.5),
    dict(temperature=2.0, logit_bias={0: 5.0, 1: 5.0}),
    dict(temperature=1.0),
  ]
  prompt, outputs = [0, 1, 2, 3], [0, 1, 1, 4]
  for i, kw in enumerate(kws):
    add(b, f"r{i}", prompt, outputs, logprobs=-1, **kw)
  logits = rng.uniform(-2, 2, size=(R, V)).astype(np.float32)
  logits[:, :2] = -np.inf  # forbidden by the "grammar", and they are in prompt and outputs
  logits[4, 6:] = -np.inf  # only tokens 2..5 possible
  out = b.sample(logits)
  rows = full_rows(out)
  for i, kw in enumerate(kws):
    tok = int(out.sampled_token_ids[i])
    assert tok >= 2 and (i != 4 or tok < 6)
    ref = reference_row(logits[i], prompt=prompt, outputs=outputs, eos_token_ids=EOS, **kw)
    check_row(
      ref,
      kw,
      tok,
      rows[i],
      int(out.logprobs.ranks[i]),
      out.logprobs.logprobs[i, 0],
      processed=True,
      context=f"row {i} {kw}",
    )


def test_min_p_one_keeps_only_ties_with_max():
  b = processed_logits_batch()
  add(b, "a", temperature=0.9, min_p=1.0, logprobs=-1)
  logits = np.zeros((R, V), dtype=np.float32)
  logits[0, [3, 17, 25]] = 2.0
  logits[0, 4] = 1.999
  out = b.sample(logits)
  row = full_rows(out)[0]
  assert set(np.nonzero(np.isfinite(row))[0].tolist()) == {3, 17, 25}
  assert int(out.sampled_token_ids[0]) in (3, 17, 25)


def test_bfloat16_logits_are_accepted():
  import jax.numpy as jnp

  b = make_batch(**RAW)
  add(b, "g", temperature=0.0, logprobs=3)
  add(b, "r", temperature=0.7, seed=1, logprobs=3)
  rng = np.random.default_rng(14)
  logits = jnp.asarray(rng.normal(0, 2, size=(R, V)), dtype=jnp.bfloat16)
  out = b.sample(logits)
  f32 = np.asarray(logits.astype(jnp.float32))
  assert int(out.sampled_token_ids[0]) == int(np.argmax(f32[0]))
  for i in range(2):
    np.testing.assert_allclose(
      out.logprobs.logprobs[i], log_softmax(f32[i])[out.logprobs.token_ids[i]], atol=1e-4
    )


def test_empty_batch_samples_zero_rows_and_ids_can_be_reused():
  b = make_batch(**RAW)
  logits = np.tile(one_hot_logits(3), (R, 1))
  out = b.sample(logits)
  assert out.sampled_token_ids.shape == (0,) and b.num_reqs == 0 and b.req_ids == []
  add(b, "a", temperature=0.0, logprobs=2)
  assert b.remove_request("a") == 0
  assert b.remove_request("a") is None
  out = b.sample(logits)
  assert out.sampled_token_ids.shape == (0,) and out.logprobs is None
  assert add(b, "a", temperature=0.0) == 0  # the id is free again
  assert b.sample(logits).sampled_token_ids.tolist() == [3]
  assert [list(o) for o in b.req_output_token_ids] == [[3]]
