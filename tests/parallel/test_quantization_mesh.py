"""``quantization="int8"`` on a `jax.sharding.Mesh` of 2 host CPU devices.

One subprocess (the device count must be set before JAX starts) runs every check:

- ``tensor_parallel_size=2`` and ``data_parallel_size=2``: the one-device quantized engine's
  greedy tokens, and its sampled and prompt logprobs within `LOGPROB_BOUND`; the values in the
  float weight's sharding, the scales split where the weight's output axis is
  (`jaxengine.parallel`'s table) and replicated where its input axis is;
- `load_weights` of float tensors re-quantizes them on the mesh with nothing compiled, and the
  engine then gives what the one-device engine gives after the same load;
- ``tensor_parallel_size=2``: sleep level 1 and level 2 (then `load_weights`) and wake, nothing
  compiled, the same tokens, every array back in place;
- a mixture of experts quantized on the mesh, each expert split on its intermediate features and
  with ``enable_expert_parallel``: the expert scales split as their matrices' output axes, the
  forward pass's token logprobs those of one device within `LOGPROB_BOUND`;
- a tensor-parallel size that does not divide the heads, with quantization: a ValueError naming
  both, before any weight moves (the default GGUF model: before its tensors load).

The engines run their steps in their largest shape only (bucket choice:
tests/worker/test_step_shapes.py): the sampler, most of the compile time, compiles once a device.
"""

from __future__ import annotations

from subprocess_utils import run_python

#: Measured max |logprob difference| against one device (a sum split over the model axis adds
#: in another order; 2-core CPU): dense 1.9e-6 (tensor parallel) and 9.5e-7 (data parallel),
#: mixture of experts 9.5e-7 (either split).
LOGPROB_BOUND = 1e-5

SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
import jaxengine as je
from jaxengine.models import token_logprobs
from jaxengine.models.weights import named_weights, state_leaves
from jaxengine.testing import count_compiles, tiny_llama
from step_shapes import one_shape  # each group's steps in its largest shape: one sampler, not two

bound = float(sys.argv[1])
# A budget of 16 tokens (both prompts' 12): one_shape's steps of 16 tokens, not the default 256.
options = dict(max_num_reqs=4, max_model_len=64, num_kv_blocks=32, block_size=8,
               max_num_batched_tokens=16)
prompts = [[1, 5, 9, 33, 70, 100], [200, 100, 50, 25, 12, 6]]  # one per data shard
greedy = je.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0,
                           prompt_logprobs=0)
def model(seed=0, **fields):
  return tiny_llama(seed, max_position_embeddings=64, **fields)[0]
