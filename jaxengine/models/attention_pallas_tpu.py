"""The Pallas TPU paged attention backend (`PallasTpuAttentionBackend`) and the padding its
kernel's tiling needs (`tpu_kv_heads`, `tpu_head_dim`).

JAX's ragged paged attention kernel
(`jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention`) reads mixed
prefill and decode steps in one call from pages that hold keys and values together,
`[N, B, 2 * K', D']` (key head `k` at `2 * k`, value head `k` at `2 * k + 1`, `K' >= K` padded
so the heads tile); fp8 pages are float8_e4m3fn, read with the kernel's own `k_scale` /
`v_scale`. In jax 0.10.2 it takes `sliding_window`, `soft_cap`, `k_scale` and `v_scale`.

What the kernel refuses (compiled for TPU v5e with libtpu 0.0.42.1, deviceless):

* a head width other than 128 lanes. Narrower heads (`D = 64`: SmolLM2, Qwen2.5-0.5B) fail in
  its online softmax, which broadcasts `[rows, 128]` statistics onto `[rows, D]`; the pages
  store them zero-padded to `D' = 128` (`tpu_head_dim`) and the queries are padded alike:
  zero lanes add nothing to `q . k`, the softmax scale stays the model's `D ** -0.5`, and the
  output's padding lanes are sliced off. Such pages take `128 / D` times the bytes.
* wider heads (`D = 256`: Gemma 2 and 3) fail in Mosaic's strided load of the combined heads
  ("The last dim size is not 128 in original base memref"), and cannot be padded down: the
  backend then stores and reads the XLA backend's pages (`XlaAttentionBackend`, `[N, B, K, D]`
  keys and values) with its attention (`describe` says so).
* combined heads that do not tile ("can not be XLA fully tiled", e.g. SmolLM2's `K = 3`): the
  pages hold `K' = tpu_kv_heads(K)` heads, zeros past `K`, and the queries of the padding heads
  are zeros whose output is dropped.

Block sizes are passed explicitly (`attention_tpu_blocks.tpu_block_sizes`), so compiling never
reads `jax.devices()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.models.attention_contract import AttentionBackend, set_kv_scales
from jaxengine.models.attention_tpu_blocks import tpu_block_sizes
from jaxengine.models.attention_xla import XlaAttentionBackend
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.paged_attention import FP8_KV_DTYPE, is_fp8_pages, write_kv_pages
from jaxengine.models.target_device import target_device_kind

#: The head width (lanes) the TPU kernel computes with.
KERNEL_HEAD_DIM = 128


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


def tpu_head_dim(head_dim: int) -> int | None:
  """The head width `D'` the TPU kernel's pages hold for a model's `D`: `KERNEL_HEAD_DIM` for
  `D <= 128` (zero-padded), None for wider heads, which the kernel refuses (the backend reads
  them with XLA)."""
  return KERNEL_HEAD_DIM if head_dim <= KERNEL_HEAD_DIM else None


@dataclasses.dataclass(frozen=True)
class PallasTpuAttentionBackend(AttentionBackend):
  """JAX's TPU ragged paged attention kernel; pages `([N, B, 2K', D'] keys and values,)` with
  `K' = tpu_kv_heads(K, dtype)` (heads past `K` hold zeros; their queries are dropped) and
  `D' = tpu_head_dim(D)` (lanes past `D` hold zeros); fp8 pages are float8_e4m3fn (TPUs store
  it natively), read by the kernel with its `k_scale` and `v_scale`. For a head width the kernel
  refuses (`tpu_head_dim` None) the pages, write and attention are `XlaAttentionBackend`'s.

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

  @property
  def xla(self) -> XlaAttentionBackend:
    """The XLA backend (same scales) that serves the head widths the kernel refuses."""
    return XlaAttentionBackend(k_scale=self.k_scale, v_scale=self.v_scale)

  def check_platform(self, platform: str) -> None:
    """Any platform with a `kernel` of one's own (tests pass the reference function)."""
    if self.kernel is None:
      super().check_platform(platform)

  def describe(self, spec: KVCacheSpec, num_heads: int) -> str:
    """What runs for a model's cache `spec` (`spec.dtype` the cache dtype) and `num_heads`
    query heads: the kernel and the padding it needs, or the XLA path and why."""
    head_dim = tpu_head_dim(spec.head_dim)
    if head_dim is None:
      return (
        f"XLA paged attention (the Pallas ragged paged attention kernel refuses head_dim "
        f"{spec.head_dim}: Mosaic loads the combined key/value heads only {KERNEL_HEAD_DIM} "
        "lanes wide)"
      )
    storage = FP8_KV_DTYPE if is_fp8_pages(spec.dtype) else spec.dtype
    kv_heads = tpu_kv_heads(spec.num_kv_heads, storage)
    fp8 = "fp8 " if is_fp8_pages(spec.dtype) else ""
    notes = [f"{fp8}{jnp.dtype(storage).name} pages"]
    if head_dim != spec.head_dim:
      notes.append(f"head_dim {spec.head_dim} padded to {head_dim}")
    if kv_heads != spec.num_kv_heads:
      group = num_heads // spec.num_kv_heads
      notes.append(
        f"{spec.num_kv_heads} KV heads padded to {kv_heads} ({num_heads} query heads to "
        f"{kv_heads * group})"
      )
    return f"pallas ragged paged attention ({', '.join(notes)})"

  def page_arrays(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32):
    padded_dim = tpu_head_dim(head_dim)
    if padded_dim is None:
      return self.xla.page_arrays(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    storage = FP8_KV_DTYPE if is_fp8_pages(dtype) else dtype
    shape = (num_blocks, block_size, 2 * tpu_kv_heads(num_kv_heads, storage), padded_dim)
    return (jax.ShapeDtypeStruct(shape, storage),)

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    if len(pages) == 2:  # the XLA layout: a head width the kernel refuses
      return self.xla.write_kv(pages, key, value, slot_mapping, layer)
    (kv_pages,) = pages
    num_tokens, num_kv_heads, head_dim = key.shape
    if is_fp8_pages(kv_pages.dtype):  # write_kv_pages clips and casts `x / scale`
      key, value = _unscale(key, self.k_scale), _unscale(value, self.v_scale)
    padded_heads, padded_dim = kv_pages.shape[-2] // 2, kv_pages.shape[-1]
    pad = ((0, 0), (0, padded_heads - num_kv_heads), (0, padded_dim - head_dim))
    interleaved = jnp.stack([jnp.pad(key, pad), jnp.pad(value, pad)], axis=2)  # [T, K', 2, D']
    interleaved = interleaved.reshape(num_tokens, 2 * padded_heads, padded_dim)
    return (write_kv_pages(kv_pages, interleaved, slot_mapping, layer),)

  def attention(
    self, q, pages, md, *, scale, num_kv_heads=None, sliding_window=None, soft_cap=None
  ):
    if len(pages) == 2:  # the XLA layout: a head width the kernel refuses
      return self.xla.attention(
        q, pages, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap
      )
    (kv_pages,) = pages
    num_tokens, num_heads, head_dim = q.shape
    padded_kv_heads, padded_dim = kv_pages.shape[-2] // 2, kv_pages.shape[-1]
    real_kv_heads = num_kv_heads or padded_kv_heads
    if num_heads % real_kv_heads or real_kv_heads > padded_kv_heads:
      raise ValueError(
        f"num_kv_heads={real_kv_heads} must divide the {num_heads} query heads and fit the "
        f"pages' {padded_kv_heads} (pass the model's K when tpu_kv_heads pads it)"
      )
    group = num_heads // real_kv_heads
    q_padded = jnp.pad(
      q.reshape(num_tokens, real_kv_heads, group, head_dim),
      ((0, 0), (0, padded_kv_heads - real_kv_heads), (0, 0), (0, padded_dim - head_dim)),
    ).reshape(num_tokens, padded_kv_heads * group, padded_dim)
    # Optional arguments only when used: a `kernel` of one's own without them serves the rest.
    options: dict[str, float] = {}
    if soft_cap is not None:
      options["soft_cap"] = soft_cap
    if is_fp8_pages(kv_pages.dtype):
      options.update(k_scale=self.k_scale, v_scale=self.v_scale)
    kv_pages_per_block, queries_per_block = tpu_block_sizes(
      q_dtype=q.dtype,
      kv_dtype=kv_pages.dtype,
      num_q_heads=q_padded.shape[1],
      num_combined_kv_heads=kv_pages.shape[-2],
      head_dim=padded_dim,
      page_size=kv_pages.shape[1],
      num_tokens=num_tokens,
      pages_per_seq=md.block_tables.shape[1],
      device_kind=target_device_kind(),
    )
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
      num_kv_pages_per_block=kv_pages_per_block,
      num_queries_per_block=queries_per_block,
      **options,
    )
    out = out[:, :num_heads, :head_dim].astype(q.dtype)
    # The kernel leaves rows past the last request's tokens undefined.
    real = jnp.arange(num_tokens) < md.query_start_loc[md.num_reqs]
    return jnp.where(real[:, None, None], out, 0)


def _unscale(x: jax.Array, scale: float) -> jax.Array:
  """`x / scale` in float32 (`x` itself for 1.0)."""
  return x if scale == 1.0 else x.astype(jnp.float32) / scale
