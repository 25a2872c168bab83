"""The weight sync of `JaxEngineRollout` (Tunix's `update_params` after each training step).

One rollout on a random Tunix Llama 3 of `examples/tunix_grpo.py`'s `--size`, synced with the
trainer's parameters in four ways: all at once or in chunks of `--chunk-mib` MiB of parameters
(`reshard_chunk_bytes`), with the KV cache kept or freed meanwhile
(`free_kv_cache_during_sync`). Prints the median seconds per sync (after one warm-up sync per
way, which compiles the per-layer conversion once), the compiles of the timed syncs, the bytes
of KV cache freed, the model's bytes, and whether each way's weights equal the all-at-once
sync's bit for bit. `--quantization int8` (or ``fp8``) builds the rollout with that
`quantization`: each sync then re-quantizes the trainer's float weights.

    python benchmarks/bench_tunix_sync.py --size smollm2 [--quantization int8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx
from tunix.rl.rollout import base_rollout

from examples.tunix_grpo import SIZES, ByteTokenizer, tiny_actor
from jaxengine.integrations.tunix import JaxEngineRollout
from jaxengine.models.weights import state_leaves
from jaxengine.testing import count_compiles
from jaxengine.worker import sleep_mode


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="smollm2")
  parser.add_argument("--chunk-mib", type=int, default=64)
  parser.add_argument("--max-num-reqs", type=int, default=64)
  parser.add_argument("--max-model-len", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--quantization", choices=["int8", "fp8"], default=None)
  args = parser.parse_args()
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  actor = tiny_actor(mesh, args.size)
  params = nnx.state(actor, nnx.Param)
  config = base_rollout.RolloutConfig(
    max_tokens_to_generate=16, max_prompt_length=16, kv_cache_size=args.max_model_len
  )
  start = time.perf_counter()
  rollout = JaxEngineRollout(
    rollout_actor=actor,
    tokenizer=ByteTokenizer(),
    mesh=mesh,
    rollout_config=config,
    max_num_reqs=args.max_num_reqs,
    quantization=args.quantization,
  )
  runner = rollout.llm.llm_engine.runner
  print(
    f"# {jax.devices()[0].device_kind}, --size {args.size}, quantization "
    f"{args.quantization}: model "
    f"{sleep_mode.device_bytes(runner.weights) / 2**20:.1f} MiB, KV cache "
    f"{sleep_mode.device_bytes(runner.kv_cache) / 2**20:.1f} MiB ({runner.num_blocks} pages; "
    f"gpu_memory_utilization {rollout.llm.config.gpu_memory_utilization:.3f} for the process "
    f"from RolloutConfig.rollout_vllm_hbm_utilization {config.rollout_vllm_hbm_utilization}), "
    f"built in {time.perf_counter() - start:.1f} s"
  )
  prompts = ["The cat", "A dog", "Once upon", "Hello"] * 4
  rollout.generate(prompts, config)
  weights = lambda: {p: np.asarray(x) for p, x in state_leaves(runner.weights).items()}
  want = None
  print("| sync | median s | compiles | KV cache freed MiB | equal |")
  print("|---|---:|---:|---:|---|")
  for chunk, free in ((None, False), (args.chunk_mib, False), (None, True), (args.chunk_mib, True)):
    rollout.reshard_chunk_bytes = chunk << 20 if chunk else None
    rollout.free_kv_cache_during_sync = free
    rollout.kv_cache_bytes_freed = 0
    rollout.update_params(params, (nnx.Param,))  # warm-up
    times = []
    with count_compiles() as compiles:
      for _ in range(args.repeats):
        start = time.perf_counter()
        rollout.update_params(params, (nnx.Param,))
        jax.block_until_ready((runner.weights, runner.kv_cache))
        times.append(time.perf_counter() - start)
    got = weights()
    want = want or got
    equal = all(np.array_equal(got[p], want[p]) for p in want)
    name = (f"chunks of {chunk} MiB" if chunk else "all at once") + (", KV freed" if free else "")
    print(
      f"| {name} | {statistics.median(times):.4f} | {compiles.count} | "
      f"{rollout.kv_cache_bytes_freed / 2**20:.1f} | {equal} |",
      flush=True,
    )
  rollout.generate(prompts, config)  # the engine still serves after the last way


if __name__ == "__main__":
  main()
