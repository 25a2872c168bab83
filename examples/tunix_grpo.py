"""GRPO with Tunix where the rollout engine is jaxengine (`pip install -e ".[tunix]"`).

A tiny random Tunix Llama 3 and a byte tokenizer, on CPU in a few minutes: Tunix's `GRPOLearner`
trains it for a few steps with `JaxEngineRollout` as `ClusterConfig.rollout_engine`, and, with
`--compare`, the same run again with Tunix's own "vanilla" rollout, printing each run's rollout
time per training step (the first step includes compiling). With `--lora RANK` the actor is a
qwix LoRA model (every attention and MLP projection, alpha = 2 x rank), as Tunix's recipes train:
the rollout takes the base weights once and the adapter alone after every step.

    python examples/tunix_grpo.py --steps 4 --compare
    python examples/tunix_grpo.py --steps 4 --lora 8
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import pstats
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout, vanilla_rollout

from jaxengine.integrations.tunix import JaxEngineRollout
from jaxengine.testing import count_compiles


class ByteTokenizer:
  """Token id = byte + 3; pad 0, BOS 1, EOS 2 (what Tunix's TokenizerAdapter accepts)."""

  def encode(self, text, **kwargs):
    return [b + 3 for b in text.encode()]

  def decode(self, ids, **kwargs):
    return bytes(i - 3 for i in ids if 3 <= i < 259).decode(errors="replace")

  def bos_id(self):
    return 1

  def eos_id(self):
    return 2

  def pad_id(self):
    return 0


#: Tunix Llama 3 configs by `--size`: "tiny" (2 layers, ~60k parameters) and "smollm2", the
#: shape of SmolLM2-135M (30 layers, hidden 576, 9 query heads over 3 key/value heads of 64,
#: MLP 1536, vocabulary 49152, tied embeddings: 135M parameters), both with random weights.
SIZES = {
  "tiny": dict(
    num_layers=2, vocab_size=264, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
    num_kv_heads=2, rope_theta=500_000, norm_eps=1e-5, weight_tying=True,
  ),
  "smollm2": dict(
    num_layers=30, vocab_size=49152, embed_dim=576, hidden_dim=1536, num_heads=9, head_dim=64,
    num_kv_heads=3, rope_theta=100_000, norm_eps=1e-5, weight_tying=True,
  ),
}  # fmt: skip


def tiny_actor(mesh, size: str = "tiny") -> nnx.Module:
  """A Tunix Llama 3 of `SIZES[size]` with random weights (Tunix zero-initialises its MLPs)."""
  config = llama3.ModelConfig(**SIZES[size])
  with mesh:
    model = nnx.eval_shape(lambda: llama3.Llama3(config, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  # norms around 1; matrices N(0, 0.3) on the tiny model, N(0, 1 / fan-in)-ish on larger ones
  wide = 0.3 if size == "tiny" else 0.05
  scale = lambda leaf: (wide, 0.0) if leaf.ndim > 1 else (0.1, 1.0)
  nnx.update(
    model,
    jax.tree.unflatten(
      treedef,
      [
        jnp.asarray(scale(x)[1] + scale(x)[0] * rng.standard_normal(x.shape, np.float32))
        for x in leaves
      ],
    ),
  )
  return model


#: The projections a LoRA actor adapts (Tunix's Llama 3 module names).
LORA_MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"


def lora_actor(mesh, rank: int, size: str = "tiny") -> nnx.Module:
  """`tiny_actor` with qwix LoRA of `rank` and alpha ``2 * rank`` on every projection."""
  model = tiny_actor(mesh, size)
  provider = qwix.LoraProvider(module_path=LORA_MODULES, rank=rank, alpha=2.0 * rank)
  with mesh:
    return qwix.apply_lora_to_model(model, provider, **model.get_model_input(), rngs=nnx.Rngs(1))


def reward(prompts, completions, **kwargs):
  """Rewards completions with many vowels (anything that varies between samples trains)."""
  return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


class StepTimes(NamedTuple):
  """Seconds per training step of one run (index 0: the first step, which compiles)."""

  rollout: list[float]  # the rollout engine's `generate` calls of the step
  compiles: list[int]  # XLA compiles during those calls
  sync: list[float]  # the weight syncs after the step (`RLCluster.sync_weights`)
  step: list[float]  # from one step's first rollout to the next's (the last: to the end)


def run(
  rollout_engine, steps: int, lora_rank: int = 0, size: str = "tiny", profile: bool = False
) -> StepTimes:
  """Trains `steps` GRPO steps (a LoRA actor of `lora_rank` unless 0) on a model of `size`;
  returns the time of each step's rollouts, syncs and the whole step (seconds). With `profile`,
  prints where the rollouts' host time goes after the first step (cProfile, top functions)."""
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  role = rl_cluster_lib.Role
  cluster = rl_cluster_lib.RLCluster(
    actor=lora_actor(mesh, lora_rank, size) if lora_rank else tiny_actor(mesh, size),
    tokenizer=ByteTokenizer(),
    cluster_config=rl_cluster_lib.ClusterConfig(
      role_to_mesh={role.ACTOR: mesh, role.REFERENCE: mesh, role.ROLLOUT: mesh},
      rollout_engine=rollout_engine,
      rollout_config=base_rollout.RolloutConfig(
        max_tokens_to_generate=16, max_prompt_length=16, temperature=0.9, kv_cache_size=64
      ),
      training_config=rl_cluster_lib.RLTrainingConfig(
        actor_optimizer=optax.adam(1e-3), eval_every_n_steps=1000, max_steps=steps
      ),
    ),
  )
  rollout: list[tuple[float, float]] = []  # (start, seconds) of every generate call
  syncs: list[float] = []
  profiler = cProfile.Profile() if profile else None
  generate, sync_weights = cluster.rollout.generate, cluster.sync_weights

  compiles: list[int] = []

  def timed_generate(*args, **kwargs):
    on = profiler is not None and len(rollout) >= calls_per_step
    start = time.perf_counter()
    if on:
      profiler.enable()
    counter = count_compiles()
    try:
      with counter:
        return generate(*args, **kwargs)
    finally:
      if on:
        profiler.disable()
      rollout.append((start, time.perf_counter() - start))
      compiles.append(counter.count)

  def timed_sync(*args, **kwargs):
    start = time.perf_counter()
    try:
      return sync_weights(*args, **kwargs)
    finally:
      syncs.append(time.perf_counter() - start)

  cluster.rollout.generate = timed_generate
  cluster.sync_weights = timed_sync
  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    algo_config=grpo_learner.GRPOConfig(num_generations=4, num_iterations=1, beta=0.0),
    reward_fns=reward,
  )
  prompts = np.array(["The cat", "A dog", "Once upon", "Hello"])
  calls_per_step = 1  # Tunix's rollouts of one step: one call for this batch
  learner.train([{"prompts": prompts}] * steps)
  end = time.perf_counter()
  if profiler is not None:
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
  starts = [t for t, _ in rollout][::calls_per_step] + [end]
  spans = list(itertools.pairwise(starts))
  per_step = [sum(dt for t, dt in rollout if a <= t < b) for a, b in spans]
  step_compiles = [sum(c for (t, _), c in zip(rollout, compiles) if a <= t < b) for a, b in spans]
  return StepTimes(per_step, step_compiles, syncs, [b - a for a, b in spans])


def run_rollout_only(rollout_engine, steps: int, size: str = "tiny") -> StepTimes:
  """The rollout side of `run` without the trainer (a machine without memory for the trainer's
  optimizer state): each step generates the same 16 rollouts as a GRPO step, then syncs new
  weights (the actor's weights scaled by 1.001 and back, alternately) through `update_params`,
  as `RLCluster.sync_weights` does after a training step. Returns the rollout, compile, sync
  and whole-step times per step."""
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  actor = tiny_actor(mesh, size)
  tokenizer = ByteTokenizer()
  config = base_rollout.RolloutConfig(
    max_tokens_to_generate=16, max_prompt_length=16, temperature=0.9, kv_cache_size=64
  )
  if rollout_engine == "vanilla":
    cache = base_rollout.CacheConfig(
      cache_size=64,
      num_layers=actor.config.num_layers,
      num_kv_heads=actor.config.num_kv_heads,
      head_dim=actor.config.head_dim,
    )
    rollout = vanilla_rollout.VanillaRollout(actor, tokenizer, cache)
  else:
    rollout = rollout_engine(
      rollout_actor=actor, tokenizer=tokenizer, mesh=mesh, rollout_config=config
    )
  params = nnx.state(actor, nnx.Param)
  states = [params, jax.tree.map(lambda x: x * 1.001, params)]
  prompts = [p for p in ["The cat", "A dog", "Once upon", "Hello"] for _ in range(4)]
  times = StepTimes([], [], [], [])
  for step in range(steps):
    start = time.perf_counter()
    with count_compiles() as compiles:
      rollout.generate(prompts, config)
    middle = time.perf_counter()
    filter_types = None if rollout_engine == "vanilla" else (nnx.Param,)  # its arrays: no mesh
    rollout.update_params(states[(step + 1) % 2], filter_types)
    jax.block_until_ready(jax.tree.leaves(nnx.state(rollout.model())))
    end = time.perf_counter()
    times.rollout.append(middle - start)
    times.compiles.append(compiles.count)
    times.sync.append(end - middle)
    times.step.append(end - start)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the actor's shape")
  parser.add_argument("--max-num-reqs", type=int, default=16)
  parser.add_argument(
    "--num-decode-steps", type=int, default=None, help="decode steps per dispatch (default 16)"
  )
  parser.add_argument(
    "--reshard-chunk-mib", type=int, default=0, help="sync the weights in chunks of this many MiB"
  )
  parser.add_argument(
    "--free-kv-cache-during-sync", action="store_true", help="free the KV cache during syncs"
  )
  parser.add_argument("--compare", action="store_true", help="also run Tunix's vanilla rollout")
  parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="a qwix LoRA actor")
  parser.add_argument(
    "--profile", action="store_true", help="print where the rollouts' host time goes (cProfile)"
  )
  parser.add_argument(
    "--rollout-only",
    action="store_true",
    help="no trainer: each step generates the step's rollouts and syncs new weights",
  )
  args = parser.parse_args()
  options: dict = dict(
    max_num_reqs=args.max_num_reqs,
    free_kv_cache_during_sync=args.free_kv_cache_during_sync,
    reshard_chunk_bytes=args.reshard_chunk_mib << 20 or None,
  )
  if args.num_decode_steps is not None:
    options["num_decode_steps"] = args.num_decode_steps
  if args.lora:
    options["lora_alpha"] = 2.0 * args.lora
  engines = {"jaxengine": functools.partial(JaxEngineRollout, **options)}
  if args.compare:
    engines["vanilla"] = "vanilla"
  mode = "rollout and sync only" if args.rollout_only else "GRPO"
  print(f"{jax.devices()[0].device_kind}, --size {args.size}, {args.steps} steps, {mode}")
  for name, engine in engines.items():
    if args.rollout_only:
      times = run_rollout_only(engine, args.steps, args.size)
    else:
      times = run(engine, args.steps, args.lora, args.size, args.profile and name == "jaxengine")
    after = lambda xs: f"{np.mean(xs[1:] or xs):.3f}"
    print(
      f"{name}: rollout s/step {[round(t, 3) for t in times.rollout]} (after the first: mean "
      f"{after(times.rollout)}; compiles {times.compiles}); "
      f"sync s {[round(t, 3) for t in times.sync]}; whole step s "
      f"{[round(t, 3) for t in times.step]} (after the first: mean {after(times.step)})",
      flush=True,
    )


if __name__ == "__main__":
  main()
