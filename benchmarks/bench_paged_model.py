"""A whole model step over pages, at two page sizes, through the same model code.

  python benchmarks/bench_paged_model.py [--model tiny|smollm2-layer] [--repeats 10]

`tiny` is `jaxengine.testing.tiny_llama`; `smollm2-layer` is one decoder layer of SmolLM2-135M's
shapes (E=576, H=9, K=3, D=64, F=1536) with a small vocabulary (logits are not timed). Each row
is one step: `R` requests at context `S`, `T` tokens each: `forward` over the flat `[1, R*T]`
tokens with the XLA backend, pages of `B=16` and of `B=64` positions (each request's pages a
random permutation). Medians in ms of one jitted, cache-donating call (hidden states only), the
two interleaved.

Measured earlier against the slot cache the seam also served then (removed since: the model has
one cache signature, pages), on the shared 2-core Xeon under a load average of about 7.5
(float32, 10 repeats, `B=16`):

  ==================  =====  =====  ==============  ======
  step                tiny          SmolLM2 layer
  ------------------  ------------  ----------------------
  (ms)                slot   paged  slot            paged
  ==================  =====  =====  ==============  ======
  decode R=8 S=256     3.01   1.53    9.26            8.11
  decode R=8 S=1024    2.70   3.68   21.87           17.52
  decode R=32 S=256    5.90   6.05   27.31           27.21
  prefill R=1 T=256   11.12  10.38   61.18           63.19
  prefill R=4 T=128    5.79   7.06  112.95          117.63
  ==================  =====  =====  ==============  ======
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
from jaxengine.models.llama import forward
from jaxengine.models.paged_attention import PagedAttentionMetadata
from jaxengine.testing import tiny_llama

BLOCK_SIZES = (16, 64)
SMOLLM2_LAYER = dict(
  hidden_size=576,
  intermediate_size=1536,
  num_hidden_layers=1,
  num_attention_heads=9,
  num_key_value_heads=3,
  head_dim=64,
  max_position_embeddings=2048,
)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _paged(graphdef, weights, ids, positions, cache, md):
  return forward(graphdef, weights, ids, positions, cache, md)


def _row(graphdef, weights, spec, num_reqs, num_new, context, repeats):
  """ms of one paged step per page size: `num_reqs` requests, `num_new` tokens each, whose
  context ends at `context`."""
  rng = np.random.default_rng(0)
  start = context - num_new
  pos = np.broadcast_to(np.arange(start, context, dtype=np.int32), (num_reqs, num_new))
  ids = rng.integers(0, 256, (num_reqs, num_new)).astype(np.int32)
  flat_ids, flat_pos = ids.reshape(1, -1), pos.reshape(1, -1)
  steps = {}
  for block in BLOCK_SIZES:
    width = -(-context // block)
    tables = (1 + rng.permutation(num_reqs * width).reshape(num_reqs, width)).astype(np.int32)
    slots = tables[:, pos[0] // block] * block + pos[0] % block  # [R, new]
    md = PagedAttentionMetadata(
      slot_mapping=jnp.asarray(slots.reshape(-1)),
      block_tables=jnp.asarray(tables),
      query_start_loc=jnp.arange(0, num_reqs * num_new + 1, num_new, dtype=jnp.int32),
      seq_lens=jnp.full(num_reqs, context, jnp.int32),
      num_reqs=jnp.asarray(num_reqs, jnp.int32),
    )
    cache = PagedKVCache.create(spec, XlaAttentionBackend(), 1 + num_reqs * width, block)
    state = {"cache": cache}

    def step(md=md, state=state):
      hidden, state["cache"] = _paged(graphdef, weights, flat_ids, flat_pos, state["cache"], md)
      return hidden

    steps[f"B={block}"] = step
  return interleaved_ms(steps, repeats, warmup=2)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--model", choices=["tiny", "smollm2-layer"], default="tiny")
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  overrides = SMOLLM2_LAYER if args.model == "smollm2-layer" else {}
  model = tiny_llama(**overrides, **({"max_position_embeddings": 2048} if not overrides else {}))[0]
  spec = model.kv_cache_spec
  graphdef, weights = nnx.split(model)
  names = [f"B={block}" for block in BLOCK_SIZES]
  print(f"{args.model}: ms per step over pages (XLA backend)")
  print(f"{'step':<24}" + "".join(f"{name:>8}" for name in names))
  rows = [
    ("decode R=8 S=256", 8, 1, 256),
    ("decode R=8 S=1024", 8, 1, 1024),
    ("decode R=32 S=256", 32, 1, 256),
    ("prefill R=1 T=256", 1, 256, 256),
    ("prefill R=4 T=128", 4, 128, 128),
  ]
  for name, num_reqs, num_new, context in rows:
    times = _row(graphdef, weights, spec, num_reqs, num_new, context, args.repeats)
    print(f"{name:<24}" + "".join(f"{times[n]:8.2f}" for n in names))


if __name__ == "__main__":
  main()
