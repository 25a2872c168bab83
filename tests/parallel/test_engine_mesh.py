"""The paged engine on a `jax.sharding.Mesh` (README, "Paged KV cache"), on 2 host CPU devices.

One subprocess (the device count must be set before JAX starts) runs every check:

- each attention backend, wrapped in `HeadShardedBackend` over the model axis, writes and attends
  like the float64 reference, each device over its own key/value heads: XLA, JAX's GPU Pallas
  kernel in interpret mode, and the TPU backend's layout (combined, interleaved key and value
  heads) with a traceable stand-in for its kernel; fp8 page arrays split along the head axis,
  and the GPU layout's fp8 pages and scales write and attend as on one device;
- the engine with `tensor_parallel_size=2` and a pool and token budget small enough to force
  chunked prefill and preemption, prefix caching on: the same tokens (greedy and seeded) and
  logprob ranks as one device, logprob values within 1e-4; repeated prompts hit the prefix cache;
  pages sharded over key/value heads, the batch state replicated;
- precompiled on the mesh, serving compiles no ragged step, and a second run compiles nothing;
- n-gram speculative decoding (`speculative_config`, the paged verify step) with `t = 2`:
  repeating prompts so drafts are accepted, the same tokens (greedy and seeded, a deep top-k
  list, prompt logprobs in a verify step) and logprob ranks as one device, values within 1e-5,
  the same accepted drafts; a second run compiles nothing.
"""

from __future__ import annotations

from subprocess_utils import run_python

SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from output_utils import assert_same_generations, generations
from paged_utils import make_step, reference_attention
import jaxengine as je
from jaxengine.models.attention_backends import (
  PallasGpuAttentionBackend, PallasTpuAttentionBackend, XlaAttentionBackend)
from jaxengine.models.paged_attention import (
  FP8_KV_DTYPE, PagedAttentionMetadata, ragged_paged_attention_xla)
from jaxengine.models.sharded_attention import HeadShardedBackend
from jaxengine.testing import count_compiles, tiny_llama
from jaxengine.worker import device_steps

# --- backends, each device over its own heads ------------------------------------------------
mesh = je.make_mesh(tensor_parallel_size=2)
H, K, D, B, SCALE = 4, 2, 8, 4, 8 ** -0.5
def tpu_layout_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale,
                      sliding_window=None, num_kv_pages_per_block, num_queries_per_block):
  # The TPU kernel's signature and combined [N, B, 2K, D] layout, computed by the XLA path (the
  # kernel's own reference function is not traceable, and shard_map traces).
  md = PagedAttentionMetadata(slot_mapping=jnp.zeros(q.shape[0], jnp.int32),
                              block_tables=page_indices, query_start_loc=cu_q_lens,
                              seq_lens=kv_lens, num_reqs=num_seqs[0])
  return ragged_paged_attention_xla(q, kv_pages[:, :, 0::2], kv_pages[:, :, 1::2], md,
                                    scale=sm_scale, sliding_window=sliding_window)
step = make_step(np.random.default_rng(7), [(9, 1), (4, 6), (0, 3), (15, 1)], num_tokens=16,
                 num_reqs=6, max_blocks=6, num_heads=H, num_kv_heads=K, head_dim=D, block_size=B)
