"""Tunix LoRA rollouts: a qwix LoRA actor served by `JaxEngineRollout` (`tunix_lora`).

Tiny random Tunix models (as tests/integrations/test_tunix.py builds them) with qwix LoRA of rank 4 and
alpha 8 on every attention and MLP projection, its ``lora_b`` random (qwix starts it at zero,
which would hide a wrong layout). The rollout's logprobs are checked against the trainer's own
recomputation (Tunix's `compute_per_token_logps` over the qwix model), before and after a
LoRA-only `update_params` (Tunix's sync for a LoRA actor), which must compile nothing.
"""

from __future__ import annotations

import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx
from subprocess_utils import run_python
from test_tunix import (
  PAD,
  PROMPTS,
  ByteTokenizer,
  OneShapeRollout,
  build,
  padded_completions,
  rollout_config,
  trainer_logprobs,
)

from jaxengine.testing import count_compiles

RANK, ALPHA = 4, 8.0
MODULES = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
#: Gemma's attention projections are einsums (``q_einsum``, ``kv_einsum`` or ``qkv_einsum``,
#: ``attn_vec_einsum``).
GEMMA_MODULES = ".*_einsum|.*gate_proj|.*up_proj|.*down_proj"


def random_lora(model: nnx.Module, seed: int) -> nnx.State:
  """Random N(0, 0.3) values for every LoRA leaf of `model`."""
  rng = np.random.default_rng(seed)
  state = nnx.state(model, nnx.LoRAParam)
  return jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), x.dtype), state)


def build_lora(name: str, seed: int = 0) -> nnx.Module:
  model = build(name, seed)
  modules = GEMMA_MODULES if name.startswith("gemma") else MODULES
  provider = qwix.LoraProvider(module_path=modules, rank=RANK, alpha=ALPHA)
  lora_model = qwix.apply_lora_to_model(
    model, provider, **model.get_model_input(), rngs=nnx.Rngs(1)
  )
  nnx.update(lora_model, random_lora(lora_model, seed + 100))
  return lora_model


def make_rollout(model: nnx.Module, **options) -> OneShapeRollout:
  """A LoRA rollout of `model`, its steps in their largest shape only (as test_tunix's)."""
  return OneShapeRollout(
    rollout_actor=model,
    tokenizer=ByteTokenizer(),
    rollout_config=rollout_config(),
    max_num_reqs=4,
    **{"lora_alpha": ALPHA, **options},
  )


def max_error(rollout, model, out) -> float:
  """The largest gap between the rollout's sampled logprobs and the trainer's."""
  completions = padded_completions(out.tokens)
  expected = trainer_logprobs(model, out.left_padded_prompt_tokens, completions, 0.7)
  assert (completions != PAD).sum() > len(PROMPTS)  # something was generated
  return max(
    float(np.abs(values - expected[row, : len(values)]).max(initial=0.0))
    for row, values in enumerate(out.logprobs)
  )


@pytest.fixture(scope="module")
def served():
  model = build_lora("qwen3")
  return model, make_rollout(model)


def test_the_engine_serves_the_lora_actor_with_its_rank(served):
  _, rollout = served
  assert rollout.lora_request is not None
  assert rollout.llm.llm_engine.config.enable_lora
  assert rollout.llm.llm_engine.config.max_lora_rank == RANK


def test_tunix_learners_see_no_shared_weights_and_sync_every_step(served):
  """Tunix's learner compares the actor's leaves with `rollout.model()`'s one by one; a LoRA
  actor's list is longer than any base module's, so the rollout answers None (as Tunix's
  `RolloutEngineGroup` does) and Tunix syncs the adapter after every step."""
  from tunix.rl import utils as rl_utils

  model, rollout = served
  assert rollout.model() is None
  assert not rl_utils.is_sharing_weights(model, rollout.model())


