"""Where a decode step's time goes: SmolLM2-135M at B = 1, 8 and 32 live rows (issue 15).

Each part of the engine's decode step is jitted on its own and timed on the same inputs, so the
parts add up to (about) the fused step; what XLA fuses across the parts is the difference.

  engine step   `LLMEngine.step()` with B running requests (synchronous): host bookkeeping + the
                ragged step's model and sampler
  forward + LM head   the model alone, without the sampler (one decode token per row over a
                scratch pool of pages in the engine's attention backend)
  dense         the seven projections of every layer (q, k, v, o, gate, up, down), nothing else
  LM head       `[B, E] x [E, V]` logits
  rest of forward   forward + LM head - dense - LM head: embedding, norms, rotary embedding,
                every layer's KV-cache write and paged attention over 71 positions
  sampler       `jaxengine.sample.sample` on `[B, V]` logits (the benchmark's chat-style mix)
  host          engine step - forward + LM head - sampler

The weight-reading floor: the machine's read bandwidth (a jitted sum over 1 GiB, measured in the
same run) against the bytes one step must read (every weight once, plus the live KV).

With ``--scaling``: the engine step at a fixed number of live rows (``--batch-sizes``) on engines
that differ only in ``max_num_reqs`` (the live rows or 64) and ``max_model_len`` (256 or 4096).

Usage:
  python benchmarks/profile_decode.py [--batch-sizes 1 8 32] [--repeats 20] [--scaling]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import interleaved_ms, median_ms

import jaxengine as je
from jaxengine.models import PagedAttentionMetadata, PagedKVCache
from jaxengine.models.layers import linear
from jaxengine.sample import sample

CHAT = dict(temperature=0.7, top_k=50, top_p=0.9, ignore_eos=True)
ATTENTION_LEN = 128


def read_bandwidth_gbs(repeats: int) -> float:
  """GB/s of a jitted float32 sum over 1 GiB (a read-only stream through memory)."""
  data = jnp.ones((256, 1024, 1024), jnp.float32)
  total = jax.jit(jnp.sum)
  seconds = median_ms(lambda: total(data), max(3, repeats // 4)) / 1e3
  return data.nbytes / seconds / 1e9


def _dense(model, x):
  """The seven projections of every layer on `[B, 1, E]`, chained so none is dead code."""
  cfg = model.config
  e, h, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  for layer in model.layers:
    attn, mlp = layer.attn, layer.mlp
    q = linear(x, attn.wq[...].reshape(h * d, e))
    k = linear(x, attn.wk[...].reshape(kv * d, e))
    v = linear(x, attn.wv[...].reshape(kv * d, e))
    x = x + linear(q, attn.wo[...].reshape(e, h * d)) + (k.sum() + v.sum()) * 1e-9
    x = x + linear(
      jax.nn.silu(linear(x, mlp.w_gate[...])) * linear(x, mlp.w_up[...]), mlp.w_down[...]
    )
  return x


def _forward(graphdef, weights, kv_cache, token_ids, positions, metadata):
  """The decoder and the LM head on `[1, B]` tokens (the decode step without the sampler)."""
  model = nnx.merge(graphdef, weights)
  hidden, kv_cache = model(token_ids, positions, kv_cache, metadata)
  return model.compute_logits(hidden[0]), kv_cache


def _decode_metadata(batch: int, position: int, block_size: int) -> PagedAttentionMetadata:
  """One decode token per row at `position`, row `r` in pages `1 + r * P ...` of its own."""
  pages = -(-ATTENTION_LEN // block_size)
  tables = 1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
  slots = tables[:, position // block_size] * block_size + position % block_size
  return PagedAttentionMetadata(
    slot_mapping=jnp.asarray(slots),
    block_tables=jnp.asarray(tables),
    query_start_loc=jnp.arange(batch + 1, dtype=jnp.int32),
    seq_lens=jnp.full((batch,), position + 1, jnp.int32),
    num_reqs=jnp.asarray(batch, jnp.int32),
  )


@dataclasses.dataclass
class Breakdown:
  batch: int
  parts_ms: dict[str, float]


def profile(llm: je.LLM, batch: int, repeats: int) -> Breakdown:
  engine = llm.llm_engine
  runner = engine.runner
  model = runner.model
  cfg = model.config
  prompt = list(range(100, 164))
  params = je.SamplingParams(max_tokens=repeats + 8, **CHAT)  # ends soon after the timing
  for _ in range(batch):
    engine.add_request(None, prompt, params)
  for _ in range(3):  # prefill, then decode steps (compiled for this bucket)
    engine.step()

  input_batch = runner.input_batch
  metadata = input_batch.sampling_metadata
  state = jax.tree.map(jnp.copy, input_batch.state)
  backend, block_size = runner.kv_cache.backend, runner.kv_cache.block_size
  num_blocks = 1 + batch * -(-ATTENTION_LEN // block_size)
  caches = [PagedKVCache.create(model.kv_cache_spec, backend, num_blocks, block_size)]
  graphdef, weights = nnx.graphdef(runner.model), runner.weights

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((batch, 1, cfg.hidden_size), np.float32))
  dense = jax.jit(lambda w, x: _dense(nnx.merge(graphdef, w), x))
  forward = jax.jit(functools.partial(_forward, graphdef), donate_argnames=("kv_cache",))
  token_ids = jnp.full((1, batch), 100, jnp.int32)
  positions = jnp.full((1, batch), 70, jnp.int32)
  step_metadata = _decode_metadata(batch, 70, block_size)

  def model_forward():
    logits, caches[0] = forward(weights, caches[0], token_ids, positions, step_metadata)
    return logits

  head = jax.jit(lambda w, h: nnx.merge(graphdef, w).compute_logits(h))
  logits = jnp.asarray(rng.standard_normal((batch, cfg.vocab_size), np.float32))
  rows_state = state.leading_rows(batch)
  rows_metadata = metadata.leading_rows(batch)
  sampler = jax.jit(sample)
  parts = interleaved_ms(
    {
      "engine step": lambda: engine.step() or 0,
      "forward + LM head": model_forward,
      "dense": lambda: dense(weights, x),
      "LM head": lambda: head(weights, x[:, 0]),
      "sampler": lambda: sampler(rows_state, rows_metadata, logits)[1],
    },
    repeats,
  )
  parts["rest of forward"] = parts["forward + LM head"] - parts["dense"] - parts["LM head"]
  parts["host"] = parts["engine step"] - parts["forward + LM head"] - parts["sampler"]
  while engine.has_unfinished_requests():
    engine.step()
  return Breakdown(batch=batch, parts_ms=parts)


SCALING_SHAPES = ((None, 256), (None, 4096), (64, 256))  # (max_num_reqs, max_model_len)


def scaling(live_rows: int, repeats: int) -> dict[tuple[int, int], float]:
  """Median engine-step ms with `live_rows` running requests, one engine per shape.

  The live work is fixed (`live_rows` rows, 100-token prompts, about 110 attended positions); the
  engines differ only in `max_num_reqs` (``None``: `live_rows`) and `max_model_len`. One step of
  each engine per round, so load changes hit every shape alike (issue 15: a step must cost what
  its live rows need, not what the engine could hold).
  """
  engines = {}
  for max_num_reqs, max_model_len in SCALING_SHAPES:
    shape = (max_num_reqs or live_rows, max_model_len)
    llm = je.LLM(  # synchronous steps: each `step()` waits for its own tokens
      max_num_reqs=shape[0],
      max_model_len=max_model_len,
      compilation_cache=False,
      async_scheduling=False,
    )
    engine = llm.llm_engine
    params = je.SamplingParams(max_tokens=repeats + 8, **CHAT)
    for row in range(live_rows):
      engine.add_request(None, list(range(100 + row, 200 + row)), params)
    for _ in range(3):  # prefill, then two decode steps (compiled for this bucket)
      engine.step()
    engines[shape] = engine
  return interleaved_ms({shape: e.step for shape, e in engines.items()}, repeats, warmup=0)


def print_scaling(live_rows: int, repeats: int) -> None:
  """One table row per engine shape: step ms and the ratio to the smallest engine."""
  results = scaling(live_rows, repeats)
  base = results[(live_rows, 256)]
  print(f"| live rows | max_num_reqs | max_model_len | engine step ms | vs ({live_rows}, 256) |")
  print("|---:|---:|---:|---:|---:|")
  for (max_num_reqs, max_model_len), ms in results.items():
    print(f"| {live_rows} | {max_num_reqs} | {max_model_len} | {ms:.1f} | {ms / base:.2f}x |")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument(
    "--scaling", action="store_true", help="step time at fixed live rows across engine shapes"
  )
  args = parser.parse_args(argv)
  if args.scaling:
    for live_rows in args.batch_sizes:
      print_scaling(live_rows, args.repeats)
    return
  bandwidth = read_bandwidth_gbs(args.repeats)
  llm = je.LLM(max_num_reqs=32, compilation_cache=False, async_scheduling=False)
  weights_bytes = sum(a.nbytes for a in jax.tree.leaves(llm.llm_engine.runner.weights))
  floor_ms = weights_bytes / (bandwidth * 1e9) * 1e3
  print(f"{jax.devices()[0].device_kind}, {jax.__version__}")
  print(
    f"read bandwidth {bandwidth:.1f} GB/s; weights {weights_bytes / 1e6:.0f} MB -> "
    f"weight-reading floor {floor_ms:.1f} ms/step ({1e3 / floor_ms:.1f} steps/s)"
  )
  results = [profile(llm, batch, args.repeats) for batch in args.batch_sizes]
  names = list(results[0].parts_ms)
  print("| part | " + " | ".join(f"B={r.batch} ms (share)" for r in results) + " |")
  print("|---|" + "---:|" * len(results))
  for name in names:
    cells = []
    for r in results:
      ms = r.parts_ms[name]
      cells.append(f"{ms:.1f} ({ms / r.parts_ms['engine step']:.0%})")
    print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main()