want = reference_attention(step, SCALE)
for inner in (XlaAttentionBackend(), PallasGpuAttentionBackend(interpret=True),
              PallasTpuAttentionBackend(kernel=tpu_layout_kernel)):
  backend = HeadShardedBackend(inner, mesh)
  local = inner.page_shapes(step.num_blocks, B, K // 2, D)
  shapes = backend.page_shapes(step.num_blocks, B, K, D)
  axis = inner.kv_head_axis
  assert [s[axis] for s in shapes] == [2 * s[axis] for s in local], (inner.name, shapes)
  pages = jax.device_put(backend.init_pages(step.num_blocks, B, K, D),
                         jax.sharding.NamedSharding(mesh, backend.page_specs(1)[0]))
  keys, values = np.concatenate(step.keys), np.concatenate(step.values)
  def write_and_attend(pages, q, keys, values, slots, md, window=None):
    pages = backend.write_kv(pages, keys, values, slots)
    return pages, backend.attention(q, pages, md, scale=SCALE, num_kv_heads=K,
                                    sliding_window=window)
  args = (jnp.asarray(step.q), keys, values, jnp.asarray(step.slots), step.md)
  if backend.supports_sliding_window:  # a window of 5 per device (not pallas_gpu)
    _, out = jax.jit(write_and_attend, static_argnames="window")(pages, *args, window=5)
    np.testing.assert_allclose(np.asarray(out), reference_attention(step, SCALE, 5), rtol=2e-5,
                               atol=2e-5, err_msg=inner.name)
  assert backend.supports_sliding_window == (inner.name != "pallas_gpu")
  pages, out = jax.jit(write_and_attend)(pages, *args)
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5, err_msg=inner.name)
  assert pages[0].sharding.spec[axis] == "model", (inner.name, pages[0].sharding)
  # fp8 pages: every array (the GPU layout's [K, N, B] scales too) split along the head axis.
  local = inner.page_arrays(step.num_blocks, B, K // 2, D, FP8_KV_DTYPE)
  arrays = backend.page_arrays(step.num_blocks, B, K, D, FP8_KV_DTYPE)
  assert [a.dtype for a in arrays] == [a.dtype for a in local], (inner.name, arrays)
  assert [a.shape[axis] for a in arrays] == [2 * a.shape[axis] for a in local], inner.name
  print("backend", inner.name, "ok")

# A model axis that does not divide the key/value heads: the pages replicated, and a Pallas
# backend (which XLA's partitioner cannot place) run whole on each device under shard_map.
from jaxengine.models.sharded_attention import ReplicatedOnMeshBackend, shard_backend
tpu = PallasTpuAttentionBackend(kernel=tpu_layout_kernel)
assert isinstance(shard_backend(tpu, mesh, 3), ReplicatedOnMeshBackend)
assert isinstance(shard_backend(XlaAttentionBackend(), mesh, 3), XlaAttentionBackend)
backend = ReplicatedOnMeshBackend(tpu, mesh)
assert backend.page_shapes(step.num_blocks, B, K, D) == tpu.page_shapes(step.num_blocks, B, K, D)
pages = jax.device_put(backend.init_pages(step.num_blocks, B, K, D),
                       jax.sharding.NamedSharding(mesh, P()))
pages, out = jax.jit(write_and_attend)(pages, *args)
np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
assert backend.page_specs(1) == (P(),)  # how the runner places them
print("backend pallas_tpu replicated ok")

# The GPU layout's fp8 pages and scales, each device over its own heads: as on one device.
inner = PallasGpuAttentionBackend(interpret=True)
backend = HeadShardedBackend(inner, mesh)
def fp8_write_and_attend(backend, pages):
  pages = backend.write_kv(pages, np.concatenate(step.keys), np.concatenate(step.values),
                           jnp.asarray(step.slots))
  return backend.attention(jnp.asarray(step.q), pages, step.md, scale=SCALE, num_kv_heads=K)
one_device = jax.jit(fp8_write_and_attend, static_argnums=0)(
  inner, inner.init_pages(step.num_blocks, B, K, D, FP8_KV_DTYPE))
pages = jax.device_put(backend.init_pages(step.num_blocks, B, K, D, FP8_KV_DTYPE),
                       jax.sharding.NamedSharding(mesh, backend.page_specs(1)[0]))
out = jax.jit(fp8_write_and_attend, static_argnums=0)(backend, pages)
np.testing.assert_allclose(np.asarray(out), np.asarray(one_device), rtol=2e-5, atol=2e-5)
assert np.abs(np.asarray(out) - want).max() < 0.1  # fp8's rounding, per-position scales
print("backend pallas_gpu fp8 ok")


# --- the engine: t = 2 against one device --------------------------------------------------
model, _ = tiny_llama(vocab_size=256)  # 4 query heads over 2 key/value heads
SP = je.SamplingParams
rng = np.random.default_rng(0)
prefix = rng.integers(4, 250, 9).tolist()  # two full blocks of 4 shared by three prompts
prompts = [prefix + [10, 11], [5, 6, 7], prefix + [12], rng.integers(4, 250, 13).tolist(),
           [8, 9], prefix + [10, 11]]
params = [
  SP(temperature=0, max_tokens=6, logprobs=2),
  SP(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=8, logprobs=2),
  SP(temperature=1.0, seed=2, n=2, min_p=0.05, presence_penalty=0.5, max_tokens=5, logprobs=1),
  SP(temperature=0, max_tokens=7, logprobs=0),
  SP(temperature=0.7, seed=3, repetition_penalty=1.2, max_tokens=9),
  SP(temperature=1.0, seed=4, top_k=5, max_tokens=4, logprobs=3),
]
with_prompt_logprobs = [SP(temperature=0, max_tokens=3, prompt_logprobs=2, logprobs=1)] * 2
# 7 usable blocks of 4 (28 tokens) for 2 running requests of up to 24: preemption; a budget of
# 8 tokens splits every prompt above 6 tokens (two decodes first): chunked prefill.
kw = dict(max_num_reqs=2, max_model_len=24, block_size=4, num_kv_blocks=8,
          max_num_batched_tokens=8)

def run(llm, prompts=prompts, params=params):
  return generations(llm, prompts, params)

check_same = assert_same_generations

one = je.LLM(model, **kw)
want = run(one)
want_prompt = run(one, prompts[:2], with_prompt_logprobs)
one_stats = one.llm_engine.kv_cache_stats
assert one_stats.num_preemptions > 0, one_stats

llm = je.LLM(model, tensor_parallel_size=2, precompile=True, **kw)
runner = llm.llm_engine.runner
shapes = runner.ragged_forward._cache_size()
# Token buckets start at min(rows, 8); with prompt logprobs the largest row bucket only.
reachable = runner.step_shapes() + runner.step_shapes(prompt_logprobs=True)
assert shapes == len(reachable), (shapes, reachable)
with count_compiles() as compiles:  # nothing at all, not even the batch's metadata refresh
  got = run(llm)
assert compiles.count == 0, compiles.count
assert runner.ragged_forward._cache_size() == shapes
check_same(got, want)
stats = llm.llm_engine.kv_cache_stats
assert stats.num_preemptions == one_stats.num_preemptions > 0, (stats, one_stats)
assert stats.prefix_cache_hits > 0 and stats.num_used_blocks == 0, stats
check_same(run(llm, prompts[:2], with_prompt_logprobs), want_prompt)
print("engine", stats)

# k = 3 decode steps per dispatch on the mesh: the k = 1 tokens (the loop ran).
# Precompiled: the loop on the mesh compiles nothing when served.
steps3 = je.LLM(model, tensor_parallel_size=2, num_decode_steps=3, precompile=True, **kw)
with count_compiles() as compiles:
  check_same(run(steps3), want)
assert compiles.count == 0, ("k=3", compiles.count)
assert steps3.llm_engine.runner.decode_steps._cache_size() > 0
print("k-step", steps3.llm_engine.kv_cache_stats)

key = runner.kv_cache.pages[0][0]
assert key.sharding.spec == P(None, None, "model"), key.sharding
assert len(key.sharding.device_set) == 2 and key.addressable_shards[0].data.shape[2] == 1
assert runner.input_batch.state.token_ids.sharding.spec == P()
assert runner.weights["layers"][0]["attn"]["wq"][...].sharding.spec == P("model", None, None)

llm.llm_engine.reset_kv_cache_stats()
with count_compiles() as compiles:
  again = run(llm)
  check_same(run(llm, prompts[:2], with_prompt_logprobs), want_prompt)
assert compiles.count == 0, compiles.count
check_same(again, want)
assert llm.llm_engine.kv_cache_stats.prefix_cache_hits > 0  # finished prompts' blocks reused

# --- n-gram speculative decoding on the mesh: the verify step gives one device's tokens -------
spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
# The first request's greedy loop accepts drafts; the second finishes early, so the third's prompt
# (and its prompt logprobs) is computed in a verify step of the first's drafts.
spec_prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 4, 3, 4, 3], [8, 9], [9, 10, 11, 9, 10, 11, 9]]
spec_params = [
  SP(temperature=0, max_tokens=12, logprobs=2),
  SP(temperature=0.8, top_k=100, seed=1, max_tokens=3, logprobs=2),  # a deep candidate list
  SP(temperature=0, max_tokens=4, prompt_logprobs=1),
  SP(temperature=1.0, seed=2, min_p=0.05, presence_penalty=0.5, max_tokens=8, logprobs=1),
]
# Pages and budget for k = 3 drafts per row (the engines above allocate too few for them).
spec_kw = dict(kw, num_kv_blocks=16, max_num_batched_tokens=16)
def spec_engine(**options):
  llm = je.LLM(model, speculative_config=spec, **spec_kw, **options)
  llm.llm_engine.spec_crossover_tokens = 10**9  # verify whenever a row has a draft
  runner = llm.llm_engine.runner
  runner.row_buckets, runner.token_buckets = [2], [16]  # one shape of each step: few compiles
  return llm
