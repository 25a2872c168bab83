"""Checks shared by the models' tests: `named_weights` gives a checkpoint's tensors back, and
`load_weights` fills a stacked engine's layers."""

from __future__ import annotations

import os

import numpy as np
import safetensors.numpy

from jaxengine.models.weights import named_weights


def assert_named_weights_are_the_checkpoint(model, directory: str | os.PathLike) -> None:
  """`named_weights(model)` (what `LLM.load_weights` takes) holds exactly the tensors of
  `directory`'s ``model.safetensors``, by name and bit for bit."""
  tensors = safetensors.numpy.load_file(os.path.join(directory, "model.safetensors"))
  named = {name: np.asarray(value) for name, value in named_weights(model)}
  assert named.keys() == tensors.keys()
  for name, value in named.items():
    np.testing.assert_array_equal(value, tensors[name], err_msg=name)


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
