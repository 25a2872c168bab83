"""Speculative decoding in the engine (n-gram and suffix drafts): the config, the proposers, and
outputs that equal plain decoding (greedy and seeded), keep every sampling parameter's meaning
and compile a bounded set."""

import numpy as np
import pytest

import jaxengine as je
from jaxengine.engine import LLMEngine
from jaxengine.spec_decode.config import SpeculativeConfig
from jaxengine.spec_decode.ngram_proposer import (
  NgramProposer,
  draft_limits,
  ngram_draft,
  worth_verifying,
)
from jaxengine.testing import count_compiles, tiny_llama

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3}
# A random tiny model falls into loops under greedy decoding, which prompt lookup then copies.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 4, 3, 4, 3], list(range(20, 40))]


@pytest.fixture(scope="module")
def model():
  return tiny_llama(seed=0)[0]


def _llm(model, **kwargs):
  llm = je.LLM(model, max_num_reqs=4, max_model_len=64, **kwargs)
  # One row bucket: every step compiles once whatever the live rows (keeps the tests fast).
  llm.llm_engine.runner.row_buckets = [4]
  llm.llm_engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
  return llm


@pytest.fixture(scope="module")
def plain(model):
  return _llm(model)


@pytest.fixture(scope="module")
def spec(model):
  return _llm(model, speculative_config=SPEC)


def _tokens(outputs):
  return [[c.token_ids for c in out.outputs] for out in outputs]


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "config, message",
  [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    (
      {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 2,
        "prompt_lookup_min": 3,
      },
      "prompt_lookup_min=3",
    ),
    ("ngram", "dict"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "max_tree_depth must be an int"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": "24"}, "max_tree_depth.*'24'"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 2.0}, "max_tree_depth.*2.0"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "cached_requests.*-1"),
    ({"method": "suffix", "suffix_decoding_max_cached_requests": 1.5}, "cached_requests.*1.5"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": -0.5}, "spec_factor.*-0.5"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": float("nan")}, "spec_factor.*nan"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "min_token_prob.*1.5"),
    ({"method": "suffix", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "suffix", "suffix_decoding_max_depth": 4}, "unknown key 'suffix_decoding_max_"),
    ({"method": "suffix", "prompt_lookup_max": 4}, "prompt_lookup_max does not apply to"),
    (
      {"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.5},
      "apply",
    ),
  ],
)
def test_invalid_config_names_field_and_value(config, message):
  with pytest.raises(ValueError, match=message):
    SpeculativeConfig.build(config)


def test_config_defaults_and_engine_refusals(model):
  config = SpeculativeConfig.build({"method": "ngram", "num_speculative_tokens": 5})
  assert (config.prompt_lookup_max, config.prompt_lookup_min) == (4, 2)
  high = SpeculativeConfig.build(
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 6}
  )
  assert (high.prompt_lookup_max, high.prompt_lookup_min) == (6, 6)
  # Drafts and several decode steps per dispatch compose (tests/engine/test_composition.py).
  both = LLMEngine(model, num_decode_steps=2, max_model_len=64, speculative_config=SPEC)
  assert both.config.num_decode_steps == 2 and both.config.speculative is not None
  # More drafts than a sequence can hold: refused before any [rows, k] buffer is made.
  huge = {"method": "ngram", "num_speculative_tokens": 10**9}
  with pytest.raises(ValueError, match="num_speculative_tokens=1000000000 must be below"):
    LLMEngine(model, max_model_len=64, speculative_config=huge)
  # Suffix decoding: vLLM's defaults, k the tree's depth unless given.
  suffix = SpeculativeConfig.build({"method": "suffix"})
  assert (suffix.num_speculative_tokens, suffix.suffix_decoding_max_tree_depth) == (24, 24)
  assert suffix.suffix_decoding_max_cached_requests == 10000
  assert (suffix.suffix_decoding_max_spec_factor, suffix.suffix_decoding_min_token_prob) == (1, 0.1)
  assert SpeculativeConfig.build({**SUFFIX, "suffix_decoding_max_cached_requests": 0}) is not None
  bad = {"method": "suffix", "suffix_decoding_max_tree_depth": -3}
  with count_compiles() as compiles, pytest.raises(ValueError, match=r"max_tree_depth.*-3"):
    LLMEngine(model, max_model_len=64, speculative_config=bad)
  assert compiles.count == 0  # refused before anything compiles


