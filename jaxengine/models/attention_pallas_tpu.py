"""The Pallas TPU paged attention backend (`PallasTpuAttentionBackend`) and the head padding its
kernel's tiling needs (`tpu_kv_heads`).

JAX's ragged paged attention kernel
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention`) reads mixed
prefill and decode steps in one call from pages that hold keys and values together,
`[N, B, 2 * K', D]` (key head `k` at `2 * k`, value head `k` at `2 * k + 1`, `K' >= K` padded
so the heads tile); fp8 pages are float8_e4m3fn, read with the kernel's own `k_scale` /
`v_scale`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.models.attention_contract import AttentionBackend, set_kv_scales
from jaxengine.models.paged_attention import FP8_KV_DTYPE, is_fp8_pages, write_kv_pages


def _tpu_kernel() -> Callable[..., jax.Array]:
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

  return ragged_paged_attention


def _tiles(num_combined_heads: int, packing: int) -> bool:
  """The TPU kernel's tiling condition on its `2K'` combined heads, for a page dtype packing
  `packing` values in 32 bits."""
  per_word, rest = divmod(num_combined_heads, packing)
  return not rest and (per_word in (1, 2, 4, 8) or per_word % 8 == 0)


def tpu_kv_heads(num_kv_heads: int, dtype: Any = jnp.bfloat16) -> int:
  """Key/value heads the TPU kernel's pages of `dtype` hold: the smallest `K' >= K` whose `2K'`
  combined heads tile (the kernel raises "can not be XLA fully tiled" otherwise, e.g. for
  SmolLM2's `K = 3`).

  The kernel's rule (`get_min_heads_per_blk` in
  `jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel`): with `p = 32 / bits` values
  packed per 32-bit word, `2K'` divisible by `p` and `2K' / p` in 1, 2, 4, 8 or a multiple of 8.
  8-bit (fp8) pages have `p = 4`: `K'` of 2, 4, 8 or a multiple of 16. 32-bit pages take the
  16-bit rule (`p = 2`: `K'` of 1, 2, 4, 8 or a multiple of 8), so float32 and bfloat16 pages
  share one layout.
  """
  packing = max(2, 32 // (8 * jnp.dtype(dtype).itemsize))
  heads = num_kv_heads
  while not _tiles(2 * heads, packing):
    heads += 1
  return heads


@dataclasses.dataclass(frozen=True)
class PallasTpuAttentionBackend(AttentionBackend):
  """JAX's TPU ragged paged attention kernel; pages `([N, B, 2K', D] keys and values,)` with
  `K' = tpu_kv_heads(K, dtype)` (heads past `K` hold zeros; their queries are dropped); fp8
  pages are float8_e4m3fn (TPUs store it natively), read by the kernel with its `k_scale` and
  `v_scale`.

  Attributes:
    kernel: a function with the kernel's signature (tests pass its reference function); None
      imports `ragged_paged_attention` on first use.
    k_scale: fp8 keys are stored as `key / k_scale` (clipped to fp8's range) and the kernel
      multiplies them by its `k_scale` (vLLM's per-tensor scale; 1.0, vLLM's value for a
      checkpoint without one). Unused for other page dtypes.
    v_scale: the same for values.
  """

  kernel: Callable[..., jax.Array] | None = None
  k_scale: float = 1.0
  v_scale: float = 1.0
  name = "pallas_tpu"
  kv_head_axis = 2
  platforms = ("tpu",)

  def __post_init__(self) -> None:
    set_kv_scales(self)

  def check_platform(self, platform: str) -> None:
    """Any platform with a `kernel` of one's own (tests pass the reference function)."""
    if self.kernel is None:
      super().check_platform(platform)

  def page_arrays(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32):
    storage = FP8_KV_DTYPE if is_fp8_pages(dtype) else dtype
    shape = (num_blocks, block_size, 2 * tpu_kv_heads(num_kv_heads, storage), head_dim)
    return (jax.ShapeDtypeStruct(shape, storage),)

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    (kv_pages,) = pages
    num_tokens, num_kv_heads, head_dim = key.shape
    if is_fp8_pages(kv_pages.dtype):  # write_kv_pages clips and casts `x / scale`
      key, value = _unscale(key, self.k_scale), _unscale(value, self.v_scale)
    pad = ((0, 0), (0, kv_pages.shape[-2] // 2 - num_kv_heads), (0, 0))
    interleaved = jnp.stack([jnp.pad(key, pad), jnp.pad(value, pad)], axis=2)  # [T, K', 2, D]
    interleaved = interleaved.reshape(num_tokens, kv_pages.shape[-2], head_dim)
    return (write_kv_pages(kv_pages, interleaved, slot_mapping, layer),)

  def attention(
    self, q, pages, md, *, scale, num_kv_heads=None, sliding_window=None, soft_cap=None
  ):
    (kv_pages,) = pages
    num_tokens, num_heads, head_dim = q.shape
    padded_kv_heads = kv_pages.shape[-2] // 2
    real_kv_heads = num_kv_heads or padded_kv_heads
    if num_heads % real_kv_heads or real_kv_heads > padded_kv_heads:
      raise ValueError(
        f"num_kv_heads={real_kv_heads} must divide the {num_heads} query heads and fit the "
        f"pages' {padded_kv_heads} (pass the model's K when tpu_kv_heads pads it)"
      )
    group = num_heads // real_kv_heads
    q_padded = jnp.pad(
      q.reshape(num_tokens, real_kv_heads, group, head_dim),
      ((0, 0), (0, padded_kv_heads - real_kv_heads), (0, 0), (0, 0)),
    ).reshape(num_tokens, padded_kv_heads * group, head_dim)
    # Optional arguments only when used: a `kernel` of one's own without them serves the rest.
    options: dict[str, float] = {}
    if soft_cap is not None:
      options["soft_cap"] = soft_cap
    if is_fp8_pages(kv_pages.dtype):
      options.update(k_scale=self.k_scale, v_scale=self.v_scale)
    kernel = self.kernel or _tpu_kernel()
    out = kernel(
      q_padded,
      kv_pages,
      md.seq_lens,
      md.block_tables,
      md.query_start_loc,
      md.num_reqs.reshape(1),
      sm_scale=scale,
      sliding_window=sliding_window,
      **options,
    )
    out = out[:, :num_heads].astype(q.dtype)
    # The kernel leaves rows past the last request's tokens undefined.
    real = jnp.arange(num_tokens) < md.query_start_loc[md.num_reqs]
    return jnp.where(real[:, None, None], out, 0)


def _unscale(x: jax.Array, scale: float) -> jax.Array:
  """`x / scale` in float32 (`x` itself for 1.0)."""
  return x if scale == 1.0 else x.astype(jnp.float32) / scale
