"""KV memory a long Gemma 3 generation holds, with and without freeing the window layers' pages.

  python benchmarks/bench_window_memory.py [--lengths 512 1024 2048] [--window 128] [--batch 4]

A small random Gemma 3 text model (6 layers, 5 local with a `--window` window and 1 global, as
Gemma 3's 5:1 pattern; E=128, 4 query and 2 key/value heads of 64, float32), three engines over
the same 64 MiB pool:

- ``groups``: the default, KV cache groups (`jaxengine/core/kv_cache_groups.py`): a page holds
  one layer (group size 1), the local layers' groups free the pages that slid out of the window;
- ``one table``: ``disable_hybrid_kv_cache_manager=True``, one block table for every layer, every
  page held for the request's life (a page holds all 6 layers);
- ``no window``: the same model with every layer global (the size without windows).

For each generation length: `--batch` prompts of 64 random tokens, greedy, ``ignore_eos``, all at
once; the pages the pool held at its peak (`kv_cache_stats.peak_used_blocks`, read from the
block pool) and their bytes (pages times the bytes of one page of the pool's own device arrays,
`PagedKVCache.pages`), and tokens/s of the whole generation (one warm-up run first; the best of
`--repeats` timed runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import jax
import numpy as np
from flax import nnx

import jaxengine as je
from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma_config import FULL, SLIDING, GemmaConfig

PROMPT_LEN = 64
POOL_BYTES = 64 * 2**20


def _config(window: int, max_len: int, windows: bool) -> GemmaConfig:
  kinds = (SLIDING,) * 5 + (FULL,) if windows else (FULL,) * 6
  return GemmaConfig(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    layer_types=kinds,
    sliding_window=window if windows else None,
    qk_norm=True,
    max_position_embeddings=max_len,
    eos_token_id=None,
  )


def _engine(window: int, max_len: int, name: str) -> je.LLM:
  model = Gemma(_config(window, max_len, name != "no window"), rngs=nnx.Rngs(0))
  return je.LLM(
    model,
    max_num_reqs=8,
    max_model_len=max_len,
    kv_cache_memory_bytes=POOL_BYTES,
    max_num_batched_tokens=256,
    enable_prefix_caching=False,
    disable_hybrid_kv_cache_manager=name == "one table",
  )


def _page_bytes(llm: je.LLM) -> int:
  """Bytes of one page of the pool, from its device arrays."""
  runner = llm.llm_engine.cores[0].runner
  leaves = jax.tree.leaves(runner.kv_cache)
  return sum(leaf.nbytes for leaf in leaves) // runner.num_blocks


def _run(llm: je.LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
  """Seconds of one generation and the pool's peak pages during it."""
  params = je.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
  llm.llm_engine.reset_kv_cache_stats()
  start = time.perf_counter()
  outputs = llm.generate(prompts, params, use_tqdm=False)
  seconds = time.perf_counter() - start
  assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
  return seconds, llm.llm_engine.kv_cache_stats.peak_used_blocks


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
  parser.add_argument("--window", type=int, default=128)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  print(f"{platform.processor() or platform.machine()}, jax {jax.__version__}, {jax.devices()}")
  print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
  max_len = PROMPT_LEN + max(args.lengths)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 256, PROMPT_LEN).tolist() for _ in range(args.batch)]
  engines = {
    name: _engine(args.window, max_len, name) for name in ("groups", "one table", "no window")
  }
  rows = []
  for length in args.lengths:
    for name, llm in engines.items():
      _run(llm, prompts, length)  # warm-up: every shape compiled
      best, peak = min(_run(llm, prompts, length) for _ in range(args.repeats))
      page = _page_bytes(llm)
      rows.append(dataclasses.astuple(_Row(length, name, peak, page, peak * page, best, length)))
  print(f"\nbatch {args.batch}, prompt {PROMPT_LEN}, window {args.window}, block size 16")
  print("| generated | engine | peak pages | bytes/page | peak KV bytes | tokens/s |")
  print("|---:|---|---:|---:|---:|---:|")
  for length, name, peak, page, total, seconds, tokens in rows:
    rate = args.batch * tokens / seconds
    print(f"| {length} | {name} | {peak} | {page} | {total / 2**20:.2f} MiB | {rate:.0f} |")


@dataclasses.dataclass(frozen=True)
class _Row:
  length: int
  engine: str
  peak_pages: int
  page_bytes: int
  peak_bytes: int
  seconds: float
  tokens: int


if __name__ == "__main__":
  main()
