"""Paged attention backends (`models/attention_backends.py`): every backend that runs here (XLA;
JAX's GPU Pallas decode kernel in interpret mode; JAX's TPU ragged kernel through its reference
function) writes through its own page layout and matches the XLA path and a float64 reference;
the backend choice per platform."""

from __future__ import annotations

import dataclasses
import types

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
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.paged_attention import FP8_KV_DTYPE, FP8_KV_MAX
from jaxengine.models.sharded_attention import HeadShardedBackend

SCALE = 8**-0.5
H, K, D, B = 9, 3, 8, 4  # K = 3: the TPU layout pads to 4 key/value heads, as for SmolLM2

STEPS = {
  "decode": ([(5, 1), (0, 1), (12, 1)], 4, 4),
  "mixed": ([(9, 1), (4, 6), (0, 3), (15, 1)], 16, 6),
}


def _tpu_reference_kernel(
  q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window=None,
  soft_cap=None, k_scale=None, v_scale=None, num_kv_pages_per_block, num_queries_per_block,
):  # fmt: skip
  """The TPU kernel's reference function, padded back to the kernel's `[T, H, D]` output; the
  kernel's block sizes are checked as the kernel checks them, and its 128 lanes."""
  assert 0 < num_kv_pages_per_block <= page_indices.shape[1]
  assert 0 < num_queries_per_block <= q.shape[0]
  assert q.shape[-1] == kv_pages.shape[-1] == 128
  out = ref_ragged_paged_attention(
    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
    sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
  )  # fmt: skip
  return jnp.pad(out, ((0, q.shape[0] - out.shape[0]), (0, 0), (0, 0)))


