"""`BatchConfig`: one validated, frozen, hashable configuration, built once and passed down."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from batch_utils import MML, PROCESSED_LOGITS, R, V

import jaxengine as je
from jaxengine.sample import BatchState, RowUpdate

BASE = dict(max_num_reqs=4, max_model_len=16, vocab_size=40)
CAPACITIES = [
  "max_num_reqs",
  "max_model_len",
  "vocab_size",
  "max_num_stop_token_ids",
  "max_num_logit_bias",
  "max_num_bad_words",
  "max_bad_word_len",
  "num_topk_candidates",
]


@pytest.mark.parametrize("field", CAPACITIES)
@pytest.mark.parametrize("value", [0, -3, True, 2.0, "8", None])
def test_bad_capacities_are_value_errors_naming_field_and_value(field, value):
  with pytest.raises(ValueError, match=rf"^{field} .*{re.escape(repr(value))}$"):
    je.BatchConfig(**{**BASE, field: value})
  with pytest.raises(ValueError, match=field):  # InputBatch checks through the config
    je.InputBatch(**{**BASE, field: value})


@pytest.mark.parametrize(
  "field, value",
  [("max_num_logprobs", -2), ("max_num_logprobs", True), ("max_num_logprobs", 1.5)]
  + [("logprobs_mode", "logits"), ("logprobs_mode", None)],
)
def test_bad_sampler_settings_are_value_errors(field, value):
  with pytest.raises(ValueError, match=field):
    je.BatchConfig(**{**BASE, field: value})


@pytest.mark.parametrize("eos", [True, "2", [1.5], [40], [-1], object()])
def test_bad_eos_token_ids_are_value_errors(eos):
  with pytest.raises(ValueError, match="eos_token_ids"):
    je.InputBatch(**BASE, eos_token_ids=eos)


def test_config_is_frozen_hashable_and_normalised():
  config = je.BatchConfig(**{**BASE, "max_num_reqs": np.int64(4)})
  same = je.BatchConfig(**BASE)
  assert config == same and hash(config) == hash(same) and type(config.max_num_reqs) is int
  assert {config: 1}[same] == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.vocab_size = 3
  assert config.replace(vocab_size=50).vocab_size == 50
  with pytest.raises(ValueError, match="vocab_size"):
    config.replace(vocab_size=0)


def test_derived_static_sizes():
  config = je.BatchConfig(**BASE, num_topk_candidates=64)
  assert config.num_candidates == 40 and config.num_top_logprobs == 20
  assert config.replace(max_num_logprobs=-1).num_top_logprobs == 40
  assert config.replace(max_num_logprobs=100).num_top_logprobs == 40


def test_input_batch_builds_its_config_and_from_config_matches_it():
  # Fields off their defaults, in one of the standard sampler executables (tests/helpers/batch_utils:
  # max_spec_len is no part of the sampler's).
  capacities = dict(max_num_reqs=R, max_model_len=MML, vocab_size=V)
  kwargs = dict(**PROCESSED_LOGITS, max_spec_len=2)
  a = je.InputBatch(*capacities.values(), **kwargs, eos_token_ids=[2], seed=4)
  config = je.BatchConfig(**capacities, **kwargs)
  assert a.config == config and a.state.config == config
  b = je.InputBatch.from_config(config, eos_token_ids=[2], seed=4)
  assert (b.max_num_reqs, b.vocab_size, b.max_model_len) == (R, V, MML)
  assert b.eos_token_ids == (2,) and b.logprobs_mode == "processed_logits"
  assert b.config.max_num_logprobs == -1 and b.config.max_spec_len == 2
  logits = np.random.default_rng(0).normal(size=(R, V)).astype(np.float32)
  for batch in (a, b):
    batch.add_request("x", [1], je.SamplingParams(min_tokens=2, top_p=0.8, logprobs=5))
    batch.add_request("y", [3], je.SamplingParams(temperature=0.5))
  out_a, out_b = a.sample(logits), b.sample(logits)
  np.testing.assert_array_equal(out_a.sampled_token_ids, out_b.sampled_token_ids)
  np.testing.assert_array_equal(out_a.logprobs.logprobs, out_b.logprobs.logprobs)
  with pytest.raises(ValueError, match="config"):
    je.InputBatch.from_config(BASE)


def test_config_is_static_in_the_state_pytree():
  state = BatchState.create(je.BatchConfig(**BASE))
  leaves = jax.tree.leaves(state)
  assert all(isinstance(leaf, jax.Array) for leaf in leaves)
  # every field is one leaf but the static config and the (empty, without processors) tuple of
  # logits-processor states
  assert len(leaves) == len(dataclasses.fields(BatchState)) - 2
  assert state.logits_processor_states == ()


def test_a_row_update_and_the_derived_fields_cover_every_state_field():
  derived = {"key_data", "output_token_counts", "prompt_token_mask", "grammar_bitmask"}
  key_inputs = {"seed_words", "is_seeded", "serial"}
  row_fields = {f.name for f in dataclasses.fields(RowUpdate)}
  state_fields = {f.name for f in dataclasses.fields(BatchState)} - {"config"}
  assert row_fields - key_inputs | derived == state_fields


def test_candidate_budgets_in_effect():
  config = je.BatchConfig(max_num_reqs=4, max_model_len=16, vocab_size=49152)
  assert config.candidate_budgets == (64, 256, 1024)
  assert config.replace(vocab_size=300).candidate_budgets == (64, 256, 300)
  assert config.replace(vocab_size=40).candidate_budgets == (40,)
  assert config.replace(deep_candidate_budgets=[2048, 16, 64, 512]).candidate_budgets == (
    64,
    512,
    2048,
  )
  assert config.replace(deep_candidate_budgets=()).candidate_budgets == (64,)
  for bad in (5, "256", (0,), (True,), (1.5,)):
    with pytest.raises(ValueError, match="deep_candidate_budgets"):
      config.replace(deep_candidate_budgets=bad)


def test_each_row_reads_the_smallest_budget_holding_its_top_k():
  batch = je.InputBatch(8, 16, 100, num_topk_candidates=4, deep_candidate_budgets=(10, 30))
  for i, top_k in enumerate([0, 4, 5, 10, 11, 30, 31, 99]):
    batch.add_request(f"r{i}", [1], je.SamplingParams(top_k=top_k))
  md = batch.sampling_metadata
  assert np.asarray(md.candidate_level).tolist() == [0, 0, 1, 1, 2, 2, 0, 0]
  assert int(md.max_candidate_level) == 2 and bool(md.any_top_k_beyond_candidates)
  batch.remove_request("r6")
  batch.remove_request("r7")
  assert not bool(batch.sampling_metadata.any_top_k_beyond_candidates)
