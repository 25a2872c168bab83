"""`one_shape`: an engine whose steps all run in their largest shape, for tests where the bucket
a step pads to is not the point (tests/worker/test_step_shapes.py checks the buckets)."""

from __future__ import annotations


def one_shape(llm):
  """Sets each runner of `llm` to its largest row bucket and its largest token bucket only, so its
  model compiles one step shape instead of one per `(token bucket, row bucket)` pair (each a
  compile of the whole model). The steps' rows and tokens are padding to that shape: the results
  of a request are those of its own tokens, so an engine compared against transformers, another
  engine or a float reference compares as with every bucket. Returns `llm`."""
  for core in llm.llm_engine.cores:
    runner = core.runner
    runner.row_buckets, runner.token_buckets = runner.row_buckets[-1:], runner.token_buckets[-1:]
  return llm