one_spec = spec_engine()
want_spec = run(one_spec, spec_prompts, spec_params)
device_steps.clear()  # the executables of this engine alone (counted below)
spec_llm = spec_engine(tensor_parallel_size=2)
check_same(run(spec_llm, spec_prompts, spec_params), want_spec, atol=1e-5)
spec_stats = spec_llm.llm_engine.spec_decode_stats
assert spec_stats.num_accepted_tokens > 0, spec_stats  # drafts were verified and kept
assert spec_stats.num_accepted_tokens == one_spec.llm_engine.spec_decode_stats.num_accepted_tokens
assert spec_stats.num_accepted_tokens_per_pos[1] > 0, spec_stats  # runs of accepted drafts
assert spec_llm.llm_engine.runner.verify_forward._cache_size() == 2  # with prompt logprobs
with count_compiles() as compiles:
  again = run(spec_llm, spec_prompts, spec_params)
assert compiles.count == 0, compiles.count
check_same(again, want_spec, atol=1e-5)
print("speculative", spec_stats)
print("ok")
"""


def test_paged_engine_on_a_mesh_matches_one_device():
  out = run_python(SCRIPT, timeout=1500)
  assert out.strip().endswith("ok")
  assert out.count("backend") == 5  # three layouts, replicated pages, fp8 pages of the GPU layout
  assert "speculative" in out