def test_lora_rollouts_equal_the_trainer_and_follow_lora_only_syncs(served):
  model, rollout = served
  config = rollout_config(seed=3)
  out = rollout.generate(PROMPTS, config)
  assert max_error(rollout, model, out) < 1e-4
  # Warm every step shape: a rollout after a sync prefills whole prompts again (the prefix
  # cache is emptied), with the batch state committed by the first rollout (no engine mesh).
  rollout.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
  rollout.generate(PROMPTS, config)
  # Tunix's sync of a LoRA actor: the LoRA leaves alone, under its transfer guards.
  nnx.update(model, random_lora(model, 7))
  with count_compiles() as compiles:
    with (
      jax.transfer_guard_host_to_device("disallow_explicit"),
      jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
      rollout.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
    after = rollout.generate(PROMPTS, config)
  assert compiles.count == 0
  assert max_error(rollout, model, after) < 1e-4
  assert [t.tolist() for t in after.tokens] != [t.tolist() for t in out.tokens]
  # Teacher forcing reads the same adapter.
  completions = padded_completions(after.tokens)
  prompts = after.left_padded_prompt_tokens
  mask = completions != PAD
  got = np.asarray(rollout.get_per_token_logps(prompts, completions))
  expected = trainer_logprobs(model, prompts, completions, 0.7)
  np.testing.assert_allclose(got[mask], expected[mask], atol=1e-4)


def test_full_syncs_carry_base_and_lora_weights(served):
  model, rollout = served
  new_model = build_lora("qwen3", seed=5)
  rollout.update_params(nnx.state(new_model, nnx.Param), (nnx.Param,))  # LoRAParam included
  out = rollout.generate(PROMPTS, rollout_config(seed=4))
  assert max_error(rollout, new_model, out) < 1e-4
  rollout.update_params(nnx.state(model, nnx.Param), (nnx.Param,))  # back for the other tests


def test_bad_lora_leaves_are_refused_and_the_engine_keeps_working(served):
  model, rollout = served
  config = rollout_config(seed=9)
  before = rollout.generate(PROMPTS, config)
  lora = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  extra = {**lora, "lm_head": {"w_lora_a": jnp.zeros((32, RANK))}}
  with pytest.raises(ValueError, match=r"unsupported LoRA parameter 'lm_head\.w_lora_a'"):
    rollout.update_params(extra, (nnx.LoRAParam,))
  bad = jax.tree.map(lambda x: x, lora)
  bad["layers"][1]["attn"]["q_proj"]["w_lora_b"] = jnp.zeros((RANK, 3, 8))
  with pytest.raises(ValueError, match="layer 1 q_proj"):
    rollout.update_params(bad, (nnx.LoRAParam,))
  del bad["layers"][1]["attn"]["q_proj"]["w_lora_b"]
  with pytest.raises(ValueError, match="layer 1 q_proj lacks lora_b"):
    rollout.update_params(bad, (nnx.LoRAParam,))
  with pytest.raises(ValueError, match=r"only nnx\.Param or nnx\.LoRAParam"):
    rollout.update_params(lora, (nnx.Variable,))
  again = rollout.generate(PROMPTS, config)
  assert [t.tolist() for t in again.tokens] == [t.tolist() for t in before.tokens]
  np.testing.assert_allclose(
    np.concatenate(again.logprobs), np.concatenate(before.logprobs), atol=1e-5
  )


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3_moe"])
def test_teacher_forced_lora_logprobs_of_each_family(name):
  """Llama 3 and Qwen2 share Qwen3's LoRA layout; a MoE Qwen3 takes LoRA on attention only."""
  model = build_lora(name)
  rollout = make_rollout(model)
  rng = np.random.default_rng(0)
  prompts = np.full((2, 8), PAD, np.int32)
  prompts[0, 3:], prompts[1, :] = rng.integers(3, 200, 5), rng.integers(3, 200, 8)
  completions = rng.integers(3, 200, (2, 6)).astype(np.int32)
  got = np.asarray(rollout.get_per_token_logps(prompts, completions))
  np.testing.assert_allclose(got, trainer_logprobs(model, prompts, completions, 0.7), atol=1e-4)


def test_a_quantized_lora_rollout_follows_syncs_as_a_fresh_one():
  """`quantization` composes with a LoRA actor: a LoRA-only sync replaces the float adapter, a
  full sync re-quantizes the base weights too; teacher-forced logprobs then equal those of a
  quantized rollout built from the new weights, near the float trainer's."""
  model = build_lora("qwen3")
  rollout = make_rollout(model, quantization="int8")
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, 200, (2, 8)).astype(np.int32)
  completions = rng.integers(3, 200, (2, 6)).astype(np.int32)
  logps = lambda r: np.asarray(r.get_per_token_logps(prompts, completions))
  nnx.update(model, random_lora(model, 7))
  rollout.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
  np.testing.assert_allclose(logps(rollout), logps(make_rollout(model, quantization="int8")))
  new_model = build_lora("qwen3", seed=5)
  with count_compiles() as compiles:
    rollout.update_params(nnx.state(new_model, nnx.Param), (nnx.Param,))
    got = logps(rollout)
  assert compiles.count == 0
  np.testing.assert_allclose(got, logps(make_rollout(new_model, quantization="int8")), atol=1e-5)
  # int8 on these random weights: 0.044 at most, measured.
  np.testing.assert_allclose(got, trainer_logprobs(new_model, prompts, completions, 0.7), atol=0.1)


