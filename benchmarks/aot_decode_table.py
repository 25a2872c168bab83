"""Decode estimates on paper for a Cloud TPU topology (`jaxengine.aot`), no TPU needed.

Compiles only what the decode estimates read (the ragged step at the decode buckets of batch
1 / 64 / 256, capped by the KV tokens that fit, and the sampler at those row buckets) with
`max_num_reqs` 256 and `max_model_len` 4096, and prints the report as one JSON line:

  python benchmarks/aot_decode_table.py benchmarks/model_configs/Llama-3.1-8B v6e:1x1
  python benchmarks/aot_decode_table.py benchmarks/model_configs/Qwen3-30B-A3B v6e:2x2 --tp 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxengine.aot import compile as aot_compile
from jaxengine.aot import compile_for_topology
from jaxengine.aot.report import DECODE_BATCHES, DECODE_CONTEXT
from jaxengine.worker.buckets import bucket, buckets


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("model_dir")
  parser.add_argument("topology")
  parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
  parser.add_argument("--kv-cache-dtype", default="auto")
  parser.add_argument("--top-ops", type=int, default=5,
                      help="instructions per executable named in the report (HBM bytes)")  # fmt: skip
  args = parser.parse_args()
  aot_compile.TOP_OPS = args.top_ops
  options = dict(tensor_parallel_size=args.tp, max_num_reqs=256, max_model_len=4096,
                 kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
  plan = compile_for_topology(args.model_dir, args.topology, select=lambda e: False, **options)
  fit = plan["kv_cache"]["max_tokens"] // DECODE_CONTEXT
  rows = {bucket(min(b, fit), buckets(256, 1)) for b in DECODE_BATCHES if min(b, fit) >= 1}

  def select(executable) -> bool:
    if executable.name == "sample":
      return executable.shape in {f"rows={r}" for r in rows}
    return executable.name == "ragged_step" and executable.shape in {
      f"tokens={r} rows={r}" for r in rows
    }

  start = time.perf_counter()
  report = compile_for_topology(
    args.model_dir,
    args.topology,
    select=select,
    progress=lambda entry: print("compiled", entry, file=sys.stderr, flush=True),
    **options,
  )
  report["wall_s"] = time.perf_counter() - start
  print(json.dumps(report))


if __name__ == "__main__":
  main()
