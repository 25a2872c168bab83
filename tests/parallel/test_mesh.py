"""The batch and the engine under a `jax.sharding.Mesh` (README, "Many devices"), on 8 host CPU devices.

The checks run in a subprocess because the device count must be set before JAX starts: one
subprocess for both tests (module-scoped `outputs`, one import of JAX and jaxengine), each
test's part run on its own (`PARTS`; a part that fails prints its traceback and the next runs),
and each test reads its own part's output.
"""

from __future__ import annotations

import textwrap

import pytest
from subprocess_utils import run_python

SAMPLER_SCRIPT = textwrap.dedent("""
    import os
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxengine as je

    R, V = 16, 512
    batch = je.InputBatch(R, 32, V)
    for i in range(R):
      batch.add_request(f"r{i}", [1, 2], je.SamplingParams(
          temperature=0.8, top_k=20, top_p=0.9, seed=i, logprobs=2, presence_penalty=0.5))
    logits = np.random.default_rng(0).normal(size=(R, V)).astype(np.float32)
    state, metadata = batch.state, batch.sampling_metadata
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    _, want = je.sample_step(copy(state), metadata, logits)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    def by_row(x):  # the request axis across data-parallel devices; scalars replicated
      spec = P("data") if x.ndim and x.shape[0] == R else P()
      return jax.device_put(x, NamedSharding(mesh, spec))
    for spec in (P("data", None), P(None, "data")):  # rows sharded, or the vocabulary sharded
      new_state, got = je.sample_step(jax.tree.map(by_row, copy(state)),
                                      jax.tree.map(by_row, metadata),
                                      jax.device_put(logits, NamedSharding(mesh, spec)))
      assert np.array_equal(got.sampled_token_ids, want.sampled_token_ids), spec
      np.testing.assert_allclose(got.logprobs.logprobs, want.logprobs.logprobs, rtol=1e-6)
      assert len(new_state.token_ids.sharding.device_set) == 8

    # Exact summaries of vocabulary-sharded logits (jaxengine.sample.sharded): equal to the
    # gathered row's, ties (rounded logits) to the lower id, and no collective of V per row.
    from jaxengine.sample.sharded import sharded_argmax, sharded_max, sharded_top_k
    grid = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    tied = np.round(logits * 2) / 2
    tied[3] = 1.0  # a whole row tied
    x = jax.device_put(tied, NamedSharding(grid, P("data", "model")))
    for k in (1, 7, 40):
      values, ids = sharded_top_k(x, k, grid, rows="data")
      want_values, want_ids = jax.lax.top_k(tied, k)
      assert np.array_equal(values, want_values) and np.array_equal(ids, want_ids), k
    assert np.array_equal(sharded_argmax(x, grid, rows="data"), np.argmax(tied, -1))
    assert np.array_equal(sharded_max(x, grid, rows="data"), tied.max(-1))
    hlo = jax.jit(lambda x: sharded_top_k(x, 7, grid, rows="data")).lower(x).compile().as_text()
    gathers = [l for l in hlo.splitlines() if "all-gather" in l and "=" in l]
    assert gathers and all(f"[{R // 2},{4 * 7}]" in l for l in gathers), gathers
    print("ok")
""")