def test_lora_options_are_checked():
  plain = build("qwen3")
  with pytest.raises(ValueError, match="has no LoRA"):
    make_rollout(plain)
  with pytest.raises(ValueError, match="pass lora_alpha="):
    make_rollout(build_lora("qwen3"), lora_alpha=None)
  model = build_lora("qwen3")
  with pytest.raises(ValueError, match="max_lora_rank=2 is below"):
    make_rollout(model, max_lora_rank=2)
  with pytest.raises(ValueError, match="lora_alpha must be a positive number"):
    make_rollout(model, lora_alpha=-1.0)


# Issue 49: the actor on device 0 (a mesh with explicit axes, as Tunix's `ClusterConfig` places
# it) and the rollout on devices 1 and 2 (issue 53: tensor parallel, the RolloutConfig's sizes
# -1). The engine and its LoRA slots (split as their base projections) live on devices 1 and 2;
# the adapter's pairs, the LoRA-only syncs (under Tunix's transfer guards) and the full syncs
# arrive from device 0. Rollouts equal the trainer's recomputation, as the colocated ones do.
SPLIT_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=3"
    sys.path.insert(0, sys.argv[1])  # this folder: test_tunix, test_tunix_lora
    import jax
    from flax import nnx
    from test_tunix import AUTO, PROMPTS, rollout_config
    from test_tunix_lora import build_lora, make_rollout, max_error, random_lora

    actor_mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
    rollout_mesh = jax.make_mesh((1, 2), ("fsdp", "tp"), axis_types=AUTO, devices=jax.devices()[1:])
    on_actor = jax.sharding.NamedSharding(actor_mesh, jax.sharding.PartitionSpec())
    model = build_lora("qwen3")
    nnx.update(model, jax.device_put(nnx.state(model), on_actor))
    rollout = make_rollout(model, mesh=rollout_mesh)
    config = rollout_config(seed=3)
    assert max_error(rollout, model, rollout.generate(PROMPTS, config)) < 1e-4
    assert rollout.llm.llm_engine.config.tensor_parallel_size == 2
    slots = rollout.llm.llm_engine.runner.lora.buffers
    assert all(x.devices() == set(jax.devices()[1:]) for x in jax.tree.leaves(slots))
    assert tuple(slots[0]["q_proj"][1].sharding.spec) == (None, None, "model")
    nnx.update(model, jax.device_put(random_lora(model, 7), on_actor))
    with (
      jax.transfer_guard_host_to_device("disallow_explicit"),
      jax.transfer_guard_device_to_host("disallow_explicit"),
    ):
      rollout.update_params(nnx.state(model, nnx.LoRAParam), (nnx.LoRAParam,))
    assert max_error(rollout, model, rollout.generate(PROMPTS, config)) < 1e-4
    new_model = build_lora("qwen3", seed=5)
    nnx.update(new_model, jax.device_put(nnx.state(new_model), on_actor))
    rollout.update_params(nnx.state(new_model, nnx.Param), (nnx.Param,))
    assert max_error(rollout, new_model, rollout.generate(PROMPTS, config)) < 1e-4
    print("ok")
