"""The engine's steps export for CUDA with the Pallas GPU kernel, on this CPU machine
(`jaxengine/aot/cuda.py`)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxengine.aot.cuda import (
  TRITON_CUSTOM_CALL,
  compile_for_cuda,
  cuda_topology,
  export_for_cuda,
  is_cuda_topology,
  parse_cuda_topology,
)
from jaxengine.batch import InputBatch
from jaxengine.models.attention_backends import (
  PallasGpuAttentionBackend,
  XlaAttentionBackend,
)
from jaxengine.models.kv_pages import PagedKVCache
from jaxengine.models.paged_attention import FP8_KV_DTYPE, PagedAttentionMetadata
from jaxengine.sample.metadata import refresh_metadata
from jaxengine.testing import tiny_llama
from jaxengine.worker import device_steps
from jaxengine.worker.multi_step import DecodeStepsInputs
from jaxengine.worker.ragged_step import RaggedInputs
from jaxengine.worker.step_inputs import build_step_inputs
from jaxengine.worker.verify_step import RaggedDrafts

ROWS, TOKENS, PAGES, BLOCK, NUM_BLOCKS, VOCAB, DRAFTS = 2, 4, 4, 8, 8, 64, 1
#: The steps that read the KV cache (the attention backend's kernels).
WITH_ATTENTION = ("ragged_forward", "verify_forward", "decode_steps")


@dataclasses.dataclass(frozen=True)
class Executable:
  name: str
  shape: str
  jitted: Any
  args: tuple
  kwargs: dict


def _spec(tree, sharding=None):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _executables(backend, kv_dtype=None, device=None) -> list[Executable]:
  """Every step of a bfloat16 tiny Llama (`DeviceSteps`: the plain and the verify step's model
  part and sampler, the decode loop), from abstract shapes alone (as test_device_steps lowers
  the ragged step), on `device`'s sharding if given."""
  model, _ = tiny_llama(vocab_size=VOCAB, dtype=jnp.bfloat16)
  graphdef, weights = nnx.split(nnx.eval_shape(lambda: model))
  steps = device_steps.placed_device_steps(graphdef, None, None, VOCAB)
  sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
  spec = model.kv_cache_spec
  if kv_dtype is not None:
    spec = dataclasses.replace(spec, dtype=kv_dtype)
  state = jax.eval_shape(lambda: InputBatch(ROWS, 32, VOCAB, max_num_blocks_per_req=PAGES).state)
  metadata = jax.eval_shape(lambda s: refresh_metadata(s, jnp.ones(ROWS, bool)), state)
  cache = jax.eval_shape(lambda: PagedKVCache.create(spec, backend, NUM_BLOCKS, BLOCK))
  layout = build_step_inputs([[1]], [0], [3], block_size=BLOCK, num_tokens=TOKENS,
                             num_reqs=ROWS, max_blocks_per_req=PAGES)  # fmt: skip
  attention = PagedAttentionMetadata(
    slot_mapping=layout.slot_mapping, block_tables=layout.block_tables,
    query_start_loc=layout.query_start_loc, seq_lens=layout.seq_lens,
    num_reqs=np.int32(layout.num_reqs),
  )  # fmt: skip
  inputs = RaggedInputs(
    token_rows=np.zeros(TOKENS, np.int32), positions=layout.positions, attention=attention,
    logits_indices=np.zeros(ROWS, np.int32), produces=np.zeros(ROWS, bool),
  )  # fmt: skip
  loop = DecodeStepsInputs(
    block_tables=np.zeros((ROWS, PAGES), np.int32), num_reqs=np.int32(ROWS),
    max_num_steps=np.zeros(ROWS, np.int32), max_output_tokens=np.zeros(ROWS, np.int32),
    stop_ids=np.zeros((ROWS, 4), np.int32), end_on_first_finish=np.bool_(False),
  )  # fmt: skip
  drafts = RaggedDrafts(
    input_token_ids=np.zeros(TOKENS, np.int32), logits_indices=np.zeros((ROWS, DRAFTS + 1), np.int32),
    draft_token_ids=np.zeros((ROWS, DRAFTS), np.int32), num_draft_tokens=np.zeros(ROWS, np.int32),
  )  # fmt: skip
  state, metadata, weights, cache, inputs, loop, drafts = _spec(
    (state, metadata, weights, cache, inputs, loop, drafts), sharding
  )
  logits = jax.ShapeDtypeStruct((ROWS, VOCAB), jnp.float32, sharding=sharding)
  verify_logits = jax.ShapeDtypeStruct((ROWS, DRAFTS + 1, VOCAB), jnp.float32, sharding=sharding)
  rows = f"rows={ROWS}"
  return [
    Executable("ragged_forward", f"tokens={TOKENS} {rows}", steps.ragged_forward,
               (state, weights, cache, inputs), {"prompt_logprobs": 0}),
    Executable("sample_produced", rows, steps.sample_produced,
               (state, metadata, logits, inputs.produces), {"num_rows": ROWS}),
    Executable("verify_forward", f"tokens={TOKENS} {rows} k={DRAFTS}", steps.verify_forward,
               (state, weights, cache, inputs, drafts), {"prompt_logprobs": 0}),
    Executable("rejection_sample_produced", f"{rows} k={DRAFTS}", steps.rejection_sample_produced,
               (state, metadata, verify_logits, drafts, inputs.produces), {"num_rows": ROWS}),
    Executable("decode_steps", f"{rows} steps=4", steps.decode_steps,
               (state, metadata, weights, cache, loop), {"num_rows": ROWS, "num_steps": 4}),
  ]  # fmt: skip


