"""Checks shared by the scanned models' tests: `load_weights` fills a stacked engine's layers."""

from __future__ import annotations

import numpy as np

from jaxengine.models.weights import named_weights


def assert_load_weights_fill_the_stacks(llm, other, trainer) -> None:
  """`llm.load_weights` of `other`'s named tensors, then of the unrolled module `trainer` (checked
  per layer, then stacked), leaves the engine's model with exactly those tensors by name."""
  new = {name: np.asarray(a) for name, a in named_weights(other)}
  llm.load_weights(new)
  got = dict(named_weights(llm.llm_engine.runner.model))
  assert got.keys() == new.keys()
  for name, tensor in new.items():
    np.testing.assert_array_equal(np.asarray(got[name]), tensor, err_msg=name)
  llm.load_weights(trainer)
  got = dict(named_weights(llm.llm_engine.runner.model))
  for name, tensor in named_weights(trainer):
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(tensor), err_msg=name)