""")


def test_a_lora_rollout_on_another_device_than_the_actor():
  out = run_python(SPLIT_SCRIPT, os.path.dirname(__file__))
  assert out.strip().endswith("ok")


#: ``W + scale * delta(A, B)`` of each qwix-wrapped Tunix weight, in its own layout.
_DELTAS = {
  "q_einsum.w": "er,rnd->ned",  # [N, E, D]
  "kv_einsum.w": "er,rckd->cked",  # [2, K, E, D]
  "qkv_einsum.w": "er,rckd->cked",  # [3, N, E, D]
  "attn_vec_einsum.w": "ndr,re->nde",  # [N, D, E]
  "kernel": "ir,ro->io",  # [in, out]
}


def merged(name: str, lora_model: nnx.Module) -> nnx.Module:
  """A plain Tunix `name` model whose weights are `lora_model`'s with every qwix pair merged
  in (``W + alpha / rank * A B``): the reference without any LoRA code."""
  from jaxengine.integrations.tunix_weights import tunix_param_leaves
  from jaxengine.models.weights import dotted, leaf_path

  leaves = tunix_param_leaves(nnx.state(lora_model, nnx.Param))
  plain = build(name)
  state = nnx.state(plain, nnx.Param)
  flat, tree = jax.tree_util.tree_flatten_with_path(state)
  values = []
  for path, value in flat:
    name = dotted(leaf_path(path))
    value = leaves[name]
    if f"{name}_lora_a" in leaves:
      rule = next(r for suffix, r in _DELTAS.items() if name.endswith(suffix))
      a, b = leaves[f"{name}_lora_a"], leaves[f"{name}_lora_b"]
      value = value + ALPHA / RANK * jnp.einsum(rule, a, b)
    values.append(value)
  nnx.update(plain, jax.tree_util.tree_unflatten(tree, values))
  return plain


@pytest.mark.parametrize("name", ["gemma1", "gemma3"])
def test_gemma_lora_actors_equal_their_merged_weights(name):
  """qwix LoRA on Tunix's Gemma (``qkv_einsum``: fused query/key/value) and Gemma 3
  (``q_einsum``, ``kv_einsum``), every attention einsum and MLP projection: the rollout's
  teacher-forced logprobs (the pairs unmerged on the engine's LoRA slots) equal Tunix's own
  computation on a plain model with the pairs merged into its weights, within 1e-4; the
  adapter moves them by far more."""
  model = build_lora(name)
  leaves = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))["layers"][0]["attn"]
  assert (
    {"qkv_einsum"} <= set(leaves) if name == "gemma1" else {"q_einsum", "kv_einsum"} <= set(leaves)
  )
  rollout = make_rollout(model)
  rng = np.random.default_rng(0)
  prompts = np.full((2, 8), PAD, np.int32)
  prompts[0, 3:], prompts[1, :] = rng.integers(3, 200, 5), rng.integers(3, 200, 8)
  completions = rng.integers(3, 200, (2, 6)).astype(np.int32)
  got = np.asarray(rollout.get_per_token_logps(prompts, completions))
  want = trainer_logprobs(merged(name, model), prompts, completions, 0.7)
  np.testing.assert_allclose(got, want, atol=1e-4)
  assert np.abs(got - trainer_logprobs(build(name), prompts, completions, 0.7)).max() > 1e-2


def test_lora_leaves_given_as_base_weights_say_where_they_go():
  """`tunix_weights.engine_leaves` reads base weights only: a Gemma qwix LoRA leaf among them is
  named with where it goes (`split_lora_leaves`, the rollout's LoRA slots); split off, the rest
  is what a plain Gemma's check reads."""
  from jaxengine.integrations.tunix_lora import split_lora_leaves
  from jaxengine.integrations.tunix_weights import (
    check_tunix_params,
    config_from_tunix,
    tunix_param_leaves,
  )

  model = build_lora("gemma3")
  params = tunix_param_leaves(nnx.state(model, nnx.Param))
  config = config_from_tunix(model, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
  with pytest.raises(ValueError, match=r"_einsum\.w_lora_a'.*split_lora_leaves"):
    check_tunix_params(params, config)
  base, lora = split_lora_leaves(params)
  assert lora and check_tunix_params(base, config) == check_tunix_params(
    tunix_param_leaves(build("gemma3")), config
  )
