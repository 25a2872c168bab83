"""Input validation: SamplingParams ranges (docs/sampling.md §2) and InputBatch.add_request rejections.

A rejected add must raise ValueError naming the offending field and leave the batch exactly as it
was: same req_ids / req_id_to_index / num_reqs / output lists / metadata object, the hole it might
have taken still free, and later samples identical to a batch that never saw the bad call.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from batch_utils import MML, R, V, make_batch

import jaxengine as je

# --------------------------------------------------------------------------------------------------
# SamplingParams


def _names(message: str, *fields: str) -> bool:
  msg = message.lower()
  return any(re.search(rf"(?<![a-z_]){re.escape(f.lower())}(?![a-z_])", msg) for f in fields)


BAD_PARAMS = [
  (dict(n=0), "n"),
  (dict(temperature=-0.1), "temperature"),
  (dict(top_p=0.0), "top_p"),
  (dict(top_p=-0.5), "top_p"),
  (dict(top_p=1.01), "top_p"),
  (dict(top_k=-2), "top_k"),
  (dict(min_p=-0.01), "min_p"),
  (dict(min_p=1.01), "min_p"),
  (dict(presence_penalty=2.01), "presence_penalty"),
  (dict(presence_penalty=-2.01), "presence_penalty"),
  (dict(frequency_penalty=2.5), "frequency_penalty"),
  (dict(frequency_penalty=-2.5), "frequency_penalty"),
  (dict(repetition_penalty=0.0), "repetition_penalty"),
  (dict(repetition_penalty=-1.0), "repetition_penalty"),
  (dict(max_tokens=0), "max_tokens"),
  (dict(min_tokens=-1), "min_tokens"),
  (dict(min_tokens=5, max_tokens=4), "min_tokens"),
  (dict(logprobs=-2), "logprobs"),
  (dict(prompt_logprobs=-2), "prompt_logprobs"),
  (dict(allowed_token_ids=[]), "allowed_token_ids"),
  (dict(stop=[""]), "stop"),
  (dict(stop=["ok", ""]), "stop"),
  (dict(temperature=0.0, n=2), "n"),
  (dict(stop=5), "stop"),
  (dict(bad_words=5), "bad_words"),
  (dict(stop=b"x"), "stop"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[f"{k}" for k, _ in BAD_PARAMS])
def test_sampling_params_rejects_out_of_range(kwargs, field):
  with pytest.raises(ValueError) as err:
    je.SamplingParams(**kwargs)
  assert _names(str(err.value), field), f"message {str(err.value)!r} does not name {field!r}"


def test_sampling_params_rejects_non_int_top_k():
  with pytest.raises((TypeError, ValueError)):
    je.SamplingParams(top_k=1.5)


GOOD_PARAMS = [
  dict(temperature=0.0),
  dict(top_p=1.0),
  dict(top_p=1e-3),
  dict(top_k=-1),
  dict(top_k=0),
  dict(top_k=10**6),
  dict(min_p=0.0),
  dict(min_p=1.0),
  dict(presence_penalty=2.0),
  dict(presence_penalty=-2.0),
  dict(frequency_penalty=2.0),
  dict(frequency_penalty=-2.0),
  dict(repetition_penalty=1e-3),
  dict(repetition_penalty=100.0),
  dict(max_tokens=None),
  dict(max_tokens=1),
  dict(min_tokens=4, max_tokens=4),
  dict(logprobs=-1),
  dict(logprobs=0),
  dict(prompt_logprobs=-1),
  dict(prompt_logprobs=0),
  dict(n=3, seed=5),
  dict(seed=0),
  dict(allowed_token_ids=[0]),
  dict(stop=["x"]),
  dict(stop_token_ids=[1, 2]),
  dict(bad_words_token_ids=[[1], [2, 3]]),
  dict(logit_bias={0: -100.0, 3: 100.0}),
]


@pytest.mark.parametrize("kwargs", GOOD_PARAMS, ids=[f"{k}" for k in GOOD_PARAMS])
def test_sampling_params_accepts_boundary_values(kwargs):
  je.SamplingParams(**kwargs)


def test_sampling_params_defaults():
  p = je.SamplingParams()
  want = dict(
    n=1,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    seed=None,
    max_tokens=16,
    min_tokens=0,
    ignore_eos=False,
    logprobs=None,
    prompt_logprobs=None,
    logit_bias=None,
    allowed_token_ids=None,
  )
  for k, v in want.items():
    assert getattr(p, k) == v, k
  assert not p.stop and not p.stop_token_ids and not p.bad_words_token_ids


def test_sampling_params_normalisation():
  g = je.SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.3, seed=7)
  assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0), "greedy resets top_p/top_k/min_p"
  assert je.SamplingParams(temperature=0.005).temperature == pytest.approx(0.01)
  assert je.SamplingParams(temperature=0.01).temperature == pytest.approx(0.01)
  assert je.SamplingParams(seed=-1).seed is None
  assert je.SamplingParams(seed=5).seed == 5
  assert je.SamplingParams(logprobs=True).logprobs == 1
  assert je.SamplingParams(prompt_logprobs=True).prompt_logprobs == 1
  r = je.SamplingParams(temperature=0.7, top_p=0.5, top_k=5, min_p=0.3)
  assert (r.top_p, r.top_k, r.min_p) == (0.5, 5, 0.3)


def test_sampling_params_are_assignable_as_vllms_and_keyword_only():
  """vLLM's generate.py assigns fields (`sp.max_tokens = 20`), and RL code changes a `clone()`:
  both work; a copy taken with `validated_copy` (what the engine does) checks assigned values
  and normalises them as the constructor would, and is not changed by later assignments."""
  p = je.SamplingParams()
  p.temperature, p.max_tokens = 0.5, 20
  assert (p.temperature, p.max_tokens) == (0.5, 20)
  clone = p.clone()
  clone.top_k = 5
  assert (clone.top_k, p.top_k) == (5, 0)
  p.stop = ["a", "b"]  # a list, as vLLM users write it
  p.structured_outputs = je.StructuredOutputsParams(choice=["x"])
  taken = p.validated_copy()
  assert taken.stop == ("a", "b") and taken is not p and taken.max_tokens == 20
  assert taken.structured_outputs is not p.structured_outputs
  p.max_tokens, p.structured_outputs.choice = 3, ("y",)
  assert taken.max_tokens == 20 and taken.structured_outputs.choice == ("x",)
  p.temperature = -1.0
  with pytest.raises(ValueError, match=r"temperature must be non-negative, got -1\.0"):
    p.validated_copy()
  p.temperature, p.min_tokens = 0.5, 10
  with pytest.raises(ValueError, match="min_tokens must be less than or equal to max_tokens=3"):
    p.validated_copy()
  greedy = je.SamplingParams(top_k=5)
  greedy.temperature = 0.0
  assert greedy.validated_copy().top_k == 0, "greedy resets top_k in the copy, as at construction"
  with pytest.raises(TypeError):
    hash(p)  # mutable, as vLLM's
  with pytest.raises(TypeError):
    je.SamplingParams(1)  # type: ignore[misc]
  with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind, got 'delta'"):
    je.SamplingParams(output_kind="delta")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# InputBatch.add_request rejections

CAPS = dict(max_num_stop_token_ids=4, max_num_logit_bias=4, max_num_bad_words=3, max_bad_word_len=2)


def _caps_batch(seed=0, eos_token_ids=()):
  # No EOS here: the implementation documents max_num_stop_token_ids as the capacity of
  # stop_token_ids *plus* EOS ids (see test_stop_capacity_counts_eos_once).
  return make_batch(
    logprobs_mode="raw_logprobs",
    max_num_logprobs=20,
    seed=seed,
    eos_token_ids=eos_token_ids,
    **CAPS,
  )


def _populate(b, full=False):
  """Four requests, one removed (row 1 is a hole a bad add must not take), unless `full`."""
  b.add_request("g", [1, 2], je.SamplingParams(temperature=0.0, presence_penalty=1.0))
  b.add_request("h", [3], je.SamplingParams(temperature=0.0))
  b.add_request(
    "s", [4, 5], je.SamplingParams(temperature=0.9, seed=11, logprobs=3), output_token_ids=[6]
  )
  b.add_request("t", [7], je.SamplingParams(temperature=1.2, seed=12, top_k=4, logit_bias={2: 1.0}))
  if full:
    for i in range(R - 4):
      b.add_request(f"f{i}", [i], je.SamplingParams(temperature=0.5, seed=100 + i))
  else:
    b.remove_request("h")


def _snapshot(b):
  return (
    list(b.req_ids),
    dict(b.req_id_to_index),
    b.num_reqs,
    [None if o is None else list(o) for o in b.req_output_token_ids],
    b.sampling_metadata,
  )


P = je.SamplingParams  # shorthand

BAD_ADDS = [
  # (id, kwargs for add_request, accepted field names in the message)
  ("prompt-id-too-big", dict(prompt_token_ids=[1, V]), ["prompt_token_ids", "prompt"]),
  ("prompt-id-negative", dict(prompt_token_ids=[-1, 2]), ["prompt_token_ids", "prompt"]),
  ("output-id-too-big", dict(output_token_ids=[V]), ["output_token_ids", "output"]),
  ("output-id-negative", dict(output_token_ids=[-3]), ["output_token_ids", "output"]),
  ("stop-id", dict(sampling_params=lambda: P(stop_token_ids=[V])), ["stop_token_ids"]),
  ("stop-id-negative", dict(sampling_params=lambda: P(stop_token_ids=[-1])), ["stop_token_ids"]),
  ("bias-id", dict(sampling_params=lambda: P(logit_bias={V: 1.0})), ["logit_bias"]),
  ("bias-id-negative", dict(sampling_params=lambda: P(logit_bias={-1: 1.0})), ["logit_bias"]),
  ("allowed-id", dict(sampling_params=lambda: P(allowed_token_ids=[0, V])), ["allowed_token_ids"]),
  (
    "allowed-id-negative",
    dict(sampling_params=lambda: P(allowed_token_ids=[-1])),
    ["allowed_token_ids"],
  ),
  (
    "bad-word-id",
    dict(sampling_params=lambda: P(bad_words_token_ids=[[1, V]])),
    ["bad_words_token_ids", "bad_words"],
  ),
  (
    "bad-word-id-negative",
    dict(sampling_params=lambda: P(bad_words_token_ids=[[-1]])),
    ["bad_words_token_ids", "bad_words"],
  ),
  (
    "too-long",
    dict(prompt_token_ids=[1] * (MML - 3), output_token_ids=[2] * 4),
    ["max_model_len", "prompt_token_ids", "prompt"],
  ),
  (
    "too-long-prompt",
    dict(prompt_token_ids=[1] * (MML + 1)),
    ["max_model_len", "prompt_token_ids", "prompt"],
  ),
  (
    "prompt-fills-the-context",  # no room left for the token the row would sample next
    dict(prompt_token_ids=[1] * MML),
    ["max_model_len", "prompt_token_ids", "prompt"],
  ),
  (
    "too-many-stop-ids",
    dict(sampling_params=lambda: P(stop_token_ids=[1, 2, 3, 4, 5])),
    ["stop_token_ids", "max_num_stop_token_ids"],
  ),
  (
    "too-many-bias",
    dict(sampling_params=lambda: P(logit_bias={i: 0.1 for i in range(5)})),
    ["logit_bias", "max_num_logit_bias"],
  ),
  (
    "too-many-bad-words",
    dict(sampling_params=lambda: P(bad_words_token_ids=[[1], [2], [3], [4]])),
    ["bad_words_token_ids", "bad_words", "max_num_bad_words"],
  ),
  (
    "bad-word-too-long",
    dict(sampling_params=lambda: P(bad_words_token_ids=[[1, 2, 3]])),
    ["bad_words_token_ids", "bad_words", "max_bad_word_len"],
  ),
  (
    "logprobs-over-max",
    dict(sampling_params=lambda: P(logprobs=21)),
    ["logprobs", "max_num_logprobs"],
  ),
  (
    "logprobs-all-not-enabled",
    dict(sampling_params=lambda: P(logprobs=-1)),
    ["logprobs", "max_num_logprobs"],
  ),
  (
    "prompt-logprobs-over-max",
    dict(sampling_params=lambda: P(prompt_logprobs=21)),
    ["prompt_logprobs", "max_num_logprobs"],
  ),
  ("duplicate-req-id", dict(req_id="s"), ["req_id", "duplicate", "already"]),
]


def _call_add(b, case):
  kw = dict(
    req_id="new",
    prompt_token_ids=[1],
    sampling_params=lambda: P(temperature=0.0),
    output_token_ids=(),
  )
  kw.update(case)
  sp = kw["sampling_params"]
  params = sp() if callable(sp) else sp  # constructing may already raise: also acceptable
  return b.add_request(
    kw["req_id"], kw["prompt_token_ids"], params, output_token_ids=kw["output_token_ids"]
  )


def _sample_trace(b, steps=3):
  rng = np.random.default_rng(123)
  out = []
  for _ in range(steps):
    o = b.sample(rng.uniform(-2, 2, size=(R, V)).astype(np.float32))
    lp = None if o.logprobs is None else (o.logprobs.token_ids.tolist(), o.logprobs.ranks.tolist())
    out.append((list(b.req_ids), o.sampled_token_ids.tolist(), lp))
  return out


@pytest.mark.parametrize("name,case,fields", BAD_ADDS, ids=[c[0] for c in BAD_ADDS])
def test_add_request_rejects_and_leaves_batch_unchanged(name, case, fields):
  clean, dirty = _caps_batch(), _caps_batch()
  _populate(clean)
  _populate(dirty)
  before = _snapshot(dirty)
  with pytest.raises(ValueError) as err:
    _call_add(dirty, case)
  assert _names(str(err.value), *fields), f"message {str(err.value)!r} names none of {fields}"
  after = _snapshot(dirty)
  assert after[:4] == before[:4]
  assert after[4] is before[4], "a rejected add must not rebuild the metadata"
  # The hole is still the lowest free row and later steps match the clean batch exactly.
  for b in (clean, dirty):
    assert b.add_request("next", [2, 3], P(temperature=1.0, seed=5, logprobs=2)) == 1
  assert _sample_trace(dirty) == _sample_trace(clean)


def test_add_request_rejects_full_batch_and_leaves_it_unchanged():
  clean, dirty = _caps_batch(), _caps_batch()
  _populate(clean, full=True)
  _populate(dirty, full=True)
  before = _snapshot(dirty)
  with pytest.raises(ValueError):
    dirty.add_request("overflow", [1], P(temperature=0.0))
  after = _snapshot(dirty)
  assert after[:4] == before[:4] and after[4] is before[4]
  assert _sample_trace(dirty) == _sample_trace(clean)
  # after a removal there is room again
  assert dirty.remove_request("g") == 0
  assert dirty.add_request("overflow", [1], P(temperature=0.0)) == 0


def test_rejected_add_does_not_perturb_later_unseeded_streams():
  """Strict form of "unchanged": an unseeded request added after a failed add draws the same stream
  as in a batch that never saw the failed call."""
  clean, dirty = _caps_batch(), _caps_batch()
  _populate(clean)
  _populate(dirty)
  with pytest.raises(ValueError):
    dirty.add_request("bad", [V], P(temperature=1.0))
  for b in (clean, dirty):
    b.add_request("u", [1], P(temperature=1.0))
  assert _sample_trace(dirty, steps=5) == _sample_trace(clean, steps=5)


def test_capacity_limits_are_inclusive():
  b = _caps_batch()
  b.add_request("a", [1] * (MML - 3), P(stop_token_ids=[1, 2, 3, 4]), output_token_ids=[0, 0])
  b.add_request(
    "b", [1], P(logit_bias={i: 0.1 for i in range(4)}, bad_words_token_ids=[[1, 2], [3], [4, 5]])
  )
  b.add_request("c", [1], P(logprobs=20, prompt_logprobs=20, allowed_token_ids=list(range(V))))
  b.add_request(
    "d", [0, V - 1], P(stop_token_ids=[V - 1], logit_bias={V - 1: 1.0}), output_token_ids=[V - 1]
  )
  assert b.num_reqs == 4


def test_all_vocab_logprobs_need_max_num_logprobs_of_the_vocabulary():
  b = make_batch(max_num_logprobs=-1, logprobs_mode="processed_logprobs")
  b.add_request("a", [1], P(logprobs=-1, prompt_logprobs=-1))
  b.add_request("b", [1], P(logprobs=V))
  assert b.num_reqs == 2
  # As vLLM: -1 counts as V, so a limit of at least V allows it.
  for limit in (V, V + 5):
    b = make_batch(max_num_logprobs=limit)
    b.add_request("a", [1], P(logprobs=-1, prompt_logprobs=-1))
    out = b.sample(np.zeros((R, V), np.float32))
    assert out.logprobs.token_ids.shape == (1, V + 1)
  b = make_batch(max_num_logprobs=V - 1)
  with pytest.raises(ValueError, match=rf"logprobs=-1 \(the whole vocabulary, {V}\) exceeds"):
    b.add_request("a", [1], P(logprobs=-1))
  for limit in (-1, V + 5):  # more than the vocabulary holds: refused (the host would build
    b = make_batch(max_num_logprobs=limit)  # a k-long list per token), as vLLM does
    for field in ("logprobs", "prompt_logprobs"):
      with pytest.raises(ValueError, match=rf"{field}={V + 1} exceeds the vocabulary size {V}"):
        b.add_request("a", [1], P(**{field: V + 1}))
    assert b.num_reqs == 0


def test_min_tokens_past_any_reachable_length_is_accepted():
  b = make_batch()
  b.add_request("a", [1], P(min_tokens=2**33, max_tokens=None, stop_token_ids=[3]))
  b.add_request("b", [1], P(min_tokens=2**31 + 3, max_tokens=2**40))
  logits = np.zeros((R, V), np.float32)
  logits[:, 3], logits[:, V - 1] = 10.0, 11.0  # a's stop id and EOS, forbidden by min_tokens
  token_a, token_b = b.sample(logits).sampled_token_ids.tolist()
  assert token_a not in (3, V - 1) and token_b == 3


def test_stop_capacity_counts_eos_once():
  """Documented choice of the implementation: the capacity covers the stop set (stop ids U EOS)."""
  b = _caps_batch(eos_token_ids=(V - 1,))
  b.add_request("a", [1], P(stop_token_ids=[1, 2, 3]))
  b.add_request("b", [1], P(stop_token_ids=[1, 2, 3, V - 1]))  # EOS already in the list
  with pytest.raises(ValueError):
    b.add_request("c", [1], P(stop_token_ids=[1, 2, 3, 4]))
