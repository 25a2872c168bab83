"""The Pallas GPU paged attention backend (`PallasGpuAttentionBackend`) and its fp8 checks.

JAX's Pallas paged decode kernel
(`jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`) reads steps whose requests
each have at most one query token, the XLA path (`attention_xla.xla_attention`) the rest; pages
are `[K, N, B, D]` for keys and for values, plus float32 scales `[K, N, B]` per position and head
for fp8 pages. Triton has float8_e4m3fn from CUDA compute capability 8.9 on
(`FP8_MIN_CUDA_CAPABILITY`), so an older GPU's fp8 cache is refused on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.models.attention_contract import AttentionBackend
from jaxengine.models.attention_xla import xla_attention
from jaxengine.models.paged_attention import (
  FP8_KV_DTYPE,
  fp8_row_scales,
  is_fp8_pages,
  quantize_fp8,
)

#: The lowest CUDA compute capability whose Triton has float8_e4m3fn (the GPU kernel's fp8 pages).
FP8_MIN_CUDA_CAPABILITY = (8, 9)


def _cuda_capability(device: Any) -> tuple[int, int] | None:
  """`(major, minor)` of a CUDA device's `compute_capability` ("8.9"), None for another device."""
  if getattr(device, "platform", None) not in ("gpu", "cuda"):
    return None
  major, _, minor = str(getattr(device, "compute_capability", "")).partition(".")
  if not (major.isdigit() and minor.isdigit()):
    return None
  return int(major), int(minor)


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class PallasGpuAttentionBackend(AttentionBackend):
  """JAX's GPU Pallas paged decode kernel, XLA for steps with prefill chunks; pages
  `([K, N, B, D] keys, [K, N, B, D] values)`, and for fp8 pages (float8_e4m3fn)
  `([K, N, B, D] keys, [K, N, B, D] values, [K, N, B] key scales, [K, N, B] value scales)`:
  each position's key (value) of each head is stored as `x / s` with its own float32 scale
  `s = max|x| / 448` (`fp8_row_scales`), which both paths multiply back (the kernel's
  `k_scales_pages` / `v_scales_pages`).

  Attributes:
    interpret: run the Pallas kernel in interpret mode (any device; for tests on CPU).
  """

  interpret: bool = False
  name = "pallas_gpu"
  kv_head_axis = 0
  supports_sliding_window = False
  supports_soft_cap = False
  platforms = ("gpu", "cuda", "rocm")

  def check_platform(self, platform: str) -> None:
    """Any platform in interpret mode."""
    if not self.interpret:
      super().check_platform(platform)

  def check_kv_cache_dtype(self, dtype, devices):
    """fp8 pages need Triton's float8_e4m3fn, which compiles for CUDA compute capability 8.9
    or later (Ada, Hopper, ...); interpret mode reads them anywhere.

    Raises:
      ValueError: fp8 pages and a CUDA device of a lower compute capability (naming both).
    """
    if self.interpret or not is_fp8_pages(dtype):
      return
    for device in devices:
      capability = _cuda_capability(device)
      if capability is not None and capability < FP8_MIN_CUDA_CAPABILITY:
        raise ValueError(
          f"kv_cache_dtype='fp8' with attention_backend={self.name!r} needs CUDA compute "
          f"capability >= 8.9 (Triton's float8_e4m3fn), {device} has "
          f"{device.compute_capability}: use attention_backend='xla' or kv_cache_dtype='auto'"
        )

  def describe(self, spec, num_heads):
    """The decode kernel for all-decode steps, the XLA path for the others; fp8 pages with
    per-position scales."""
    del num_heads  # the kernel takes every group ratio
    fp8 = ", fp8 pages with per-position scales" if is_fp8_pages(spec.dtype) else ""
    return f"pallas GPU paged decode kernel, XLA paged attention for prefill steps{fp8}"

  def page_arrays(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32):
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if not is_fp8_pages(dtype):
      return (jax.ShapeDtypeStruct(shape, dtype),) * 2
    pages = jax.ShapeDtypeStruct(shape, FP8_KV_DTYPE)
    scales = jax.ShapeDtypeStruct(shape[:-1], jnp.float32)
    return pages, pages, scales, scales

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    block_size = pages[0].shape[-2]
    page, offset = slot_mapping // block_size, slot_mapping % block_size
    new: tuple[jax.Array, ...] = (key, value)  # [T, K, D] each
    if is_fp8_pages(pages[0].dtype):
      scales = (fp8_row_scales(key), fp8_row_scales(value))  # [T, K] each
      new = (quantize_fp8(key, scales[0]), quantize_fp8(value, scales[1]), *scales)
    return tuple(_scatter_heads_first(p, x, page, offset, layer) for p, x in zip(pages, new))

  def attention(
    self, q, pages, md, *, scale, num_kv_heads=None, sliding_window=None, soft_cap=None
  ):
    self.check_sliding_window(sliding_window)
    self.check_soft_cap(soft_cap)
    all_decode = jnp.all(md.query_lens <= 1)
    return jax.lax.cond(
      all_decode,
      lambda: self._decode(q, pages, md, scale),
      lambda: self._xla(q, pages, md, scale),
    )

  def _decode(self, q, pages, md, scale):
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    key_pages, value_pages, *scales = pages  # scales: fp8 pages' [K, N, B] key and value scales
    k_scales, v_scales = scales or (None, None)
    num_tokens = q.shape[0]
    pages_per_req = md.block_tables.shape[1]
    k_splits = _largest_divisor(pages_per_req, 16)
    has_token = md.query_lens == 1  # [R]
    first = md.query_start_loc[:-1]  # [R] the request's only token
    q_reqs = q[jnp.minimum(first, num_tokens - 1)] * jnp.asarray(scale, q.dtype)  # [R, H, D]
    out = paged_attention(
      q_reqs,
      key_pages,
      value_pages,
      md.block_tables,
      jnp.where(has_token, md.seq_lens, 0),
      k_scales_pages=k_scales,
      v_scales_pages=v_scales,
      k_splits=k_splits,
      pages_per_compute_block=_largest_divisor(pages_per_req // k_splits, 8),
      interpret=self.interpret,
    )
    return jnp.zeros_like(q).at[jnp.where(has_token, first, num_tokens)].set(out, mode="drop")

  def _xla(self, q, pages, md, scale):
    key_pages, value_pages, *scales = pages
    k_scale, v_scale = scales or (1.0, 1.0)
    return xla_attention(
      q,
      (key_pages, value_pages),
      md,
      scale=scale,
      kv_heads_first=True,
      k_scale=k_scale,
      v_scale=v_scale,
    )


def _scatter_heads_first(
  pages: jax.Array, new: jax.Array, page: jax.Array, offset: jax.Array, layer
) -> jax.Array:
  """`[K, N, B, ...]` pages (`[L, K, N, B, ...]` with `layer`) with `[T, K, ...]` rows `new`
  at `(page, offset)` (`[T] int32` each), cast to the pages' dtype."""
  if layer is None:  # adjacent array indices: the indexed block is [K, T, ...]
    return pages.at[:, page, offset].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype))
  # `layer` and the arrays are split by a slice: NumPy's rule moves [T] first, [T, K, ...].
  return pages.at[layer, :, page, offset].set(new.astype(pages.dtype))