def _run(
  backend, step, num_layers=None, layer=None, sliding_window=None, soft_cap=None,
  dtype=jnp.float32, scale=None,
):  # fmt: skip
  """Writes every context token through the backend (pages of `dtype`), then attends (eagerly
  for the TPU reference function)."""
  num_kv_heads, head_dim = step.keys[0].shape[1:]
  pages = backend.init_pages(step.num_blocks, B, num_kv_heads, head_dim, dtype, num_layers)
  keys, values = np.concatenate(step.keys), np.concatenate(step.values)
  pages = backend.write_kv(pages, keys, values, jnp.asarray(step.slots), layer)
  if layer is not None:
    pages = tuple(p[layer] for p in pages)
  attention = backend.attention
  if not isinstance(backend, PallasTpuAttentionBackend):  # its reference function needs values
    static = ("scale", "num_kv_heads", "sliding_window", "soft_cap")
    attention = jax.jit(attention, static_argnames=static)
  out = attention(
    jnp.asarray(step.q), pages, step.md, scale=scale or SCALE, num_kv_heads=num_kv_heads,
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


@pytest.mark.parametrize("dtype", [jnp.float32, FP8_KV_DTYPE], ids=["float32", "fp8"])
@pytest.mark.parametrize(
  "num_heads,num_kv_heads,head_dim,path",
  [(9, 3, 64, "head_dim 64 padded to 128, 3 KV heads padded to 4"), (8, 4, 256, "XLA paged")],
  ids=["smollm2_64", "gemma_256"],
)
def test_tpu_backend_at_model_head_sizes_matches_xla(
  num_heads, num_kv_heads, head_dim, path, dtype
):
  """SmolLM2's 64-wide heads in 3 groups (pages padded to the kernel's 128 lanes and 4 heads, its
  reference function reading them) and Gemma's 256-wide ones (which the kernel refuses: the XLA
  path over XLA's pages) give the XLA backend's attention, with a window, a soft cap and fp8
  pages (the same per-tensor scales); `describe` names the path."""
  requests = [(9, 1), (4, 6), (0, 3), (15, 1)]
  step = make_step(
    np.random.default_rng(11), requests, num_tokens=16, num_reqs=6, max_blocks=6,
    num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=B,
  )  # fmt: skip
  step.q[:] *= 2  # scores of several units, so that the cap changes the weights
  tpu = PallasTpuAttentionBackend(kernel=_tpu_reference_kernel, k_scale=K_SCALE, v_scale=V_SCALE)
  xla = XlaAttentionBackend(k_scale=K_SCALE, v_scale=V_SCALE)
  options = dict(sliding_window=7, soft_cap=3.0, dtype=dtype, scale=head_dim**-0.5)
  out = _run(tpu, step, **options)
  np.testing.assert_allclose(out, _run(xla, step, **options), rtol=2e-5, atol=2e-5)
  want = reference_attention(_dequantized_step(step, tpu) if dtype == FP8_KV_DTYPE else step,
                             head_dim**-0.5, 7, soft_cap=3.0)  # fmt: skip
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
  assert not out[sum(step.query_lens) :].any()
  spec = KVCacheSpec(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
  assert path in tpu.describe(spec, num_heads)


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


@pytest.mark.parametrize("dtype", [jnp.float32, FP8_KV_DTYPE], ids=["float32", "fp8"])
@pytest.mark.parametrize("backend", [XlaAttentionBackend(), PallasTpuAttentionBackend(),
                                     PallasGpuAttentionBackend()], ids=lambda b: b.name)  # fmt: skip
def test_write_kv_into_one_layer_of_stacked_pages(backend, dtype):
  step = make_step(
    np.random.default_rng(8), [(3, 2), (0, 4)], num_tokens=8, num_reqs=2, max_blocks=3,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  pages = backend.init_pages(step.num_blocks, B, K, D, dtype, num_layers=3)
  keys, values = np.concatenate(step.keys), np.concatenate(step.values)
  written = jax.jit(backend.write_kv)(pages, keys, values, jnp.asarray(step.slots), 1)
  single = backend.write_kv(
    backend.init_pages(step.num_blocks, B, K, D, dtype), keys, values, jnp.asarray(step.slots)
  )
  for stacked, one in zip(written, single):  # fp8: pages and (GPU) their scales
    stacked, one = np.asarray(stacked, np.float32), np.asarray(one, np.float32)
    np.testing.assert_array_equal(stacked[1], one)
    assert not stacked[0].any() and not stacked[2].any()
    assert one.any()


def test_pages_are_separate_buffers_in_the_documented_layouts():
  assert [p.shape for p in XlaAttentionBackend().init_pages(5, 16, 3, 64)] == [(5, 16, 3, 64)] * 2
  assert [p.shape for p in PallasGpuAttentionBackend().init_pages(5, 16, 3, 64, num_layers=2)] == [
    (2, 3, 5, 16, 64)
  ] * 2
  (kv,) = PallasTpuAttentionBackend().init_pages(5, 16, 3, 64, jnp.bfloat16)
  assert kv.shape == (5, 16, 8, 128) and kv.dtype == jnp.bfloat16  # K = 3 padded to 4, D to 128
  wide = PallasTpuAttentionBackend().init_pages(5, 16, 4, 256, jnp.bfloat16)  # XLA's layout
  assert [p.shape for p in wide] == [(5, 16, 4, 256)] * 2
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
  tpu = PallasTpuAttentionBackend()  # K = 3 stored as 4 heads, D = 64 as 128 lanes
  assert tpu.num_blocks_for_memory(per_block * 100, dtype=jnp.bfloat16, **kwargs) == 37
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


# --- fp8 pages ---------------------------------------------------------------------------------

#: Per-tensor scales of the XLA and TPU backends' fp8 tests (not 1.0, so that the scale is
#: applied; standard normal keys / 0.03 stay inside fp8's +-448).
K_SCALE, V_SCALE = 0.03, 0.05
FP8_BACKENDS = {
  "xla": XlaAttentionBackend(k_scale=K_SCALE, v_scale=V_SCALE),
  "pallas_gpu_interpret": PallasGpuAttentionBackend(interpret=True),
  "pallas_tpu_reference": PallasTpuAttentionBackend(
    kernel=_tpu_reference_kernel, k_scale=K_SCALE, v_scale=V_SCALE
  ),
}
#: fp8 pages against float32 pages (the float64 reference, which float32 pages match to 2e-5),
#: standard normal queries, keys and values, `D = 8`: the largest and mean absolute output error.
#: Measured (rng 7, decode / mixed step): per-tensor scales (XLA and TPU alike) 0.067 / 0.108
#: largest, 0.012 / 0.013 mean; the GPU layout's per-position scales 0.049 / 0.067 largest,
#: 0.0096 / 0.0100 mean. Bounds about 1.5x the larger.
FP8_ERROR_BOUNDS = {"per_tensor": (0.16, 0.02), "per_position": (0.1, 0.015)}


def _fp8_round_trip(x: np.ndarray, scale) -> np.ndarray:
  """float64 `x` as fp8 pages hold it: `x / scale` clipped to +-448, rounded to float8_e4m3fn
  and multiplied back (NumPy, float32 arithmetic as the write's)."""
  scaled = np.clip(x.astype(np.float32) / np.float32(scale), -FP8_KV_MAX, FP8_KV_MAX)
  return scaled.astype(jnp.float8_e4m3fn).astype(np.float64) * scale


def _row_scales(x: np.ndarray) -> np.ndarray:
  """`[..., 1]` float32 scales `max|x| / 448` of the GPU layout (1 for a row of zeros)."""
  amax = np.abs(x.astype(np.float32)).max(-1, keepdims=True)
  return np.where(amax > 0, amax / np.float32(FP8_KV_MAX), np.float32(1))


def _dequantized_step(step, backend):
  """`step` with its keys and values replaced by what `backend`'s fp8 pages hold."""
  if isinstance(backend, PallasGpuAttentionBackend):
    keys = [_fp8_round_trip(k, _row_scales(k)) for k in step.keys]
    values = [_fp8_round_trip(v, _row_scales(v)) for v in step.values]
  else:
    keys = [_fp8_round_trip(k, backend.k_scale) for k in step.keys]
    values = [_fp8_round_trip(v, backend.v_scale) for v in step.values]
  return dataclasses.replace(step, keys=keys, values=values)


@pytest.mark.parametrize("step_name", list(STEPS))
@pytest.mark.parametrize("backend_name", list(FP8_BACKENDS))
def test_fp8_pages_match_float64_attention_over_their_rounded_keys(backend_name, step_name):
  """fp8 pages: exactly (to 2e-5) attention over the keys and values rounded as stored (the
  decode step takes the GPU kernel, the mixed step the GPU backend's XLA path), and within
  `FP8_ERROR_BOUNDS` of attention over the float32 keys and values."""
  requests, num_tokens, num_reqs = STEPS[step_name]
  step = make_step(
    np.random.default_rng(7), requests, num_tokens=num_tokens, num_reqs=num_reqs, max_blocks=6,
    num_heads=H, num_kv_heads=K, head_dim=D, block_size=B,
  )  # fmt: skip
  backend = FP8_BACKENDS[backend_name]
  out = _run(backend, step, dtype=FP8_KV_DTYPE)
  rounded = reference_attention(_dequantized_step(step, backend), SCALE)
  np.testing.assert_allclose(out, rounded, rtol=2e-5, atol=2e-5)
  error = np.abs(out - reference_attention(step, SCALE))[: sum(step.query_lens)]
  per = "per_position" if isinstance(backend, PallasGpuAttentionBackend) else "per_tensor"
  max_error, mean_error = FP8_ERROR_BOUNDS[per]
  assert 0 < error.max() < max_error and error.mean() < mean_error, (error.max(), error.mean())
  assert not out[sum(step.query_lens) :].any()


def _stored(backend, pages) -> tuple[np.ndarray, np.ndarray]:
  """`[N, B, K', D]` float32 keys and values that fp8 `pages` hold, multiplied by their scales."""
  if isinstance(backend, PallasGpuAttentionBackend):
    key_pages, value_pages, key_scales, value_scales = (np.asarray(p, np.float32) for p in pages)
    return tuple(
      np.moveaxis(p * s[..., None], 0, 2)
      for p, s in ((key_pages, key_scales), (value_pages, value_scales))
    )
  if isinstance(backend, PallasTpuAttentionBackend):
    (kv,) = pages
    kv = np.asarray(kv, np.float32)
    assert not kv[..., D:].any()  # the kernel's lanes past D
    return kv[:, :, 0::2, :D] * backend.k_scale, kv[:, :, 1::2, :D] * backend.v_scale
  key_pages, value_pages = (
    np.asarray(jax.lax.bitcast_convert_type(p, FP8_KV_DTYPE), np.float32) for p in pages
  )
  return key_pages * backend.k_scale, value_pages * backend.v_scale


@pytest.mark.parametrize("backend_name", list(FP8_BACKENDS))
def test_fp8_writes_scale_or_clip_large_values_instead_of_overflowing_to_nan(backend_name):
  """Keys of 1e6 (fp8's largest finite value is 448; past it a cast gives NaN): per-tensor scales
  clip them to +-448 * scale, the GPU layout's per-position scales keep them (to fp8's 3
  mantissa bits); a row of zeros stays zero."""
  backend = FP8_BACKENDS[backend_name]
  new = np.zeros((2, K, D), np.float32)
  new[0] = np.where(np.arange(D) % 2, 1e6, -1e6)
  new[0, :, 0] = 0.5e6
  pages = backend.init_pages(3, B, K, D, FP8_KV_DTYPE)
  pages = jax.jit(backend.write_kv)(pages, new, new, jnp.array([B, B + 1], jnp.int32))
  scales = (getattr(backend, "k_scale", None), getattr(backend, "v_scale", None))
  for stored, scale in zip(_stored(backend, pages), scales):
    assert np.isfinite(stored).all()
    rows = stored[1, :2, :K]  # [2, K, D]: the written slots (page 1), real heads
    assert not rows[1].any()
    want = new[0] if scale is None else np.clip(new[0], -FP8_KV_MAX * scale, FP8_KV_MAX * scale)
    np.testing.assert_allclose(rows[0], want, rtol=2**-4)


def test_fp8_bytes_per_block_in_each_layout():
  """A quarter of float32's bytes on XLA and TPU (`K = 3` padded to 4 heads in both dtypes, `D`
  to 128 lanes on TPU), `(D + 4) / (4 D)` on GPU (a float32 scale per position and head beside `D` bytes)."""
  L, block, heads, dim = 30, 16, 3, 64  # SmolLM2-135M
  sizes = dict(num_layers=L, block_size=block, num_kv_heads=heads, head_dim=dim)
  xla, tpu, gpu = XlaAttentionBackend(), PallasTpuAttentionBackend(), PallasGpuAttentionBackend()
  per_block = {
    (b.name, dtype): b.bytes_per_block(dtype=dtype, **sizes)
    for b in (xla, tpu, gpu)
    for dtype in (jnp.float32, FP8_KV_DTYPE)
  }
  assert per_block["xla", FP8_KV_DTYPE] == L * 2 * block * heads * dim
  assert per_block["pallas_tpu", FP8_KV_DTYPE] == L * block * 2 * 4 * 128
  assert per_block["pallas_gpu", FP8_KV_DTYPE] == L * 2 * heads * block * (dim + 4)
  for name in ("xla", "pallas_tpu"):
    assert 4 * per_block[name, FP8_KV_DTYPE] == per_block[name, jnp.float32]
  assert per_block["pallas_gpu", FP8_KV_DTYPE] * 4 * dim == per_block["pallas_gpu", jnp.float32] * (
    dim + 4
  )
  memory = 100 * per_block["xla", jnp.float32]
  assert xla.num_blocks_for_memory(memory, dtype=FP8_KV_DTYPE, **sizes) == 400
  assert gpu.num_blocks_for_memory(memory, dtype=FP8_KV_DTYPE, **sizes) == 100 * 4 * dim // (
    dim + 4
  )
  assert [a.dtype for a in xla.page_arrays(2, block, heads, dim, FP8_KV_DTYPE)] == [jnp.uint8] * 2
  assert [a.dtype for a in tpu.page_arrays(2, block, heads, dim, FP8_KV_DTYPE)] == [FP8_KV_DTYPE]
  assert [(a.shape, a.dtype) for a in gpu.page_arrays(2, block, heads, dim, FP8_KV_DTYPE)] == [
    ((heads, 2, block, dim), FP8_KV_DTYPE)
  ] * 2 + [((heads, 2, block), jnp.float32)] * 2


@pytest.mark.parametrize("dtype", [FP8_KV_DTYPE, jnp.bfloat16, jnp.float32])
def test_tpu_kv_heads_tile_in_the_kernel_and_are_the_fewest_that_do(dtype):
  """The kernel's own check (`get_min_heads_per_blk` raises for combined heads that do not
  tile) accepts `2 * tpu_kv_heads(K, dtype)`; for 8- and 16-bit pages no fewer heads tile
  (32-bit pages share the 16-bit layout)."""
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
    get_min_heads_per_blk,
  )

  def tiles(heads):
    try:
      get_min_heads_per_blk(heads, 2 * heads, jnp.float32, dtype)
    except ValueError:
      return False
    return True

  for num_kv_heads in range(1, 41):
    padded = tpu_kv_heads(num_kv_heads, dtype)
    assert padded >= num_kv_heads and tiles(padded), (num_kv_heads, padded)
    if dtype != jnp.float32:
      assert not any(tiles(h) for h in range(num_kv_heads, padded)), (num_kv_heads, padded)
  fp8 = [tpu_kv_heads(k, FP8_KV_DTYPE) for k in (1, 2, 3, 4, 5, 8, 9, 16, 17)]
  assert fp8 == [2, 2, 4, 4, 8, 8, 16, 16, 32]


def test_gpu_fp8_pages_need_cuda_capability_8_9_outside_interpret_mode():
  """Triton has float8_e4m3fn from CUDA compute capability 8.9 on: an older GPU is refused by
  name; interpret mode, other dtypes and other devices pass."""
  ampere, hopper = (
    types.SimpleNamespace(platform="gpu", compute_capability=c) for c in ("8.0", "9.0")
  )
  backend = PallasGpuAttentionBackend()
  with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' with attention_backend='pallas_gpu'"
                     r" needs CUDA compute capability >= 8.9.* has 8.0"):  # fmt: skip
    backend.check_kv_cache_dtype(FP8_KV_DTYPE, [hopper, ampere])
  backend.check_kv_cache_dtype(FP8_KV_DTYPE, [hopper])
  backend.check_kv_cache_dtype(jnp.bfloat16, [ampere])
  backend.check_kv_cache_dtype(FP8_KV_DTYPE, jax.devices())  # CPU
  PallasGpuAttentionBackend(interpret=True).check_kv_cache_dtype(FP8_KV_DTYPE, [ampere])
  XlaAttentionBackend().check_kv_cache_dtype(FP8_KV_DTYPE, [ampere])


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), "1", True])
@pytest.mark.parametrize("cls", [XlaAttentionBackend, PallasTpuAttentionBackend])
def test_per_tensor_kv_scales_are_checked_by_name(cls, value):
  with pytest.raises(ValueError, match=rf"v_scale must be a finite float > 0, got {value!r}"):
    cls(v_scale=value)
  assert cls(k_scale=2).k_scale == 2.0 and isinstance(cls(k_scale=2).k_scale, float)