# The engine with tensor parallelism: the same tokens (greedy, seeded top-k/top-p/min-p,
# penalties), logprobs and ranks as one device; weights and pages really sharded; nothing
# compiles after warm-up or new weights; t = 3 over 4 query heads refused. t = 4 exceeds the 2
# kv heads, so the pages are replicated over the model axis there.
# (tests/parallel/test_engine_mesh.py: preemption, chunked prefill, prefix caching, num_decode_steps=3
# precompiled, speculation on a mesh.)
ENGINE_SCRIPT = """
import os
import jax, numpy as np
from jax.sharding import PartitionSpec as P
import jaxengine as je
from step_shapes import one_shape  # each group's steps in its largest shape: the placement, not
# bucket choice, is the point here (tests/worker/test_step_shapes.py)
from jaxengine.models.weights import named_weights
from jaxengine.testing import count_compiles, tiny_llama

model, _ = tiny_llama(vocab_size=256)  # 4 query heads over 2 kv heads
prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3, 4]]
params = [
  je.SamplingParams(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=1),
  je.SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1, max_tokens=6, logprobs=2),
  je.SamplingParams(temperature=1.0, min_p=0.1, seed=2, presence_penalty=1.0, max_tokens=4),
  je.SamplingParams(temperature=1.0, seed=3, max_tokens=7, repetition_penalty=1.2),
]
def run(llm):
  outs = llm.generate(prompts, params, use_tqdm=False)
  return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]
def logprobs(entries):
  ranks = [(t, v.rank) for e in entries if e for t, v in e.items()]
  return ranks, [v.logprob for e in entries if e for v in e.values()]
kw = dict(max_num_reqs=2, max_model_len=16)
want = run(one_shape(je.LLM(model, async_scheduling=False, **kw)))
for t, d in [(2, 1), (4, 2)]:
  llm = one_shape(je.LLM(model, tensor_parallel_size=t, data_parallel_size=d, **kw))
  runner = llm.llm_engine.runner
  got = run(llm)
  for (a, la, pa), (b, lb, pb) in zip(got, want):
    assert a == b, (t, d, a, b)
    for x, y in ((la, lb), (pa, pb)):
      if y is not None:
        assert logprobs(x)[0] == logprobs(y)[0]
        np.testing.assert_allclose(logprobs(x)[1], logprobs(y)[1], atol=1e-5)
  with count_compiles() as compiles:
    assert [g[0] for g in run(llm)] == [g[0] for g in got]
  assert compiles.count == 0, (t, d, compiles.count)
  # New weights (JAX arrays in HF layout; their conversion compiles small ops) are put on the
  # engine's shardings: the steps run as compiled.
  llm.load_weights(named_weights(model))
  with count_compiles() as compiles:
    assert [g[0] for g in run(llm)] == [g[0] for g in got]
  assert compiles.count == 0, (t, d, compiles.count)
  layer = runner.weights["layers"][0]
  specs = (layer["attn"]["wq"][...].sharding.spec, layer["mlp"]["w_down"][...].sharding.spec,
           runner.weights["embed"][...].sharding.spec, jax.tree.leaves(runner.kv_cache)[0].sharding.spec,
           runner.input_batch.state.token_ids.sharding.spec)
  split = (P("model", None, None), P(None, "model"), P("model", None)) if t > 1 else (P(),) * 3
  assert specs[:3] == split, specs
  assert ("model" in tuple(specs[3])) == (t == 2), specs  # heads split only where t divides K
  assert specs[4] == P(), specs  # a group's rows stay together (one core per data index)
  assert len(llm.llm_engine.cores) == d
  print(t, d, specs)
try:
  je.LLM(model, tensor_parallel_size=3, **kw)
except ValueError as e:
  assert "tensor_parallel_size=3" in str(e) and "num_attention_heads=4" in str(e), e
else:
  raise AssertionError("t=3 over 4 heads accepted")
# A Hugging Face directory is refused from its config.json, before any tensor is read.
import json, tempfile
folder = tempfile.mkdtemp()
with open(os.path.join(folder, "config.json"), "w") as f:
  json.dump({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4}, f)
with open(os.path.join(folder, "model.safetensors"), "wb") as f:
  f.write(b"not a checkpoint: never read")
try:
  je.LLM(folder, tensor_parallel_size=3)
except ValueError as e:
  assert "tensor_parallel_size=3" in str(e) and "num_attention_heads=4" in str(e), e
else:
  raise AssertionError("t=3 over 4 heads accepted from a directory")
print("ok")
"""

PARTS = {"sampler": SAMPLER_SCRIPT, "engine": ENGINE_SCRIPT}
#: Runs each of PARTS (given as its `repr`) in a namespace of its own, after the 8 devices are set.
RUNNER = """
import os, sys, traceback
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
for name, part in PARTS.items():
  print("BEGIN", name, flush=True)
  try:
    exec(part, {"__name__": "__main__"})
  except BaseException:
    print("FAILED", name, traceback.format_exc(), flush=True)
  print("END", name, flush=True)
"""


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
  """Each part's printed output (its traceback after ``FAILED`` where it failed)."""
  out = run_python(f"PARTS = {PARTS!r}\n{RUNNER}")
  parts = {}
  for name in PARTS:
    assert f"END {name}" in out, out[-3000:]
    parts[name] = out.split(f"BEGIN {name}\n", 1)[1].split(f"END {name}\n", 1)[0]
  return parts


def test_sample_step_under_a_mesh_matches_one_device(outputs):
  out = outputs["sampler"]
  assert "FAILED" not in out and out.strip().endswith("ok"), out


def test_engine_on_a_mesh_matches_one_device_and_compiles_nothing_after_warm_up(outputs):
  out = outputs["engine"]
  assert "FAILED" not in out and out.strip().endswith("ok"), out
  assert out.count("P(") >= 10  # one line of specs per configuration
