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
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from jaxengine.integrations.tunix import JaxEngineRollout


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


def tiny_actor(mesh) -> nnx.Module:
  """A 2-layer Tunix Llama 3 with random weights (Tunix zero-initialises its MLPs)."""
  config = llama3.ModelConfig(
    num_layers=2, vocab_size=264, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
    num_kv_heads=2, rope_theta=500_000, norm_eps=1e-5, weight_tying=True,
  )  # fmt: skip
  with mesh:
    model = nnx.eval_shape(lambda: llama3.Llama3(config, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  scale = lambda leaf: (0.3, 0.0) if leaf.ndim > 1 else (0.1, 1.0)  # norms around 1
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


def lora_actor(mesh, rank: int) -> nnx.Module:
  """`tiny_actor` with qwix LoRA of `rank` and alpha ``2 * rank`` on every projection."""
  model = tiny_actor(mesh)
  provider = qwix.LoraProvider(module_path=LORA_MODULES, rank=rank, alpha=2.0 * rank)
  with mesh:
    return qwix.apply_lora_to_model(model, provider, **model.get_model_input(), rngs=nnx.Rngs(1))


def reward(prompts, completions, **kwargs):
  """Rewards completions with many vowels (anything that varies between samples trains)."""
  return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def run(rollout_engine, steps: int, lora_rank: int = 0) -> list[float]:
  """Trains `steps` GRPO steps (a LoRA actor of `lora_rank` unless 0); returns the rollout time
  of each (seconds)."""
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  role = rl_cluster_lib.Role
  cluster = rl_cluster_lib.RLCluster(
    actor=lora_actor(mesh, lora_rank) if lora_rank else tiny_actor(mesh),
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
  times: list[float] = []
  generate = cluster.rollout.generate

  def timed_generate(*args, **kwargs):
    start = time.perf_counter()
    out = generate(*args, **kwargs)
    times.append(time.perf_counter() - start)
    return out

  cluster.rollout.generate = timed_generate
  learner = grpo_learner.GRPOLearner(
    rl_cluster=cluster,
    algo_config=grpo_learner.GRPOConfig(num_generations=4, num_iterations=1, beta=0.0),
    reward_fns=reward,
  )
  prompts = np.array(["The cat", "A dog", "Once upon", "Hello"])
  learner.train([{"prompts": prompts}] * steps)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=4)
  parser.add_argument("--max-num-reqs", type=int, default=16)
  parser.add_argument(
    "--num-decode-steps", type=int, default=1, help="decode steps per dispatch (off a mesh)"
  )
  parser.add_argument("--compare", action="store_true", help="also run Tunix's vanilla rollout")
  parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="a qwix LoRA actor")
  args = parser.parse_args()
  options: dict = dict(max_num_reqs=args.max_num_reqs, num_decode_steps=args.num_decode_steps)
  if args.lora:
    options["lora_alpha"] = 2.0 * args.lora
  engines = {"jaxengine": functools.partial(JaxEngineRollout, **options)}
  if args.compare:
    engines["vanilla"] = "vanilla"
  for name, engine in engines.items():
    times = run(engine, args.steps, args.lora)
    steady = times[1:] or times
    print(
      f"{name}: rollout seconds per step {[round(t, 3) for t in times]}; "
      f"after the first: mean {np.mean(steady):.3f} s"
    )


if __name__ == "__main__":
  main()