def test_describe_says_what_each_backend_runs():
  """`describe(spec, num_heads)` (a compile report's `attention_backend`): the kernel and its
  padding, or the fallback and why; the head-sharded wrapper describes one device's heads."""
  smollm2 = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, dtype=jnp.bfloat16)
  gemma = KVCacheSpec(num_layers=26, num_kv_heads=4, head_dim=256, dtype=FP8_KV_DTYPE)
  llama = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype=FP8_KV_DTYPE)
  tpu = PallasTpuAttentionBackend()
  assert tpu.describe(smollm2, 9) == (
    "pallas ragged paged attention (bfloat16 pages, head_dim 64 padded to 128, 3 KV heads "
    "padded to 4 (9 query heads to 12))"
  )
  assert tpu.describe(llama, 32) == "pallas ragged paged attention (fp8 float8_e4m3fn pages)"
  assert tpu.describe(gemma, 8).startswith(
    "XLA paged attention (the Pallas ragged paged attention kernel refuses head_dim 256"
  )
  assert XlaAttentionBackend().describe(smollm2, 9) == "XLA paged attention"
  assert (
    XlaAttentionBackend(fixed_order=True).describe(smollm2, 9).endswith("(batch-invariant order)")
  )
  gpu = PallasGpuAttentionBackend()
  assert gpu.describe(smollm2, 9) == (
    "pallas GPU paged decode kernel, XLA paged attention for prefill steps"
  )
  assert gpu.describe(llama, 32).endswith(", fp8 pages with per-position scales")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  assert HeadShardedBackend(tpu, mesh).describe(smollm2, 9) == (
    tpu.describe(smollm2, 9) + ", per device of 1 (heads split over 'model')"
  )
