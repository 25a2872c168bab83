"""Bytes the sampler moves between devices on vocabulary-sharded logits, from the compiled HLO.

Compiles `jaxengine.sample.sample` on ``[R, V]`` logits sharded over the vocabulary
(``P(None, "model")``, as the LM head leaves them with tensor parallelism) on `t` CPU host
devices, twice: gathering the logits first (an all-gather, then the one-device sampler, as every
JAX engine does), and with
``mesh=`` (the vocabulary-sharded sampler, `jaxengine.sample.sharded`). For each it sums, over
every collective in the executable (all-gather, all-reduce, all-to-all, reduce-scatter,
collective-permute), the bytes of its operands and of its result per device. Every branch of the
sampler's `lax.cond`s is counted, so the sums bound what one step moves from above (a greedy
step runs only the greedy branch). Also prints the largest single collective of each.

Usage:
  python benchmarks/bench_sharded_sampler.py            # R = 256, V = 49152, t = 4
  python benchmarks/bench_sharded_sampler.py --rows 64 --vocab 128256 --tensor-parallel 2
"""

from __future__ import annotations

import argparse
import os
import re
import sys

_KINDS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "f64": 8}
_BYTES |= {"s64": 8, "u64": 8}


def _nbytes(text: str) -> int:
  """Bytes of every array shape written in `text` (a result type or an operand list)."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    size = 1
    for d in filter(None, dims.split(",")):
      size *= int(d)
    total += size * _BYTES.get(dtype, 4)
  return total


def _group_size(line: str) -> int:
  """Devices in each replica group of a collective's HLO line (1 when not written)."""
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota.group(2))
  listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  return len(listed.group(1).split(",")) if listed else 1


def collective_bytes(hlo: str) -> dict[str, int]:
  """``{"operand", "result", "largest", "count"}`` bytes per device over the collectives of
  compiled HLO text (an all-gather's operand is its result over the group size, a
  reduce-scatter's its result times it; the others' operands are as large as their results)."""
  out = dict(operand=0, result=0, largest=0, count=0)
  for line in hlo.splitlines():
    match = re.search(r"=\s*(.*?)\s+(" + "|".join(_KINDS) + r")(-start)?\(", line)
    if not match:
      continue
    result, kind = _nbytes(match.group(1)), match.group(2)
    group = _group_size(line)
    scale = {"all-gather": 1 / group, "reduce-scatter": group}.get(kind, 1)
    out["operand"] += int(result * scale)
    out["result"] += result
    out["largest"] = max(out["largest"], result)
    out["count"] += 1
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=49152)
  parser.add_argument("--tensor-parallel", type=int, default=4)
  args = parser.parse_args()
  t = args.tensor_parallel
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={t}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxengine as je
  from jaxengine import parallel
  from jaxengine.sample import sample, sharded

  rows, vocab = args.rows, args.vocab
  mesh = parallel.make_mesh(t, 1)
  batch = je.InputBatch(rows, 64, vocab, 20, "raw_logprobs")
  logits = jax.device_put(
    np.zeros((rows, vocab), np.float32), NamedSharding(mesh, P(None, parallel.MODEL))
  )
  state, metadata = jax.device_put((batch.state, batch.sampling_metadata), NamedSharding(mesh, P()))
  found = {}

  def gather(s, m, x):  # each device gathers the logits, then samples the whole rows
    with sharded.across_devices():
      return sample(s, m, jax.lax.all_gather(x, parallel.MODEL, axis=1, tiled=True))

  def gathered_step(s, m, x):
    specs = (P(), P(), P(None, parallel.MODEL))
    return jax.shard_map(gather, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(s, m, x)

  sharded_step = lambda s, m, x: sample(s, m, x, mesh=mesh)
  for name, fn in (("gathered", gathered_step), ("vocabulary-sharded", sharded_step)):
    step = jax.jit(fn)
    hlo = step.lower(state, metadata, logits).compile().as_text()
    found[name] = collective_bytes(hlo)
  print(f"R = {rows}, V = {vocab}, t = {t}; logits {rows * vocab * 4 / 2**20:.1f} MiB float32")
  print(
    f"{'sampler':<20} {'collectives':>11} {'operand MiB':>12} {'result MiB':>11} {'largest MiB':>12}"
  )
  for name, b in found.items():
    mib = lambda n: f"{n / 2**20:.3f}"
    print(
      f"{name:<20} {b['count']:>11} {mib(b['operand']):>12} {mib(b['result']):>11} "
      f"{mib(b['largest']):>12}"
    )
  gathered, shard = found["gathered"], found["vocabulary-sharded"]
  print(
    f"ratio (gathered / sharded): operand {gathered['operand'] / shard['operand']:.1f}x, "
    f"result {gathered['result'] / shard['result']:.1f}x"
  )
  sys.stdout.flush()


if __name__ == "__main__":
  main()
