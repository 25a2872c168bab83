"""A mixture-of-experts decode step against dense models of the same active and total width.

  python benchmarks/bench_moe.py [--repeats 10] [--layers 2] [--hidden 512]

Three models with the same attention (``E`` wide, 8 query heads over 4 key/value heads of 64)
and ``--layers`` layers, differing in their feed-forward block:

- ``moe``: `jaxengine.models.moe.SparseMoeBlock`, 8 experts of width ``F = E``, top 2;
- ``dense-active``: a SwiGLU MLP of width ``2 F``, the FLOPs and weights a token actually uses;
- ``dense-total``: a SwiGLU MLP of width ``8 F``, every expert's weights (what XLA:CPU computes
  for the MoE block: its `ragged_dot` lowering is a masked dense product with every expert).

Each row is one jitted decode step (`jaxengine.models.llama.forward`, hidden states only, the
paged cache donated: pages of 16 positions, XLA backend) of ``B`` rows at context 128, or one
prefill of 128 tokens; medians in ms, the three models interleaved. (The table below was
measured over the slot cache the model also took then; steps over pages are comparable.)

Measured on the shared 2-core CPU (float32, jax 0.10.2, --layers 2 --hidden 512, 10 repeats,
load average about 1.4; the MoE block in its CPU form, `jaxengine.models.moe`):

  =================  =====  ============  ===========
  step (ms)          moe    dense-active  dense-total
  =================  =====  ============  ===========
  decode B=1          3.50          1.38         2.20
  decode B=8          5.45          2.72         4.82
  decode B=32        11.13          6.25         9.33
  prefill B=1 T=128  45.90         11.12        27.74
  =================  =====  ============  ===========

On CPU a MoE step costs about a dense step as wide as all experts (every expert multiplies
every sorted row, ``k`` rows per token, so prefill pays ``k``-fold); before the CPU form, through
JAX's ragged-dot lowering, it was 32.1 / 40.4 / 56.8 / 84.4 ms. Accelerators run
`ragged_dot_general` as a grouped-matmul kernel (not measured here).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from timing import interleaved_ms

from jaxengine.models.attention_backends import XlaAttentionBackend
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.llama import Llama, forward
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.testing import tiny_llama_config

CONTEXT = 128
EXPERTS, TOP_K = 8, 2
BLOCK = 16


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _step(graphdef, weights, ids, positions, cache, md):
  return forward(graphdef, weights, ids, positions, cache, md)


def _models(layers: int, hidden: int) -> dict[str, Llama]:
  common = dict(
    vocab_size=256,
    hidden_size=hidden,
    num_hidden_layers=layers,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=CONTEXT,
  )
  configs = {
    "moe": tiny_llama_config(
      **common,
      intermediate_size=hidden,
      num_experts=EXPERTS,
      num_experts_per_tok=TOP_K,
      moe_intermediate_size=hidden,
      moe_layers=tuple(range(layers)),
    ),
    "dense-active": tiny_llama_config(**common, intermediate_size=TOP_K * hidden),
    "dense-total": tiny_llama_config(**common, intermediate_size=EXPERTS * hidden),
  }
  return {name: Llama(c, rngs=nnx.Rngs(0)) for name, c in configs.items()}


def _step_fn(model: Llama, num_rows: int, num_new: int):
  graphdef, weights = nnx.split(model)
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, 256, (1, num_rows * num_new)), jnp.int32)  # flat
  start = CONTEXT - num_new
  position = np.arange(start, CONTEXT, dtype=np.int32)
  positions = jnp.asarray(np.tile(position, num_rows))[None]
  width = CONTEXT // BLOCK
  tables = 1 + np.arange(num_rows * width, dtype=np.int32).reshape(num_rows, width)
  slots = tables[:, position // BLOCK] * BLOCK + position % BLOCK  # [B, T]
  md = PagedAttentionMetadata(
    slot_mapping=jnp.asarray(slots.reshape(-1)),
    block_tables=jnp.asarray(tables),
    query_start_loc=jnp.arange(0, num_rows * num_new + 1, num_new, dtype=jnp.int32),
    seq_lens=jnp.full(num_rows, CONTEXT, jnp.int32),
    num_reqs=jnp.asarray(num_rows, jnp.int32),
  )
  num_blocks = 1 + num_rows * width
  cache = PagedKVCache.create(model.kv_cache_spec, XlaAttentionBackend(), num_blocks, BLOCK)
  state = {"cache": cache}

  def step():
    hidden, state["cache"] = _step(graphdef, weights, ids, positions, state["cache"], md)
    return hidden

  return step


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--hidden", type=int, default=512)
  args = parser.parse_args()
  models = _models(args.layers, args.hidden)
  print(
    f"ms per step; {args.layers} layers, E={args.hidden}, {EXPERTS} experts of F={args.hidden}, "
    f"top {TOP_K}; {jax.default_backend()}"
  )
  print(f"{'step':<22}" + "".join(f"{name:>14}" for name in models))
  rows = [("decode B=1", 1, 1), ("decode B=8", 8, 1), ("decode B=32", 32, 1)]
  rows.append(("prefill B=1 T=128", 1, CONTEXT))
  for label, num_rows, num_new in rows:
    fns = {name: _step_fn(model, num_rows, num_new) for name, model in models.items()}
    times = interleaved_ms(fns, args.repeats, warmup=2)
    print(f"{label:<22}" + "".join(f"{times[name]:>14.2f}" for name in models))


if __name__ == "__main__":
  main()
