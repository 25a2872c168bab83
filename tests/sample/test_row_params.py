"""The table of per-row sampling parameters (`jaxengine.sample.row_params`) drives the batch state,
the row update, the encoding of a request and the sampling metadata."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxengine as je
from jaxengine.sample import BatchState, RowUpdate, SamplingMetadata
from jaxengine.sample.row_params import (
  RowParams,
  any_row_uses,
  encode_row_params,
  row_param_specs,
)

CONFIG = je.BatchConfig(max_num_reqs=4, max_model_len=16, vocab_size=40)
NAMES = [f.name for f in dataclasses.fields(RowParams)]


def _names(cls) -> set[str]:
  return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", [BatchState, RowUpdate, SamplingMetadata])
def test_each_table_entry_is_a_field_of_the_state_the_row_and_the_metadata(cls):
  assert set(NAMES) <= _names(cls)
  assert list(row_param_specs()) == NAMES


def test_an_empty_state_and_default_params_hold_every_off_value():
  state = BatchState.create(CONFIG)
  row = encode_row_params(je.SamplingParams(), CONFIG)
  for name, spec in row_param_specs().items():
    off = spec.off_value(CONFIG)
    column = np.asarray(getattr(state, name))
    assert column.dtype == spec.dtype and column.shape == (CONFIG.max_num_reqs,), name
    assert (column == off).all(), name
    assert row[name].dtype == spec.dtype and row[name].shape == () and row[name] == off, name


def test_a_row_holds_its_params_under_their_own_names():
  params = je.SamplingParams(
    temperature=0.7,
    top_k=7,
    top_p=0.9,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.1,
    logprobs=3,
    min_tokens=2,
  )
  batch = je.InputBatch.from_config(CONFIG)
  row = batch.add_request("a", [1, 2], params)
  for name in NAMES:
    expected = params.logprobs if name == "num_logprobs" else getattr(params, name)
    spec = row_param_specs()[name]
    assert getattr(batch.state, name)[row] == np.asarray(expected, spec.dtype), name


def test_metadata_reads_each_param_only_in_the_rows_that_use_it():
  batch = je.InputBatch.from_config(CONFIG)
  used = dict(top_k=5, top_p=0.5, min_p=0.1, presence_penalty=1.0, logprobs=2, min_tokens=1)
  batch.add_request("random", [1], je.SamplingParams(temperature=0.8, **used))
  batch.add_request("greedy", [1], je.SamplingParams(temperature=0.0, **used))
  md = batch.sampling_metadata
  for name, spec in row_param_specs().items():
    values, off = np.asarray(getattr(md, name)), spec.off_value(CONFIG)
    assert (values[2:] == off).all(), f"{name}: free rows read as off"
    # The greedy row reads its live params; frequency and repetition were left at their defaults.
    left_off = spec.used_by == "random" or name in ("frequency_penalty", "repetition_penalty")
    assert (values[1] == off) == left_off, name
  assert np.asarray(md.top_k)[0] == 5 and np.asarray(md.num_logprobs)[:2].tolist() == [2, 2]


def test_any_row_uses_agrees_with_the_metadata_flags():
  batch = je.InputBatch.from_config(CONFIG)
  batch.add_request("a", [1], je.SamplingParams(top_p=0.5))
  md = batch.sampling_metadata
  assert bool(any_row_uses(md, "top_p", CONFIG)) and bool(md.any_top_p)
  assert not bool(any_row_uses(md, "top_k", CONFIG)) and not bool(md.any_top_k)
  assert not bool(any_row_uses(md, "min_p", CONFIG)) and not bool(md.any_min_p)
  batch.add_request("b", [1], je.SamplingParams(top_k=3, temperature=0.0))  # greedy: off
  md = batch.sampling_metadata
  assert not bool(any_row_uses(md, "top_k", CONFIG)) and not bool(md.any_top_k)
