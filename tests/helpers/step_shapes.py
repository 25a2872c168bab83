"""Engines that run every step in one shape, for tests that compare engines, not bucket choice."""

from __future__ import annotations


def one_shape(llm):
  """Makes each group's runner of `llm` (a `jaxengine.LLM`) run its steps in its largest shape.

  Each (token bucket, row bucket) a runner reaches compiles the model (and its sampler) again. A
  test whose point is not bucket choice (tests/worker/test_step_shapes.py checks that) compares
  engines that pad alike, so their tokens compare as with every bucket, for a fraction of the
  compiles. Returns `llm`.
  """
  for core in llm.llm_engine.cores:
    runner = core.runner
    runner.row_buckets, runner.token_buckets = runner.row_buckets[-1:], runner.token_buckets[-1:]
  return llm