def _attention_steps(backend, kv_dtype=None, device=None) -> list[Executable]:
  return [e for e in _executables(backend, kv_dtype, device) if e.name in WITH_ATTENTION]


def test_every_step_exports_for_cuda_with_the_pallas_kernel_lowered_to_triton():
  """The steps of the "pallas_gpu" backend that read the cache (plain, verify, decode loop)
  carry the Pallas paged decode kernel as a Triton custom call (bfloat16 pages and fp8 pages
  with their scales); the samplers have none, and the XLA backend's steps none: the kernel
  comes from the backend."""
  reports = export_for_cuda(_executables(PallasGpuAttentionBackend()))
  by_name = {r.name: r for r in reports}
  assert len(reports) == len(by_name) == len(dataclasses.fields(device_steps.DeviceSteps))
  for r in reports:
    if r.name in WITH_ATTENTION:
      assert TRITON_CUSTOM_CALL in r.custom_calls
      (kernel,) = r.triton_kernels
      assert kernel.startswith("paged_attention")
    else:
      assert r.triton_kernels == ()
  assert all(r.module_bytes > 1000 and r.seconds > 0 for r in reports)

  fp8 = export_for_cuda(_attention_steps(PallasGpuAttentionBackend(), FP8_KV_DTYPE))
  assert all(r.triton_kernels == by_name[r.name].triton_kernels for r in fp8)
  # the fp8 pages are other arguments (float8 pages, float32 scales): another module
  assert all(r.module_bytes != by_name[r.name].module_bytes for r in fp8)

  xla = export_for_cuda(_attention_steps(XlaAttentionBackend()))
  assert all(TRITON_CUSTOM_CALL not in r.custom_calls and not r.triton_kernels for r in xla)


def test_a_lowering_error_names_the_executable():
  broken = Executable("broken", "rows=1", jax.jit(lambda x: x @ x), (jax.ShapeDtypeStruct(
    (2, 3), jnp.float32),), {})  # fmt: skip
  with pytest.raises(TypeError) as error:
    export_for_cuda([broken])
  assert "exporting broken (rows=1) for cuda" in error.value.__notes__


@pytest.mark.parametrize(
  "topology, match",
  [("v100", "unknown GPU 'v100'.*'h100'"), ("h100:0", "positive"), ("h100:x", "positive")],
)
def test_a_cuda_topology_is_refused_by_name_before_any_plugin(topology, match):
  with pytest.raises(ValueError, match=match):
    cuda_topology(topology)


def test_cuda_topologies_parse():
  assert parse_cuda_topology("H100")[0].compute_capability == (9, 0)
  assert parse_cuda_topology("a100:8")[1] == 8
  assert is_cuda_topology("h100:4") and not is_cuda_topology("v5e:2x2")


def test_a_deviceless_cuda_compile_or_the_plugin_it_needs():
  """With the CUDA plugin installed the steps compile for an H100 without one (XLA:GPU, Triton
  to PTX, ptxas); without it the topology is refused naming the wheels."""
  if not importlib.util.find_spec("jax_plugins") or not importlib.util.find_spec(
    "jax_plugins.xla_cuda12"
  ):
    with pytest.raises(RuntimeError, match=r"jax-cuda12-plugin==.*nvidia-cuda-nvcc-cu12"):
      cuda_topology("h100")
    return
  (device,) = cuda_topology("h100").devices
  assert device.device_kind == "NVIDIA H100 80GB HBM3"
  (ragged,) = [e for e in _executables(PallasGpuAttentionBackend(), device=device)
               if e.name == "ragged_forward"]  # fmt: skip
  (report,) = compile_for_cuda([ragged])
  assert report.pallas_triton_calls >= 1 and report.argument_bytes > 0
