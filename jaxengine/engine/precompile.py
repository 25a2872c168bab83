"""Compiling every bucket of a `ModelRunner` ahead of the first request (`LLM(precompile=True)`)."""

from __future__ import annotations

from typing import Any, cast

import jax
import numpy as np
from tqdm import tqdm

from jaxengine.batch.step_loop import run_steps
from jaxengine.engine.multi_step import stop_rule_arrays
from jaxengine.engine.prefix_prefill import load_blocks, save_blocks
from jaxengine.models.kv_cache import KVCache


def precompile_buckets(
  runner: Any, num_decode_steps: int, use_tqdm: bool, num_speculative_tokens: int = 0
) -> int:
  """Runs each prefill and decode shape of `runner` (a `ModelRunner`, which calls this: typed
  loosely so the two modules do not import each other) once; see `ModelRunner.precompile`."""
  batch = runner.input_batch
  if batch.num_reqs:
    raise ValueError(f"precompile needs an empty batch, it holds {batch.num_reqs} requests")
  shapes = [("prefill", rows, n) for rows in runner.row_buckets for n in runner.length_buckets]
  prefix = runner.prefix_cache
  if prefix is not None:  # prefills after a cached prefix attend further; the block copies
    lengths = runner.length_buckets
    shapes += [
      ("prefill", rows, (n, a)) for rows in runner.row_buckets for n in lengths for a in lengths
      if a > n
    ]  # fmt: skip
    shapes += [("copy", size, None) for size in prefix.copy_buckets]
  shapes += [("decode", rows, n) for rows in runner.row_buckets for n in runner.attention_buckets]
  if num_speculative_tokens:
    shapes += [("verify", rows, n) for rows in runner.row_buckets for n in runner.attention_buckets]
  for kind, rows, n in tqdm(shapes, desc="Compiling", disable=not use_tqdm, dynamic_ncols=True):
    if kind == "prefill":
      length, longer = n if isinstance(n, tuple) else (n, None)
      runner.kv_cache = runner._prefill(
        runner.weights,
        runner.kv_cache,
        np.zeros((rows, length), np.int32),
        np.full((rows, length), runner.max_model_len, np.int32),
        np.zeros((rows,), np.int32),
        **({} if longer is None else {"attention_len": longer}),  # as `prefill_rows` calls
      )
    elif kind == "verify":
      drafts = np.zeros((rows, num_speculative_tokens), np.int32)
      _, kv_cache = run_steps(
        batch, runner._verify, runner.weights, runner.kv_cache, drafts,
        np.zeros((rows,), np.int32), attention_len=n, num_rows=rows,
      )  # fmt: skip
      runner.kv_cache = cast(KVCache, kv_cache)
    elif kind == "copy":  # padding copies only: nothing is written
      drop = np.full((rows,), runner.kv_cache.num_slots, np.int32)
      zeros = np.zeros((rows,), np.int32)
      runner.kv_cache = load_blocks(runner.kv_cache, prefix.pool, zeros, drop, zeros)
      pad = np.full((rows,), prefix.index.num_blocks, np.int32)
      prefix.pool = save_blocks(prefix.pool, runner.kv_cache, pad, zeros, zeros)
    elif num_decode_steps == 1:
      _, kv_cache = batch.run(runner._decode, runner.weights, runner.kv_cache, n, rows)
      runner.kv_cache = cast(KVCache, kv_cache)
    else:
      max_output_tokens, stop_ids = stop_rule_arrays([], rows, runner.max_num_device_stop_ids)
      _, kv_cache = run_steps(
        batch,
        runner._decode_steps,
        runner.weights,
        runner.kv_cache,
        max_output_tokens,
        stop_ids,
        np.bool_(False),
        attention_len=n,
        num_rows=rows,
        num_steps=num_decode_steps,
      )
      runner.kv_cache = cast(KVCache, kv_cache)
  jax.block_until_ready(runner.kv_cache)
  return len(shapes)
