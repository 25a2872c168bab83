"""Decoder layers under `jax.lax.scan` (``scan_layers=True``) on a `jax.sharding.Mesh` of 2 host
CPU devices, ``tensor_parallel_size=2``, int8 weights, in one subprocess (the device count must
be set before JAX starts):

- the one-device unrolled engine's greedy tokens, its sampled and prompt logprobs within
  `LOGPROB_BOUND`;
- the stacked leaves split as their per-layer matrices are, the leading layer axis unsplit
  (``[L, H, D, E]`` query projection over ``H``, its ``[L, H, D]`` scales too, the ``[L, E, H,
  D]`` output projection over ``H``), the stacked KV pages split over their key/value heads;
- `load_weights` of per-layer float tensors compiles nothing and gives the one-device engine's
  tokens after the same load; sleep level 2, `load_weights`, wake: the same tokens again.
"""

from __future__ import annotations

from subprocess_utils import run_python

#: A sum split over the model axis adds in another order (as tests/parallel/test_quantization_mesh.py).
LOGPROB_BOUND = 1e-5

SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
import jaxengine as je
from jaxengine.models.weights import named_weights, state_leaves
from jaxengine.testing import count_compiles, tiny_llama
from step_shapes import one_shape  # the steps in their largest shape: one sampler, not two

bound = float(sys.argv[1])
# tests/parallel/test_quantization_mesh.py's sizes (its one-device engine's executables shared):
# steps of 16 tokens (both prompts' 12).
options = dict(max_num_reqs=4, max_model_len=64, num_kv_blocks=32, block_size=8,
               max_num_batched_tokens=16, quantization="int8")
prompts = [[1, 5, 9, 33, 70, 100], [200, 100, 50, 25, 12, 6]]
greedy = je.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0,
                           prompt_logprobs=0)
def model(seed=0):
  return tiny_llama(seed, max_position_embeddings=64)[0]
def run(llm):
  outs = llm.generate(prompts, greedy, use_tqdm=False)
  tokens = [list(o.outputs[0].token_ids) for o in outs]
  logprobs = [e[t].logprob for o in outs for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
  logprobs += [e[t].logprob for o in outs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
  return tokens, np.asarray(logprobs)

new_weights = {name: np.array(a, copy=True) for name, a in named_weights(model(1))}
one = one_shape(je.LLM(model(), **options))
before = run(one)
one.load_weights(new_weights)
after = run(one)
assert after[0] != before[0]

llm = one_shape(je.LLM(model(), tensor_parallel_size=2, scan_layers=True, **options))
got = run(llm)
assert got[0] == before[0], (got[0], before[0])
worst = float(np.abs(got[1] - before[1]).max())
assert worst < bound, worst
runner = llm.llm_engine.runner
leaves = state_leaves(runner.weights)
spec = lambda *path: tuple(leaves[path].sharding.spec)
assert leaves[("layers", "attn", "wq")].shape[0] == 2 and leaves[("layers", "attn", "wq")].dtype == jnp.int8
assert spec("layers", "attn", "wq") == (None, "model", None, None), spec("layers", "attn", "wq")
assert spec("layers", "attn", "scales", "wq") == (None, "model", None)
assert spec("layers", "attn", "wo") == (None, None, "model", None)
assert spec("layers", "mlp", "scales", "w_gate") == (None, "model")
keys = runner.kv_cache.pages[0][0]
assert runner.kv_cache.stacked_layers == 2 and keys.sharding.spec[2] == "model", keys.sharding.spec
with count_compiles() as compiles:
  llm.load_weights(new_weights)
  loaded = run(llm)
assert compiles.count == 0, compiles.count
assert loaded[0] == after[0]
llm.sleep(level=2)
with count_compiles() as compiles:
  llm.wake_up(tags=["weights"])
  llm.load_weights(new_weights)
  llm.wake_up(tags=["kv_cache"])
  assert run(llm)[0] == after[0]
assert compiles.count == 0, ("sleep", compiles.count)
print("worst", worst)
print("ok")
"""


def test_a_scanned_engine_on_a_mesh_matches_one_device():
  out = run_python(SCRIPT, str(LOGPROB_BOUND), timeout=600)
  assert out.strip().endswith("ok"), out
