"""SmolLM2-135M's forward step unrolled against under `jax.lax.scan` (`EngineConfig.scan_layers`):
compile seconds of a decode step and its milliseconds at 1 / 8 / 32 rows.

  python benchmarks/bench_layer_scan.py [--repeats 10] [--context 64] [--model gemma3|qwen3_5]

``--model gemma3``: a Gemma-3-shaped model instead (Gemma 3 1B's 26 layers of five local and
one global, a window of 512, random weights at a small width: `GEMMA3_SHAPE`), scanned over its
groups of six (`jaxengine.models.layer_scan.scan_layer_groups`, the last two layers unrolled).
``--model qwen3_5``: a Qwen3.5 hybrid of Qwen3.5 0.8B's layout (24 layers, three Gated DeltaNet
layers to one gated attention layer, random weights at a small width: `QWEN3_5_SHAPE`), scanned
over its groups of four with a stack per kind (`jaxengine.models.qwen3_5_scan`); each step runs
on a zero recurrent state pool of its own (the model's scratch pool).

Each row decodes one token per request over `--context` cached positions (a jitted
`jaxengine.models.llama.forward` plus the logits of the last tokens, the cache donated). The
compile column is `jit(...).lower(...).compile()` of that step, nothing cached on disk.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.gemma import Gemma
from jaxengine.models.gemma_config import FULL, SLIDING, GemmaConfig, GemmaRope
from jaxengine.models.gguf_loader import load_gguf
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.layer_scan import scanned_model
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.models.qwen3_5 import Qwen3_5
from jaxengine.models.qwen3_5_checkpoints import FULL as QWEN_FULL
from jaxengine.models.qwen3_5_checkpoints import LINEAR, Qwen3_5Config

BLOCK = 16

#: Gemma 3 1B's layer layout (26 layers, five local : one global, window 512, two rotary bases)
#: at a small width.
GEMMA3_SHAPE = GemmaConfig(
  vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=26,
  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
  layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(26)), sliding_window=512,
  rope_local=GemmaRope(theta=10000.0), rope_global=GemmaRope(theta=1e6), qk_norm=True,
  query_pre_attn_scalar=64, max_position_embeddings=32768,
)  # fmt: skip


#: Qwen3.5 0.8B's layer layout (24 layers, three linear : one full) at a small width.
QWEN3_5_SHAPE = Qwen3_5Config(
  vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=24,
  num_attention_heads=4, num_key_value_heads=1, head_dim=64,
  layer_types=tuple(QWEN_FULL if (i + 1) % 4 == 0 else LINEAR for i in range(24)),
  linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
  linear_num_value_heads=4, max_position_embeddings=32768,
)  # fmt: skip


def _step(graphdef, weights, token_ids, positions, kv_cache, metadata):
  model = nnx.merge(graphdef, weights)
  hidden, kv_cache = model(token_ids, positions, kv_cache, metadata)
  return model.compute_logits(hidden[0]), kv_cache


def _decode_inputs(model, rows: int, context: int):
  """A decode step of `rows` requests, each at position `context - 1` of its own pages."""
  width = -(-context // BLOCK)
  tables = 1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width)
  position = context - 1
  slots = tables[:, position // BLOCK] * BLOCK + position % BLOCK
  metadata = PagedAttentionMetadata(
    slot_mapping=jnp.asarray(slots),
    block_tables=jnp.asarray(tables),
    query_start_loc=jnp.arange(rows + 1, dtype=jnp.int32),
    seq_lens=jnp.full((rows,), context, jnp.int32),
    num_reqs=jnp.asarray(rows, jnp.int32),
  )
  cache = PagedKVCache.create(model.kv_cache_spec, XlaAttentionBackend(), 1 + rows * width, BLOCK)
  ids = jnp.asarray(np.arange(rows, dtype=np.int32)[None] % 100)
  return ids, jnp.full((1, rows), position, jnp.int32), cache, metadata


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--context", type=int, default=64)
  parser.add_argument("--model", choices=("smollm2", "gemma3", "qwen3_5"), default="smollm2")
  args = parser.parse_args()
  if args.model == "gemma3":
    unrolled = Gemma(GEMMA3_SHAPE, rngs=nnx.Rngs(0))
  elif args.model == "qwen3_5":
    unrolled = Qwen3_5(QWEN3_5_SHAPE, rngs=nnx.Rngs(0))
  else:
    unrolled, _ = load_gguf()
  models = {"unrolled": unrolled, "scan": scanned_model(unrolled, True)}
  print(f"{'layout':>9} {'rows':>5} {'compile s':>10} {'step ms':>8}")
  for rows in (1, 8, 32):
    for name, model in models.items():
      graphdef, weights = nnx.split(model)
      ids, positions, cache, metadata = _decode_inputs(model, rows, args.context)
      step = jax.jit(_step, static_argnums=0, donate_argnums=4)
      start = time.perf_counter()
      compiled = step.lower(graphdef, weights, ids, positions, cache, metadata).compile()
      compile_s = time.perf_counter() - start
      times = []
      for _ in range(args.repeats + 1):
        start = time.perf_counter()
        logits, cache = compiled(weights, ids, positions, cache, metadata)
        logits.block_until_ready()
        times.append(time.perf_counter() - start)
      print(f"{name:>9} {rows:>5} {compile_s:>10.2f} {1e3 * np.median(times[1:]):>8.2f}")


if __name__ == "__main__":
  main()
