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


_MIXES = ("greedy", "chat", "everything")


def _params(mix: str, i: int, vocab: int):
  """Row i's `SamplingParams` in `mix`: greedy; chat (temperature 0.7, top_k 50, top_p 0.9,
  seeded); everything (chat plus min_p, penalties, logit_bias and 5 logprobs, one row in 8
  greedy)."""
  import jaxengine as je

  if mix == "greedy" or (mix == "everything" and i % 8 == 0):
    return je.SamplingParams(temperature=0.0, logprobs=5 if mix == "everything" else None)
  kw = dict(temperature=0.7, top_k=50, top_p=0.9, seed=i)
  if mix == "everything":
    kw |= dict(min_p=0.05, presence_penalty=0.5, repetition_penalty=1.1, logprobs=5)
    kw |= dict(logit_bias={(7 * i) % vocab: 1.0})
  return je.SamplingParams(**kw)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=49152)
  parser.add_argument("--tensor-parallel", type=int, default=4)
  parser.add_argument("--mixes", nargs="+", default=list(_MIXES), choices=_MIXES)
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
  logits = jax.device_put(
    np.zeros((rows, vocab), np.float32), NamedSharding(mesh, P(None, parallel.MODEL))
  )

  def gathered(s, m, x):  # each device gathers the logits, then samples the whole rows
    def local(s, x):
      with sharded.across_devices():
        return sample(s, m, jax.lax.all_gather(x, parallel.MODEL, axis=1, tiled=True))

    specs = (P(), P(None, parallel.MODEL))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)(s, x)

  steps = {"gathered": gathered, "sharded": lambda s, m, x: sample(s, m, x, mesh=mesh)}
  print(f"R = {rows}, V = {vocab}, t = {t}; logits {rows * vocab * 4 / 2**20:.1f} MiB float32")
  print("bytes per device per step, summed over the collectives the mix's executable keeps")
  print(f"{'mix':<11} {'sampler':<9} {'collectives':>11} {'sent KiB':>10} {'received KiB':>13}")
  for mix in args.mixes:
    batch = je.InputBatch(rows, 64, vocab, 20, "raw_logprobs")
    for i in range(rows):
      batch.add_request(f"r{i}", [1, 2, 3], _params(mix, i, vocab))
    # The metadata as constants: XLA drops the `lax.cond` branches the mix never takes.
    metadata = jax.tree.map(np.asarray, batch.sampling_metadata)
    state = jax.device_put(batch.state, NamedSharding(mesh, P()))
    found = {}
    for name, fn in steps.items():
      step = jax.jit(lambda s, x, fn=fn: fn(s, metadata, x))
      hlo = step.lower(state, logits).compile().as_text()
      found[name] = collective_bytes(hlo)
      b = found[name]
      print(
        f"{mix:<11} {name:<9} {b['count']:>11} {b['operand'] / 1024:>10.1f} "
        f"{b['result'] / 1024:>13.1f}",
        flush=True,
      )
    ratio = found["gathered"]["result"] / max(found["sharded"]["result"], 1)
    print(f"{mix:<11} received gathered / sharded: {ratio:.0f}x", flush=True)


if __name__ == "__main__":
  main()
