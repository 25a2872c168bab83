"""The TPU kernels compile for TPU v5e at every supported family's shapes, without a TPU
(`jax.experimental.topologies` and libtpu, in a subprocess): the attention backend's write and
attention (`models/attention_pallas_tpu.py`) per family and page dtype, saying which path runs,
and the mixture-of-experts grouped matmul (`models/moe.py`) at Qwen3-30B-A3B's and Mixtral's
sizes; the attention kernel's block sizes (`models/attention_tpu_blocks.py`)."""

from __future__ import annotations

import json

import jax.numpy as jnp
from subprocess_utils import run_python

from jaxengine.models.attention_tpu_blocks import KV_BUFFER_BYTES, tpu_block_sizes

#: name, query heads H, key/value heads K, head_dim D, and the (sliding window, soft cap) of its
#: kinds of layers (Gemma 2 and 3 alternate windowed and global layers; Llama-3.1-8B, Qwen3-8B
#: and Mixtral-8x7B share one shape, Mistral's window being none).
FAMILIES = [
  ("SmolLM2", 9, 3, 64, [(None, None)]),
  ("Qwen2.5-0.5B", 14, 2, 64, [(None, None)]),
  ("Llama-3.1-8B", 32, 8, 128, [(None, None)]),
  ("Qwen3-30B-A3B", 32, 4, 128, [(None, None)]),
  ("Gemma-2-2B", 8, 4, 256, [(4096, 50.0), (None, 50.0)]),
  ("Gemma-3-12B", 16, 8, 256, [(1024, None), (None, None)]),
]
#: name, hidden E, expert intermediate I, experts X, experts per token k.
MOE = [("Qwen3-30B-A3B", 2048, 768, 128, 8), ("Mixtral-8x7B", 4096, 14336, 8, 2)]

SCRIPT = """
import json, sys, time
import jax, jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
from jaxengine.models.attention_backends import PallasTpuAttentionBackend
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.grouped_matmul import grouped_linear
from jaxengine.models.paged_attention import FP8_KV_DTYPE, PagedAttentionMetadata

topology = topologies.get_topology_desc(
  platform="tpu", topology_name="v5e:1x1", chip_config_name="default",
  chips_per_host_bounds=(1, 1, 1), num_slices=1)
device = topology.devices[0]
sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))

def compile_(fn, *args):
  start = time.perf_counter()
  with jax.default_device(device):  # Mosaic reads the target from the default device
    compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start

T, R, N, B, P = 32, 8, 64, 16, 16  # tokens, requests, pages, page size, pages per request
backend = PallasTpuAttentionBackend(k_scale=0.5, v_scale=0.5)
md = PagedAttentionMetadata(
  slot_mapping=sds((T,), jnp.int32), block_tables=sds((R, P), jnp.int32),
  query_start_loc=sds((R + 1,), jnp.int32), seq_lens=sds((R,), jnp.int32),
  num_reqs=sds((), jnp.int32))
families, moe = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name, H, K, D, layers in families:
  for cache in (jnp.bfloat16, FP8_KV_DTYPE):
    pages = tuple(sds(a.shape, a.dtype) for a in backend.page_arrays(N, B, K, D, cache))

    def step(q, key, value, pages, md):  # one layer of each kind, as a model runs them
      outs = []
      for window, cap in layers:
        pages = backend.write_kv(pages, key, value, md.slot_mapping)
        outs.append(backend.attention(q, pages, md, scale=D**-0.5, num_kv_heads=K,
                                      sliding_window=window, soft_cap=cap))
      return outs, pages

    q, new = sds((T, H, D), jnp.bfloat16), sds((T, K, D), jnp.bfloat16)
    _, seconds = compile_(step, q, new, new, pages, md)
    describe = backend.describe(KVCacheSpec(num_layers=1, num_kv_heads=K, head_dim=D, dtype=cache), H)
    print(json.dumps(dict(family=name, pages=jnp.dtype(cache).name, seconds=seconds, path=describe)))
for name, E, I, X, k in moe:
  rows = 64 * k  # 64 tokens' assignments
  for dtype in ("bfloat16", "int8"):
    # the gate projection's [X, in, out] stack, as SparseMoeBlock stores it
    args = [sds((rows, E), jnp.bfloat16), sds((X, E, I), jnp.dtype(dtype)), sds((X,), jnp.int32)]
    scale = [sds((X, I), jnp.float32)] if dtype == "int8" else []
    fn = lambda x, w, sizes, *scale: grouped_linear(x, w, sizes, scale=scale[0] if scale else None)
    compiled, seconds = compile_(fn, *args, *scale)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(json.dumps(dict(moe=name, weights=dtype, seconds=seconds, flops=cost["flops"],
                          assigned_flops=2 * rows * E * I,
                          temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
                          bytes_accessed=cost["bytes accessed"],
                          weight_bytes=X * E * I * jnp.dtype(dtype).itemsize)))
"""


