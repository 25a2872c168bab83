"""Engines whose steps run in one shape: the tests that compare engines, not bucket choice."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def one_shape(engine: T) -> T:
  """Limits each runner of `engine` (an `LLMEngine` or an `LLM`) to its largest row and token
  bucket, and returns it.

  Every step then compiles once (per variant: prompt logprobs, verify, k-step loop) instead of
  once per (token bucket, row bucket): for tests whose point is what the engines compute (their
  tokens against a reference's), not which bucket a step takes (tests/worker/test_step_shapes.py
  checks those). Engines compared with one another must all be limited: they then pad alike.
  """
  inner = getattr(engine, "llm_engine", engine)
  for core in inner.cores:
    runner = core.runner
    runner.row_buckets, runner.token_buckets = runner.row_buckets[-1:], runner.token_buckets[-1:]
  return engine
