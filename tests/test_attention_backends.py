"""Paged attention backends (`models/attention_backends.py`): every backend that runs here (XLA;
JAX's GPU Pallas decode kernel in interpret mode; JAX's TPU ragged kernel through its reference
function) writes through its own page layout and matches the XLA path and a float64 reference;
the backend choice per platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
from paged_utils import make_step, reference_attention

from jaxengine.models.attention_backends import (
  PallasGpuAttentionBackend,
  PallasTpuAttentionBackend,
  XlaAttentionBackend,
  attention_backend,
  tpu_kv_heads,
)

SCALE = 8**-0.5
H, K, D, B = 9, 3, 8, 4  # K = 3: the TPU layout pads to 4 key/value heads, as for SmolLM2

STEPS = {
  "decode": ([(5, 1), (0, 1), (12, 1)], 4, 4),
  "mixed": ([(9, 1), (4, 6), (0, 3), (15, 1)], 16, 6),
}


def _tpu_reference_kernel(
  q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None,
  soft_cap=None, k_scale=None, v_scale=None,
):  # fmt: skip
  """The TPU kernel's reference function, padded back to the kernel's `[T, H, D]` output."""
  out = ref_ragged_paged_attention(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
    sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
  )  # fmt: skip
  return jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))


def _run(backend, step, num_layers=None, layer=None, sliding_window=None, soft_cap=None):
  """Writes every context token through the backend, then attends (eagerly)."""
  pages = backend.init_pages(step.num_blocks, B, K, D, num_layers=num_layers)
  keys, values = np.concatenate(step.keys), np.concatenate(step.values)
  pages = backend.write_kv(pages, keys, values, jnp.asarray(step.slots), layer)
  if layer is not None:
    pages = tuple(p[layer] for p in pages)
  attention = backend.attention
  if not isinstance(backend, PallasTpuAttentionBackend):  # its reference function needs values
    static = ("scale", "num_kv_heads", "sliding_window", "soft_cap")
    attention = jax.jit(attention, static_argnames=static)
  out = attention(
    jnp.asarray(step.q), pages, step.md, scale=SCALE, num_kv_heads=step.keys[0].shape[1],
    sliding_window=sliding_window, soft_cap=soft_cap,
  )  # fmt: skip
  return np.asarray(out)


BACKENDS = {
  "xla": XlaAttentionBackend(),
  "pallas_gpu_interpret": PallasGpuAttentionBackend(interpret=True),
  "pallas_tpu_reference": PallasTpuAttentionBackend(kernel=_tpu_reference_kernel),
}


@pytest.mark.parametrize("step_name", list(STEPS))
@pytest.mark.parametrize("backend_name", list(BACKENDS))
def test_backend_matches_xla_and_the_float64_reference(backend_name, step_name):
  requests, num_tokens, num_reqs = STEPS[step_name]
  step = make_step(
    np.random.default_rng(7), requests, num_tokens=num_tokens, num_reqs=num_reqs, max_blocks=6,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  out = _run(BACKENDS[backend_name], step)
  np.testing.assert_allclose(out, reference_attention(step, SCALE), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(out, _run(BACKENDS["xla"], step), rtol=2e-5, atol=2e-5)
  assert not out[sum(step.query_lens) :].any()


@pytest.mark.parametrize("backend_name", ["xla", "pallas_tpu_reference"])
def test_sliding_window_matches_the_float64_reference(backend_name):
  """The TPU kernel takes `sliding_window` (same mask: `p - W < s <= p`); XLA applies its own."""
  requests = [(9, 1), (4, 6), (0, 3), (15, 1), (11, 5)]
  step = make_step(
    np.random.default_rng(8), requests, num_tokens=16, num_reqs=6, max_blocks=6,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  out = _run(BACKENDS[backend_name], step, sliding_window=5)
  np.testing.assert_allclose(out, reference_attention(step, SCALE, 5), rtol=2e-5, atol=2e-5)
  assert not out[sum(step.query_lens) :].any()
  backend = BACKENDS["pallas_gpu_interpret"]
  assert not backend.supports_sliding_window and BACKENDS[backend_name].supports_sliding_window
  backend.check_sliding_window(None)
  with pytest.raises(ValueError, match="'pallas_gpu' has no sliding-window attention, got sli"):
    backend.check_sliding_window(5)


@pytest.mark.parametrize("backend_name", ["xla", "pallas_tpu_reference"])
def test_soft_cap_with_a_window_matches_the_float64_reference(backend_name):
  """The TPU kernel takes `soft_cap` (`c * tanh(s / c)` of the scaled scores, before masking);
  XLA caps its own scores. The GPU backend refuses a cap, as it refuses a window."""
  requests = [(9, 1), (4, 6), (0, 3), (15, 1), (11, 5)]
  step = make_step(
    np.random.default_rng(10), requests, num_tokens=16, num_reqs=6, max_blocks=6,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  step.q[:] *= 4  # scores of several units, so that a cap of 1.5 changes the weights
  out = _run(BACKENDS[backend_name], step, sliding_window=5, soft_cap=1.5)
  want = reference_attention(step, SCALE, 5, soft_cap=1.5)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  assert np.abs(want - reference_attention(step, SCALE, 5)).max() > 1e-2
  assert not out[sum(step.query_lens) :].any()
  backend = BACKENDS["pallas_gpu_interpret"]
  assert not backend.supports_soft_cap and BACKENDS[backend_name].supports_soft_cap
  backend.check_soft_cap(None)
  with pytest.raises(ValueError, match="'pallas_gpu' has no attention logit soft-capping, got"):
    backend.check_soft_cap(1.5)


def test_gpu_decode_kernel_itself_matches_the_reference():
  """`attention` picks the kernel by a traced condition; call the kernel's branch directly."""
  backend = PallasGpuAttentionBackend(interpret=True)
  requests, num_tokens, num_reqs = STEPS["decode"]
  step = make_step(
    np.random.default_rng(9), requests, num_tokens=num_tokens, num_reqs=num_reqs, max_blocks=6,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  pages = backend.init_pages(step.num_blocks, B, K, D)
  keys, values = np.concatenate(step.keys), np.concatenate(step.values)
  pages = backend.write_kv(pages, keys, values, jnp.asarray(step.slots))
  out = np.asarray(backend._decode(jnp.asarray(step.q), pages, step.md, SCALE))
  np.testing.assert_allclose(out, reference_attention(step, SCALE), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("backend", [XlaAttentionBackend(), PallasTpuAttentionBackend(),
                                     PallasGpuAttentionBackend()], ids=lambda b: b.name)  # fmt: skip
def test_write_kv_into_one_layer_of_stacked_pages(backend):
  step = make_step(
    np.random.default_rng(8), [(3, 2), (0, 4)], num_tokens=8, num_reqs=2, max_blocks=3,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  pages = backend.init_pages(step.num_blocks, B, K, D, num_layers=3)
  keys, values = np.concatenate(step.keys), np.concatenate(step.values)
  written = jax.jit(backend.write_kv)(pages, keys, values, jnp.asarray(step.slots), 1)
  single = backend.write_kv(
    backend.init_pages(step.num_blocks, B, K, D), keys, values, jnp.asarray(step.slots)
  )
  for stacked, one in zip(written, single):
    np.testing.assert_array_equal(np.asarray(stacked[1]), np.asarray(one))
    assert not np.asarray(stacked[0]).any() and not np.asarray(stacked[2]).any()
    assert np.asarray(one).any()


def test_pages_are_separate_buffers_in_the_documented_layouts():
  assert [p.shape for p in XlaAttentionBackend().init_pages(5, 16, 3, 64)] == [(5, 16, 3, 64)] * 2
  assert [p.shape for p in PallasGpuAttentionBackend().init_pages(5, 16, 3, 64, num_layers=2)] == [
    (2, 3, 5, 16, 64)
  ] * 2
  (kv,) = PallasTpuAttentionBackend().init_pages(5, 16, 3, 64, jnp.bfloat16)
  assert kv.shape == (5, 16, 8, 64) and kv.dtype == jnp.bfloat16  # K = 3 padded to 4
  assert [tpu_kv_heads(k) for k in (1, 2, 3, 4, 5, 8, 9, 16, 20)] == [1, 2, 4, 4, 8, 8, 16, 16, 24]
  key, value = XlaAttentionBackend().init_pages(2, 4, 1, 8)
  assert key.unsafe_buffer_pointer() != value.unsafe_buffer_pointer()


def test_tpu_backend_needs_the_model_kv_heads_when_its_layout_pads_them():
  backend = PallasTpuAttentionBackend(kernel=_tpu_reference_kernel)
  step = make_step(
    np.random.default_rng(10), [(2, 1)], num_tokens=2, num_reqs=1, max_blocks=2,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  pages = backend.init_pages(step.num_blocks, B, K, D)  # 4 key/value heads for K = 3
  with pytest.raises(ValueError, match="num_kv_heads=4 must divide the 9 query heads"):
    backend.attention(jnp.asarray(step.q), pages, step.md, scale=SCALE)


def test_num_blocks_for_memory_counts_every_layer_and_padded_heads():
  kwargs = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
  per_block = 30 * 2 * 16 * 3 * 64 * 2  # keys and values, bfloat16
  xla = XlaAttentionBackend()
  assert xla.num_blocks_for_memory(per_block * 100 + 5, dtype=jnp.bfloat16, **kwargs) == 100
  tpu = PallasTpuAttentionBackend()  # K = 3 stored as 4 heads
  assert tpu.num_blocks_for_memory(per_block * 100, dtype=jnp.bfloat16, **kwargs) == 75
  with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1000 holds 0 KV cache blocks"):
    xla.num_blocks_for_memory(1000, **kwargs)


def test_attention_backend_choice():
  assert attention_backend(platform="tpu").name == "pallas_tpu"
  assert attention_backend(platform="gpu").name == "pallas_gpu"
  assert attention_backend(platform="cpu").name == "xla"
  assert attention_backend().name == {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(
    jax.default_backend(), "xla"
  )
  assert attention_backend("pallas_tpu", platform="cpu").name == "pallas_tpu"  # explicit wins
  with pytest.raises(ValueError, match=r"one of \['pallas_gpu', 'pallas_tpu', 'xla'\].*'flash'"):
    attention_backend("flash")