def test_tpu_kernels_compile_for_v5e_at_every_family_shape():
  """Each family's attention shape (H / K / D, window and soft cap) compiles for TPU v5e with
  bfloat16 and fp8 pages, and `describe` names what runs: the Pallas kernel, padding 64-wide
  heads to its 128 lanes (and SmolLM2's 3 KV heads to 4), or XLA for Gemma's 256-wide heads,
  which the kernel refuses. The MoE grouped matmul compiles for TPU at Qwen3-30B-A3B's and
  Mixtral's sizes, bfloat16 and int8 experts, as the ragged dot (the assignments' FLOPs, not
  every expert's: the CPU form is not chosen when compiling for a TPU from a CPU host), reading
  the ``[X, in, out]`` experts in place: no temporary of the stack's size (an ``[X, out, in]``
  stack was copied transposed on every call, and int8 values cast to a bfloat16 copy first) and
  about the stack's bytes accessed (64 tokens' decode step: at most 30% more)."""
  out = run_python(SCRIPT, json.dumps(FAMILIES), json.dumps(MOE), timeout=600)
  results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  paths = {(r["family"], r["pages"]): r["path"] for r in results if "family" in r}
  kernel, xla = "pallas ragged paged attention (", "XLA paged attention (the Pallas ragged"
  for name, _, num_kv_heads, head_dim, _ in FAMILIES:
    for pages in ("bfloat16", "float8_e4m3fn"):
      path = paths[name, pages]
      assert path.startswith(kernel if head_dim <= 128 else xla), (name, path)
      assert ("head_dim 64 padded to 128" in path) == (head_dim == 64), (name, path)
      assert ("KV heads padded" in path) == (num_kv_heads == 3), (name, path)
      assert pages in path or head_dim > 128, (name, path)
  moe = {(r["moe"], r["weights"]): r for r in results if "moe" in r}
  assert len(moe) == 2 * len(MOE)
  for r in moe.values():
    assert r["assigned_flops"] <= r["flops"] < 1.2 * r["assigned_flops"], r
    assert r["temp_bytes"] < 0.05 * r["weight_bytes"], r
    assert r["weight_bytes"] <= r["bytes_accessed"] < 1.3 * r["weight_bytes"], r


def test_tpu_block_sizes_read_the_tuned_table_for_the_target_or_bound_vmem():
  """The kernel's tuned entry for the device compiled for (4 query heads on 1 KV head, 16-token
  pages, 1,024 tokens, 256-token contexts: 16 pages and 128 queries on TPU v5, where the
  untuned default is 32 queries); without an entry, its defaults, the key/value buffers held
  under `KV_BUFFER_BYTES` (Llama's 16 combined heads at 16 MiB for 128 pages: 64), 32 pages on
  TPU v4; never more pages than a request's block table nor more queries than the call's."""
  bf16, fp8 = jnp.bfloat16, jnp.float8_e4m3fn
  tuned = dict(q_dtype=bf16, kv_dtype=bf16, num_q_heads=4, num_combined_kv_heads=2, head_dim=128,
               page_size=16, num_tokens=1024, pages_per_seq=16)  # fmt: skip
  assert tpu_block_sizes(**tuned, device_kind="TPU v5 lite") == (16, 128)
  assert tpu_block_sizes(**tuned, device_kind=None) == (16, 32)
  llama = dict(q_dtype=bf16, num_q_heads=32, num_combined_kv_heads=16, head_dim=128,
               page_size=16, num_tokens=2048, pages_per_seq=512)  # fmt: skip
  assert 2 * 64 * 16 * 16 * 128 * 2 <= KV_BUFFER_BYTES < 2 * 128 * 16 * 16 * 128 * 2
  assert tpu_block_sizes(**llama, kv_dtype=bf16, device_kind="TPU v5 lite") == (64, 32)
  assert tpu_block_sizes(**llama, kv_dtype=fp8, device_kind="TPU v6 lite") == (128, 32)
  assert tpu_block_sizes(**llama, kv_dtype=bf16, device_kind="TPU v4") == (32, 32)
  small = dict(llama, num_tokens=8, pages_per_seq=4)
  assert tpu_block_sizes(**small, kv_dtype=bf16, device_kind=None) == (4, 8)
