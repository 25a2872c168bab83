"""Quantized mixture-of-experts matrices: one grouped product, float against int8 / float8 values.

  python benchmarks/bench_moe_quant.py [--repeats 20] [--width 512]

8 experts of ``width -> width`` (``[X, out, in]``), ``M`` sorted rows spread evenly over them,
float32 activations; each variant is one jitted `jaxengine.models.moe.grouped_linear` with the
weights passed as arguments, medians in ms, the variants interleaved (`timing.interleaved_ms`):

- ``float32``: float32 weights;
- ``int8`` / ``fp8``: the values cast to float32 inside the product's input, the ``[M, out]``
  result multiplied by each row's expert's scales (``scale=``, the engine's form);
- ``int8 folded``: the scales folded into the cast weights before the product (``s * q``, a
  dequantized ``[X, out, in]`` copy per call), the other exact form.

``--ragged`` times JAX's `ragged_dot_general` lowering (`jaxengine.models.moe._ragged`, what GPU
and TPU run) instead of the CPU form (`_every_group_then_pick`).

Measured on the shared 2-core CPU (jax 0.10.2, width 512, 20 repeats), ms at 2 / 16 / 64 / 256
rows: see `jaxengine.models.moe`'s docstring, where the numbers are kept.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from timing import interleaved_ms

from jaxengine.models import moe
from jaxengine.models.quantization import quantize_rows

EXPERTS = 8


@functools.partial(jax.jit, static_argnames="folded")
def _product(x, w, group_sizes, scale=None, folded=False):
  if folded:  # the other exact form: dequantize, then a float product
    return moe.grouped_linear(x, w.astype(x.dtype) * scale[:, None, :], group_sizes)
  return moe.grouped_linear(x, w, group_sizes, scale=scale)


def _variants(rows: int, width: int) -> dict:
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)
  w = jnp.asarray(
    rng.standard_normal((EXPERTS, width, width)) * width**-0.5, jnp.float32
  )  # [X, in, out]
  sizes = np.full(EXPERTS, rows // EXPERTS, np.int32)
  sizes[: rows % EXPERTS] += 1
  group_sizes = jnp.asarray(sizes)
  int8 = quantize_rows(w, quantization="int8", in_axes=(1,))
  fp8 = quantize_rows(w, quantization="fp8", in_axes=(1,))
  return {
    "float32": lambda: _product(x, w, group_sizes),
    "int8": lambda: _product(x, int8.values, group_sizes, int8.scale),
    "fp8": lambda: _product(x, fp8.values, group_sizes, fp8.scale),
    "int8 folded": lambda: _product(x, int8.values, group_sizes, int8.scale, folded=True),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--ragged", action="store_true", help="time the ragged_dot lowering")
  args = parser.parse_args()
  if args.ragged:
    moe._every_group_then_pick = moe._ragged  # the product grouped_linear picks on CPU
  print(f"ms per product; {EXPERTS} experts of {args.width} -> {args.width}; ragged={args.ragged}")
  names = list(_variants(8, 8))
  print(f"{'rows':<6}" + "".join(f"{name:>14}" for name in names))
  for rows in (2, 16, 64, 256):
    times = interleaved_ms(_variants(rows, args.width), args.repeats, warmup=2)
    print(f"{rows:<6}" + "".join(f"{times[name]:>14.2f}" for name in names))


if __name__ == "__main__":
  main()
