"""One layer of ragged paged attention on this machine: `query_tile` choices of the XLA path
against the slot cache's dense attention, at SmolLM2-135M's head shapes.

  python benchmarks/bench_paged_attention.py [--repeats 10]

Each row is one step shape: `R` requests, `T` query tokens, every request's context `S` (the
block-table bucket). Times are medians in ms of one jitted call (write not included).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from timing import interleaved_ms

from jaxengine.models.paged_attention import PagedAttentionMetadata, ragged_paged_attention_xla

H, K, D, B = 9, 3, 64, 16
SCALE = D**-0.5


def _step(requests: list[tuple[int, int]], num_tokens: int, context: int):
  """Metadata, queries and pages for `(num_computed_tokens, num_new_tokens)` requests."""
  rng = np.random.default_rng(0)
  num_reqs, width = len(requests), context // B
  num_blocks = 1 + num_reqs * width
  tables = 1 + rng.permutation(num_reqs * width).reshape(num_reqs, width).astype(np.int32)
  query_lens = np.array([n for _, n in requests], np.int32)
  md = PagedAttentionMetadata(
    slot_mapping=jnp.zeros(num_tokens, jnp.int32),
    block_tables=jnp.asarray(tables),
    query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
    seq_lens=jnp.asarray([c + n for c, n in requests], jnp.int32),
    num_reqs=jnp.asarray(num_reqs, jnp.int32),
  )
  q = jnp.asarray(rng.standard_normal((num_tokens, H, D)), jnp.float32)
  pages = jnp.asarray(rng.standard_normal((num_blocks, B, K, D)), jnp.float32)
  return q, pages, md


@functools.partial(jax.jit, static_argnames=("query_tile", "pages_per_chunk"))
def _paged(q, pages, md, query_tile, pages_per_chunk):
  return ragged_paged_attention_xla(
    q, pages, pages, md, scale=SCALE, query_tile=query_tile, pages_per_chunk=pages_per_chunk
  )


@jax.jit
def _slot_decode(q, cache, lengths):
  """The slot cache's decode attention: `[R, S, K, D]` rows, no gather."""
  num_reqs, context = cache.shape[:2]
  qg = q.reshape(num_reqs, K, H // K, D)
  scores = jnp.einsum("rkgd,rskd->rkgs", qg, cache) * SCALE
  mask = jnp.arange(context) < lengths[:, None, None, None]
  probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
  return jnp.einsum("rkgs,rskd->rkgd", probs, cache).reshape(num_reqs, H, D)


def _cases():
  for num_reqs in (8, 32):
    for context in (64, 256, 1024):
      yield f"decode R={num_reqs}", [(context - 1, 1)] * num_reqs, num_reqs, context
  mixed = [(511, 1)] * 7 + [(256, 248)]
  yield "mixed 7 decodes + chunk 248", mixed, 256, 512
  yield "prefill chunk 512", [(0, 512)], 512, 512
  yield "prefill 4 x 128", [(0, 128)] * 4, 512, 128


CONFIGS = [(1, 2), (1, 4), (1, 8), (16, 4), (64, 4), (64, 8)]  # (query_tile, pages_per_chunk)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  names = [f"t{tile}/c{chunk}" for tile, chunk in CONFIGS] + ["slot"]
  print(f"{'step':28s} {'T':>4s} {'S':>5s} " + " ".join(f"{c:>8s}" for c in names))
  for name, requests, num_tokens, context in _cases():
    q, pages, md = _step(requests, num_tokens, context)
    fns = {
      f"t{tile}/c{chunk}": functools.partial(_paged, q, pages, md, tile, chunk)
      for tile, chunk in CONFIGS
      if tile > 1 or num_tokens <= 64  # per-token items over long prefills: far slower
    }
    if num_tokens == len(requests):
      cache = pages[md.block_tables].reshape(len(requests), context, K, D)
      fns["slot"] = functools.partial(_slot_decode, q, cache, md.seq_lens)
    times = interleaved_ms(fns, args.repeats)
    cells = [f"{times[key]:8.2f}" if key in times else f"{'-':>8s}" for key in names]
    print(f"{name:28s} {num_tokens:4d} {context:5d} " + " ".join(cells), flush=True)


if __name__ == "__main__":
  main()