# --- proposer ----------------------------------------------------------------------------------


def test_ngram_draft_copies_after_the_longest_suffix_match():
  tokens = np.array([1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3], np.int32)
  # "1 2 3" (n = 3) occurs at the start, "2 3" also later: the longer match wins.
  assert ngram_draft(tokens, 2, 3, 3).tolist() == [9, 9, 7]
  assert ngram_draft(tokens, 2, 2, 3).tolist() == [4, 5, 6]  # last occurrence of "2 3"
  assert ngram_draft(tokens, 4, 4, 3).tolist() == []  # no 4-gram repeats
  assert ngram_draft(tokens, 2, 3, 1).tolist() == [9]
  assert ngram_draft(np.array([5, 5], np.int32), 2, 3, 3).tolist() == []


def test_ngram_draft_in_a_periodic_tail_takes_a_full_draft():
  tokens = np.array([8, 1, 2, 1, 2, 1, 2, 1, 2], np.int32)
  assert ngram_draft(tokens, 2, 4, 3).tolist() == [1, 2, 1]
  assert ngram_draft(np.array([7, 7, 7, 7], np.int32), 2, 2, 3).tolist() == [7, 7]  # the earliest


def test_proposer_follows_outputs_and_starts_afresh_for_a_new_completion():
  class Fake:
    def __init__(self, prompt):
      self.seq_id = "a"
      self.request = type("R", (), {"prompt_token_ids": prompt})()
      self.token_ids = []

  config = SpeculativeConfig.build({"method": "ngram", "num_speculative_tokens": 2})
  proposer = NgramProposer(config, max_model_len=32)
  first = Fake([1, 2, 3, 4, 1])
  assert proposer.propose([first], [2]).num_draft_tokens.tolist() == [0]
  first.token_ids += [2]  # "1 2" now repeats: draft "3 4"
  drafts = proposer.propose([first], [2])
  assert drafts.token_ids.tolist() == [[3, 4]] and drafts.num_draft_tokens.tolist() == [2]
  assert proposer.propose([first], [1]).token_ids.tolist() == [[3, 0]]
  second = Fake([7, 8, 9])  # the same id, a new completion
  assert proposer.propose([second], [2]).num_draft_tokens.tolist() == [0]
  second.token_ids += [7, 8]
  assert proposer.propose([second], [2]).token_ids.tolist() == [[9, 7]]
  assert proposer.propose([], []).token_ids.shape == (0, 2) and not proposer._buffers


def test_cost_model_verifies_when_expected_drafts_pay_for_the_wider_pass():
  # One row, k = 4 on a CPU-like crossover of 4 tokens: verify costs 9 / 5 of a decode step.
  assert worth_verifying(0.9, 1, 1, 4, 4) and not worth_verifying(0.7, 1, 1, 4, 4)
  # 32 rows: verify costs 164 / 36 of a decode: only nearly perfect drafts pay on such a machine.
  assert worth_verifying(4 * 32, 32, 32, 4, 4) and not worth_verifying(3 * 32, 32, 32, 4, 4)
  # Bound by reading the weights (an accelerator): verify costs 416 / 288 of a decode.
  assert worth_verifying(16, 32, 32, 4, 256) and not worth_verifying(8, 32, 32, 4, 256)


def test_acceptance_estimate_follows_verify_outcomes():
  class Fake:
    def __init__(self, seq_id):
      self.seq_id = seq_id
      self.request = type("R", (), {"prompt_token_ids": [1, 2, 3, 1, 2]})()
      self.token_ids = []

  config = SpeculativeConfig.build({"method": "ngram", "num_speculative_tokens": 3})
  proposer = NgramProposer(config, max_model_len=32)
  good, bad = Fake("good"), Fake("bad")
  drafts = proposer.propose([good, bad], [3, 3])
  assert drafts.num_draft_tokens.tolist() == [3, 3]
  assert proposer.expected_gain([good, bad], drafts) == pytest.approx(2 * 3)
  proposer.record([good, bad], np.array([3, 3]), np.array([4, 1]))  # all accepted / none
  assert proposer._buffers["good"].acceptance == 1 > 0.6 > proposer._buffers["bad"].acceptance


