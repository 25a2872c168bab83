"""Compiling every bucket of a `ModelRunner` ahead of the first request (`LLM(precompile=True)`).

The runner hands over what the compiles need as a `PrecompileTarget` (its jitted `RunnerSteps`,
buckets, batch, weights and KV cache): this module never reaches into the runner's own state,
and gives the cache back through `PrecompileTarget.set_kv_cache`.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import jax
import numpy as np
from tqdm import tqdm

from jaxengine.batch import InputBatch
from jaxengine.batch.step_loop import run_steps
from jaxengine.engine.multi_step import stop_rule_arrays
from jaxengine.engine.steps import RunnerSteps
from jaxengine.models.kv_cache import KVCache


class PrecompileTarget(Protocol):
  """What precompiling needs of a runner (`ModelRunner` is one; typed structurally so the two
  modules do not import each other)."""

  @property
  def input_batch(self) -> InputBatch: ...
  @property
  def steps(self) -> RunnerSteps: ...
  @property
  def weights(self) -> Any: ...
  @property
  def kv_cache(self) -> KVCache: ...
  @property
  def row_buckets(self) -> list[int]: ...
  @property
  def length_buckets(self) -> list[int]: ...
  @property
  def attention_buckets(self) -> list[int]: ...
  @property
  def max_model_len(self) -> int: ...
  @property
  def max_num_device_stop_ids(self) -> int: ...
  def set_kv_cache(self, kv_cache: KVCache) -> None: ...


def precompile_shapes(
  runner: PrecompileTarget, num_speculative_tokens: int = 0
) -> list[tuple[str, int, Any]]:
  """The `(kind, rows, size)` step shapes to compile: every prefill (row, length) bucket, every
  decode (row, attention) bucket, and with speculation every verify (row, attention) bucket."""
  rows, lengths, attention = runner.row_buckets, runner.length_buckets, runner.attention_buckets
  shapes: list[tuple[str, int, Any]] = [("prefill", r, n) for r in rows for n in lengths]
  shapes += [("decode", r, n) for r in rows for n in attention]
  if num_speculative_tokens:
    shapes += [("verify", r, n) for r in rows for n in attention]
  return shapes


def precompile_buckets(
  runner: PrecompileTarget, num_decode_steps: int, use_tqdm: bool, num_speculative_tokens: int = 0
) -> int:
  """Runs each prefill and decode shape of `runner` once; see `ModelRunner.precompile`."""
  batch = runner.input_batch
  if batch.num_reqs:
    raise ValueError(f"precompile needs an empty batch, it holds {batch.num_reqs} requests")
  shapes = precompile_shapes(runner, num_speculative_tokens)
  steps, weights = runner.steps, runner.weights
  kv_cache: Any = runner.kv_cache
  for kind, rows, n in tqdm(shapes, desc="Compiling", disable=not use_tqdm, dynamic_ncols=True):
    if kind == "prefill":
      kv_cache = steps.prefill(
        weights,
        kv_cache,
        np.zeros((rows, n), np.int32),
        np.full((rows, n), runner.max_model_len, np.int32),
        np.zeros((rows,), np.int32),
      )
    elif kind == "verify":
      drafts = np.zeros((rows, num_speculative_tokens), np.int32)
      _, kv_cache = run_steps(
        batch, steps.verify, weights, kv_cache, drafts, np.zeros((rows,), np.int32),
        attention_len=n, num_rows=rows,
      )  # fmt: skip
    elif num_decode_steps == 1:
      _, kv_cache = batch.run(steps.decode, weights, kv_cache, n, rows)
    else:
      max_output_tokens, stop_ids = stop_rule_arrays([], rows, runner.max_num_device_stop_ids)
      _, kv_cache = run_steps(
        batch,
        steps.decode_steps,
        weights,
        kv_cache,
        max_output_tokens,
        stop_ids,
        np.bool_(False),
        attention_len=n,
        num_rows=rows,
        num_steps=num_decode_steps,
      )
    runner.set_kv_cache(cast(KVCache, kv_cache))  # after each step: the old cache was donated
  jax.block_until_ready(kv_cache)
  return len(shapes)
