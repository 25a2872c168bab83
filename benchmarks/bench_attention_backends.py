"""One layer of paged attention per backend: the Pallas kernels that ship with JAX against the XLA path.

  python benchmarks/bench_attention_backends.py              # the platform's backends, full sizes
  python benchmarks/bench_attention_backends.py --small      # tiny shapes: a check that it runs

Each row is one step shape at Qwen2.5-0.5B's head shapes (14 query heads over 2 key/value heads of
width 64; pages of 16 positions): `R` requests decoding one token each over a context of `S`
positions, and a mixed step (decodes beside a prefill chunk). Times are medians in ms of one
jitted call (the step's key/value write, then the attention), interleaved over the backends.
Backends: `xla` everywhere; on a GPU `pallas_gpu` (JAX's Pallas paged decode kernel; XLA for a
step with a prefill chunk); on a TPU `pallas_tpu` (JAX's ragged paged attention kernel). On a CPU
`--small` also runs `pallas_gpu` in Pallas interpret mode, only to check the script (its times
mean nothing). Every backend's output is compared with `xla`'s (max abs difference printed).
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from timing import interleaved_ms

from jaxengine.models.attention_backends import (
  AttentionBackend,
  PallasGpuAttentionBackend,
  attention_backend,
)
from jaxengine.models.paged_attention import PagedAttentionMetadata

H, K, D, B = 14, 2, 64, 16
SCALE = D**-0.5


def _backends(small: bool) -> dict[str, AttentionBackend]:
  backends = {"xla": attention_backend("xla")}
  kind = jax.default_backend()
  if kind == "tpu":
    backends["pallas_tpu"] = attention_backend("pallas_tpu")
  elif kind in ("gpu", "cuda", "rocm"):
    backends["pallas_gpu"] = attention_backend("pallas_gpu")
  elif small:
    backends["pallas_gpu (interpret)"] = PallasGpuAttentionBackend(interpret=True)
  return backends


def _cases(small: bool):
  """`(name, [(num_computed_tokens, num_new_tokens)] per request, context bucket S)`."""
  if small:
    yield "decode R=2 S=64", [(63, 1)] * 2, 64
    yield "mixed 1 decode + chunk 8", [(63, 1), (0, 8)], 64
    return
  for num_reqs in (8, 32, 256):
    for context in (1024, 4096):
      yield f"decode R={num_reqs} S={context}", [(context - 1, 1)] * num_reqs, context
  yield "mixed 31 decodes + chunk 512", [(1023, 1)] * 31 + [(0, 512)], 1024


def _step(backend: AttentionBackend, requests, context: int, dtype):
  """Queries, new keys and values, pages and metadata for one step of `requests`."""
  rng = np.random.default_rng(0)
  num_reqs, width = len(requests), context // B
  num_blocks = 1 + num_reqs * width
  tables = 1 + rng.permutation(num_reqs * width).reshape(num_reqs, width).astype(np.int32)
  query_lens = np.array([n for _, n in requests], np.int32)
  num_tokens = int(query_lens.sum())
  slots = np.concatenate(
    [
      tables[i, (c + np.arange(n)) // B] * B + (c + np.arange(n)) % B
      for i, (c, n) in enumerate(requests)
    ]
  ).astype(np.int32)
  md = PagedAttentionMetadata(
    slot_mapping=jnp.asarray(slots),
    block_tables=jnp.asarray(tables),
    query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
    seq_lens=jnp.asarray([c + n for c, n in requests], jnp.int32),
    num_reqs=jnp.asarray(num_reqs, jnp.int32),
  )
  q, k, v = (jnp.asarray(rng.standard_normal((num_tokens, heads, D)), dtype) for heads in (H, K, K))
  # The same keys and values in every backend's layout: all of them written through write_kv.
  every_key, every_value = (
    jnp.asarray(rng.standard_normal((num_blocks * B, K, D)), dtype) for _ in range(2)
  )
  pages = backend.init_pages(num_blocks, B, K, D, dtype)
  pages = backend.write_kv(pages, every_key, every_value, jnp.arange(num_blocks * B))
  return q, k, v, pages, md


@functools.partial(jax.jit, static_argnames=("backend",))
def _write_and_attend(backend: AttentionBackend, q, k, v, pages, md):
  pages = backend.write_kv(pages, k, v, md.slot_mapping)
  return backend.attention(q, pages, md, scale=SCALE, num_kv_heads=K)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--small", action="store_true", help="tiny shapes: check the script runs")
  parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  backends = _backends(args.small)
  print(
    f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, "
    f"{jax.default_backend()} ({jax.devices()[0].device_kind}), {time.strftime('%Y-%m-%d %H:%M')}"
  )
  print(f"\n## one layer of paged attention, {args.dtype}, median ms (max |diff| to xla)\n")
  print("| step | " + " | ".join(backends) + " |")
  print("|---|" + "---:|" * len(backends))
  for name, requests, context in _cases(args.small):
    calls, outputs = {}, {}
    for label, backend in backends.items():
      inputs = _step(backend, requests, context, dtype)
      calls[label] = functools.partial(_write_and_attend, backend, *inputs)
      outputs[label] = np.asarray(calls[label](), np.float32)
    times = interleaved_ms(calls, args.repeats)
    cells = [
      f"{times[label]:.3f}"
      + ("" if label == "xla" else f" ({np.abs(outputs[label] - outputs['xla']).max():.1e})")
      for label in backends
    ]
    print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
  main()