def test_draft_limits_keep_max_tokens_and_max_model_len():
  class Fake:
    def __init__(self, max_tokens, num_output, num_prompt):
      self.params = je.SamplingParams(max_tokens=max_tokens)
      self.token_ids = [0] * num_output
      self.num_tokens = num_prompt + num_output

  completions = [Fake(10, 9, 5), Fake(10, 8, 5), Fake(100, 0, 5), Fake(100, 0, 125)]
  assert draft_limits(completions, 128, 3) == [0, 1, 3, 2]


# --- engine ------------------------------------------------------------------------------------


def test_greedy_output_equals_plain_decoding_and_drafts_are_accepted(plain, spec):
  params = je.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
  before = spec.llm_engine.spec_decode_stats.num_accepted_tokens
  expected = plain.generate(PROMPTS, params, use_tqdm=False)
  got = spec.generate(PROMPTS, params, use_tqdm=False)
  assert _tokens(got) == _tokens(expected)
  stats = spec.llm_engine.spec_decode_stats
  assert stats.num_accepted_tokens - before > 10
  assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens
  assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
  assert stats.num_spec_steps < stats.num_steps and stats.num_declined_steps == 0
  for a, b in zip(got, expected):
    lp_a, lp_b = a.outputs[0].logprobs, b.outputs[0].logprobs
    assert len(lp_a) == len(lp_b) == 40  # one entry per emitted token
    for x, y in zip(lp_a, lp_b):
      assert x.keys() == y.keys()
      np.testing.assert_allclose(
        [v.logprob for v in x.values()], [v.logprob for v in y.values()], atol=1e-4
      )


def test_max_tokens_min_tokens_and_stop_ids_keep_their_meaning(plain, spec):
  greedy = je.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
  reference = _tokens(plain.generate(PROMPTS, greedy, use_tqdm=False))
  for max_tokens in (1, 2, 7):
    params = je.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    got = _tokens(spec.generate(PROMPTS, params, use_tqdm=False))
    assert got == [[r[0][:max_tokens]] for r in reference]
  # Stop at a token that appears early (inside a run of accepted drafts), and not before
  # min_tokens.
  stop = reference[0][0][3]
  params = je.SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop], min_tokens=5)
  expected = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
  got = spec.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
  assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
  assert got.token_ids[-1] == stop and len(got.token_ids) > 5


def test_seeded_sampling_repeats_and_n_gives_n_completions(spec):
  params = je.SamplingParams(temperature=0.8, max_tokens=24, seed=7, n=2, ignore_eos=True)
  first = _tokens(spec.generate(PROMPTS, params, use_tqdm=False))
  second = _tokens(spec.generate(PROMPTS, params, use_tqdm=False))
  assert first == second
  assert all(len(c) == 2 and all(len(t) == 24 for t in c) for c in first)


@pytest.fixture(scope="module")
def suffix(model):
  return _llm(model, speculative_config=SUFFIX)


def test_suffix_greedy_and_seeded_outputs_equal_plain_decoding(plain, suffix):
  """Suffix drafts change speed only: greedy rows and seeded `n = 3` samples (whose siblings'
  outputs feed each other's drafts) give plain decoding's tokens, and drafts are accepted."""
  greedy = je.SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1)
  seeded = je.SamplingParams(temperature=1.0, max_tokens=20, seed=11, n=3, ignore_eos=True)
  stats = suffix.llm_engine.spec_decode_stats
  for params in (greedy, seeded):
    before = stats.num_accepted_tokens
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    got = suffix.generate(PROMPTS, params, use_tqdm=False)
    assert _tokens(got) == _tokens(expected)
    assert stats.num_accepted_tokens > before
  assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
  proposer = suffix.llm_engine.cores[0]._speculation.policy.proposer
  assert type(proposer).__name__ == "SuffixProposer" and proposer.num_cached > 0


def test_mixed_steps_compile_nothing_after_warm_up(spec):
  params = [
    je.SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, seed=s, logprobs=lp)
    for t, m, s, lp in ((0, 20, None, None), (1.0, 9, 3, 1), (0.5, 30, None, None))
  ]
  spec.generate(PROMPTS, params, use_tqdm=False)
  steps = spec.llm_engine.spec_decode_stats.num_spec_steps
  with count_compiles() as compiles:
    spec.generate(PROMPTS[::-1], params, use_tqdm=False)
    spec.generate(PROMPTS[:1], params[1:2], use_tqdm=False)
  assert spec.llm_engine.spec_decode_stats.num_spec_steps > steps
  assert compiles.count == 0