def run(llm):
  outs = llm.generate(prompts, greedy, use_tqdm=False)
  tokens = [list(o.outputs[0].token_ids) for o in outs]
  logprobs = [e[t].logprob for o in outs for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
  logprobs += [e[t].logprob for o in outs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
  return tokens, np.asarray(logprobs)
worst = {}
def same(got, want, what):
  assert got[0] == want[0], (what, got[0], want[0])
  worst[what] = float(np.abs(got[1] - want[1]).max())
  assert worst[what] < bound, (what, worst[what])
def spec(leaves, *path):
  return tuple(leaves[path].sharding.spec)

new_weights = {name: np.array(a, copy=True) for name, a in named_weights(model(1))}
one = one_shape(je.LLM(model(), quantization="int8", **options))
before = run(one)
one.load_weights(new_weights)
after = run(one)
assert after[0] != before[0]

for sizes in (dict(tensor_parallel_size=2), dict(data_parallel_size=2)):
  llm = one_shape(je.LLM(model(), quantization="int8", **options, **sizes))
  same(run(llm), before, f"{sizes} built")
  leaves = state_leaves(llm.llm_engine.runner.weights)
  t = "model" if "tensor_parallel_size" in sizes else None
  assert leaves[("layers", 0, "attn", "wq")].dtype == jnp.int8
  assert spec(leaves, "layers", 0, "attn", "wq") == ((t, None, None) if t else ())
  assert spec(leaves, "layers", 0, "attn", "scales", "wq") == ((t, None) if t else ())
  assert spec(leaves, "layers", 0, "attn", "wo") == ((None, t, None) if t else ())
  assert spec(leaves, "layers", 0, "attn", "scales", "wo") == ()
  assert spec(leaves, "layers", 0, "mlp", "scales", "w_gate") == ((t,) if t else ())
  assert spec(leaves, "layers", 0, "mlp", "scales", "w_down") == ()
  with count_compiles() as compiles:
    llm.load_weights(new_weights)
    loaded = run(llm)
  assert compiles.count == 0, (sizes, compiles.count)
  same(loaded, after, f"{sizes} loaded")
  if t:  # sleep and wake on the mesh, a quantized model
    where = [(a.sharding, a.committed, a.dtype) for a in jax.tree.leaves(llm.llm_engine.runner.weights)]
    for level in (1, 2):
      llm.sleep(level=level)
      with count_compiles() as compiles:
        llm.wake_up(tags=["weights"])
        if level == 2:
          llm.load_weights(new_weights)
        llm.wake_up(tags=["kv_cache"])
        assert run(llm)[0] == after[0], level
      assert compiles.count == 0, ("sleep", level, compiles.count)
      now = [(a.sharding, a.committed, a.dtype) for a in jax.tree.leaves(llm.llm_engine.runner.weights)]
      assert now == where, level
    print("sleep ok")
  print(sizes, "ok")

moe_fields = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(0,))
ids = jnp.asarray([[1, 5, 9, 33, 70, 100, 3, 4, 7, 8, 9, 10]], jnp.int32)
want = np.asarray(token_logprobs(je.LLM(model(**moe_fields), quantization="int8", **options)
                                 .llm_engine.runner.model, ids))
for expert_parallel in (False, True):
  llm = je.LLM(model(**moe_fields), quantization="int8", tensor_parallel_size=2,
               enable_expert_parallel=expert_parallel, **options)
  runner = llm.llm_engine.runner
  leaves = state_leaves(runner.weights)
  split = ("model", None) if expert_parallel else (None, "model")
  assert leaves[("layers", 0, "mlp", "expert_up")].dtype == jnp.int8
  assert spec(leaves, "layers", 0, "mlp", "scales", "expert_up") == split
  assert spec(leaves, "layers", 0, "mlp", "scales", "expert_down") == (split if expert_parallel else ())
  assert leaves[("layers", 0, "mlp", "router")].dtype == jnp.float32
  got = np.asarray(token_logprobs(runner.model, ids))
  worst[f"moe expert_parallel={expert_parallel}"] = float(np.abs(got - want).max())
  assert np.abs(got - want).max() < bound, expert_parallel
print("worst", worst)

# A model axis that does not divide the heads is refused before any weight moves (it once reached
# the quantization on the mesh, whose collectives waited until XLA aborted the process); the
# default GGUF model's 9 heads are read from its metadata, before its tensors load.
import jaxengine.entrypoints.llm as llm_module
def no_load(*args, **kwargs):
  raise AssertionError("the weights were loaded")
llm_module.load_resolved = no_load
for make in (lambda: je.LLM(model(num_attention_heads=3, num_key_value_heads=1),
                            quantization="int8", tensor_parallel_size=2, **options),
             lambda: je.LLM(tensor_parallel_size=2, quantization="fp8", max_model_len=64)):
  try:
    make()
  except ValueError as error:
    assert "tensor_parallel_size=2 must divide the model's num_attention_heads" in str(error)
  else:
    raise AssertionError("not refused")
print("ok")
"""


def test_quantized_engines_on_a_mesh_match_one_device():
  out = run_python(SCRIPT, str(LOGPROB_BOUND), timeout=600)
  assert out.strip().endswith("ok"), out
  assert "sleep ok" in out and out.count(" ok") == 3, out
