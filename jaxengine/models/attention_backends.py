"""Paged attention per accelerator: each backend owns its page layout, its write and its read.

Three backends, one contract (`AttentionBackend`): `init_pages` allocates one layer's pages (or
`L` layers' with a leading axis) as a tuple of arrays in the backend's layout, `write_kv` scatters
a step's new keys and values into them at `PagedAttentionMetadata.slot_mapping`, and `attention`
computes the ragged step's causal grouped-query attention `[T, H, D]` from them.

* `"xla"` (`XlaAttentionBackend`, the CPU default): keys and values `[N, B, K, D]` each, read by
  `paged_attention.ragged_paged_attention_xla`.
* `"pallas_tpu"` (`PallasTpuAttentionBackend`): JAX's ragged paged attention kernel
  `jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention(q, kv_pages,
  kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, ...)`, mixed prefill and decode in one
  call. Its pages hold keys and values together, `[N, B, 2 * K, D]` with key head `k` at `2 * k`
  and value head `k` at `2 * k + 1`; `kv_lens` are our `seq_lens`, `page_indices` our
  `block_tables`, `cu_q_lens` our `query_start_loc`, `num_seqs` our `num_reqs` as `[1] int32`.
* `"pallas_gpu"` (`PallasGpuAttentionBackend`): JAX's Pallas paged decode kernel
  `jax.experimental.pallas.ops.gpu.paged_attention.paged_attention(q, k_pages, v_pages,
  block_tables, lengths, *, block_h, pages_per_compute_block, k_splits, interpret, ...)` (one
  query token per sequence, no softmax scale: queries are pre-scaled) when every request of the
  step has at most one query token, the XLA path otherwise (prefill chunks). Its pages are
  `[K, N, B, D]` for keys and for values.

`attention_backend(None)` picks the backend of `jax.default_backend()`.

fp8 pages (``kv_cache_dtype="fp8"``: `init_pages(..., dtype=FP8_KV_DTYPE)`), float8_e4m3fn on
every backend, each in its own storage (`page_arrays` gives the arrays and their dtypes):

* `"xla"`: the fp8 bits as `FP8_KV_STORAGE` bytes (XLA:CPU has no float8 arithmetic), written as
  `clip(x / scale, +-448)` with a per-tensor static `k_scale` / `v_scale` (vLLM's; 1.0, vLLM's
  value for a checkpoint without one) and read back times it, in float32 then the query's dtype.
* `"pallas_tpu"`: float8_e4m3fn pages (TPUs store it natively), written the same way and read by
  the kernel with its own `k_scale` / `v_scale` arguments; the kernel's 8-bit tiling needs more
  padded heads for some `K` (`tpu_kv_heads(K, dtype)`).
* `"pallas_gpu"`: float8_e4m3fn pages and float32 scales `[K, N, B]` per position and head,
  `max|x| / 448` of each key (value) vector (1.0 for zeros, `fp8_row_scales`), so nothing clips.
  The decode kernel takes them as `k_scales_pages` / `v_scales_pages` (it casts the pages to the
  query's dtype and multiplies scores and probabilities by the scales); the XLA path of prefill
  steps multiplies each row it reads. A page costs `(D + 4) / (4 D)` of float32's bytes. Triton
  has float8_e4m3fn from CUDA compute capability 8.9 on: an older GPU is refused
  (`check_kv_cache_dtype`).

Sliding-window attention (`attention(..., sliding_window=W)`, Mistral): the XLA path masks and
skips pages before the window, the TPU kernel takes its own `sliding_window` argument; the GPU
decode kernel has none, so `"pallas_gpu"` refuses a window (`check_sliding_window`, called by the
paged runner when it creates the cache).

Attention logit soft-capping (`attention(..., soft_cap=c)`, Gemma 2): scaled scores `s` become
`c * tanh(s / c)` before masking. The XLA path computes it, the TPU kernel takes its own
`soft_cap` argument; the GPU decode kernel has none, so `"pallas_gpu"` refuses it
(`check_soft_cap`, called with `check_sliding_window`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.models.paged_attention import (
  FP8_KV_DTYPE,
  FP8_KV_STORAGE,
  KVScale,
  PagedAttentionMetadata,
  fp8_row_scales,
  is_fp8_pages,
  quantize_fp8,
  ragged_paged_attention_xla,
  write_kv_pages,
)

#: One layer's pages (or `L` layers' with a leading axis), in the backend's layout.
KVPages = tuple[jax.Array, ...]

#: Positions read per XLA loop iteration (64 was fastest on CPU at every context measured).
XLA_CHUNK_TOKENS = 64


def xla_query_tile(num_tokens: int, num_reqs: int) -> int:
  """The XLA path's query tile for a shape bucket: per-token items when the step can only be
  (mostly) decodes (`T <= R`), tiles of 16 otherwise (measured, `paged_attention` docstring)."""
  return 1 if num_tokens <= num_reqs else 16


def xla_attention(
  q,
  pages,
  md,
  *,
  scale: float,
  kv_heads_first: bool,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  fixed_order: bool = False,
  max_context: int | None = None,
  k_scale: KVScale = 1.0,
  v_scale: KVScale = 1.0,
) -> jax.Array:
  """`ragged_paged_attention_xla` with the tuned query tile and page chunk, for `(keys, values)`
  pages `[N, block_size, K, D]` (`kv_heads_first=False`) or `[K, N, block_size, D]` (True);
  `fixed_order` its batch-invariant arithmetic, `max_context` a static loop bound, `k_scale` /
  `v_scale` fp8 pages' scales."""
  key_pages, value_pages = pages
  block_size = key_pages.shape[-2] if kv_heads_first else key_pages.shape[-3]
  return ragged_paged_attention_xla(
    q,
    key_pages,
    value_pages,
    md,
    scale=scale,
    query_tile=xla_query_tile(q.shape[0], md.block_tables.shape[0]),
    pages_per_chunk=max(1, XLA_CHUNK_TOKENS // block_size),
    kv_heads_first=kv_heads_first,
    sliding_window=sliding_window,
    soft_cap=soft_cap,
    fixed_order=fixed_order,
    max_context=max_context,
    k_scale=k_scale,
    v_scale=v_scale,
  )


def check_kv_scale(name: str, value: Any) -> float:
  """`value` as a float, for a per-tensor fp8 scale field `name` (`k_scale`, `v_scale`).

  Raises:
    ValueError: `value` is not a finite number > 0 (naming the field and value).
  """
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not number or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
  return float(value)


class AttentionBackend(abc.ABC):
  """Paged attention on one kind of device: page layout, write, ragged attention."""

  name: str
  #: The axis of every page array (of one layer) that holds the key/value heads.
  kv_head_axis: int
  #: Whether `attention` takes a `sliding_window`.
  supports_sliding_window: bool = True
  #: Whether `attention` takes a `soft_cap`.
  supports_soft_cap: bool = True
  #: The `jax.default_backend()` platforms the backend runs on (None: any).
  platforms: tuple[str, ...] | None = None

  def check_platform(self, platform: str) -> None:
    """Refuses a platform the backend's kernel cannot run on (host side, before any device
    work; a Pallas kernel would otherwise fail at the first step, deep inside JAX).

    Raises:
      ValueError: naming the backend, the platform and what to use instead.
    """
    if self.platforms is not None and platform not in self.platforms:
      raise ValueError(
        f"attention_backend={self.name!r} runs on {' / '.join(self.platforms)}, not on "
        f"{platform!r}: use attention_backend='xla' or None (the platform's default)"
      )

  def check_sliding_window(self, sliding_window: int | None) -> None:
    """Refuses a model's sliding window this backend cannot apply (host side, before any
    device work).

    Raises:
      ValueError: `sliding_window` is set and the backend has no sliding window (naming both).
    """
    if sliding_window is not None and not self.supports_sliding_window:
      raise ValueError(
        f"attention_backend={self.name!r} has no sliding-window attention, got "
        f"sliding_window={sliding_window}: use attention_backend='xla' (or 'pallas_tpu' on TPU)"
      )

  def check_soft_cap(self, soft_cap: float | None) -> None:
    """Refuses a model's attention logit soft cap this backend cannot apply (host side, before
    any device work).

    Raises:
      ValueError: `soft_cap` is set and the backend has no soft cap (naming both).
    """
    if soft_cap is not None and not self.supports_soft_cap:
      raise ValueError(
        f"attention_backend={self.name!r} has no attention logit soft-capping, got "
        f"soft_cap={soft_cap}: use attention_backend='xla' (or 'pallas_tpu' on TPU)"
      )

  def check_kv_cache_dtype(self, dtype: Any, devices: Sequence[Any]) -> None:
    """Refuses a cache dtype the backend's kernel cannot read on `devices` (host side, before
    any device work); every backend reads every dtype unless it says otherwise.

    Raises:
      ValueError: naming `kv_cache_dtype`, the backend and what prevents it.
    """
    del dtype, devices  # no limit here

  @abc.abstractmethod
  def page_arrays(
    self,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes and storage dtypes of one layer's page arrays (`N = num_blocks`,
    `B = block_size`) for the cache dtype `dtype` (`FP8_KV_DTYPE` for fp8 pages, which each
    backend stores in its own way)."""

  def page_shapes(
    self,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's page arrays (`page_arrays`)."""
    arrays = self.page_arrays(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return tuple(a.shape for a in arrays)

  def init_pages(
    self,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
    num_layers: int | None = None,
  ) -> KVPages:
    """Zero-filled pages, each array its own buffer (so all can be donated).

    Args:
      num_blocks: pages `N`, the null page 0 included.
      block_size: positions per page `B`.
      num_kv_heads: key/value heads `K`.
      head_dim: head width `D`.
      dtype: the cache dtype (`page_arrays` gives each array's storage dtype).
      num_layers: a leading layer axis `L`, or None for one layer.
    """
    lead = () if num_layers is None else (num_layers,)
    arrays = self.page_arrays(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    return tuple(jnp.zeros((*lead, *a.shape), a.dtype) for a in arrays)

  def bytes_per_block(
    self,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> int:
    """Bytes of one page of all `L` layers in this backend's layout: `L * sum(page array size *
    its itemsize)` (keys and values, padded heads and fp8 scales included)."""
    arrays = self.page_arrays(1, block_size, num_kv_heads, head_dim, dtype)
    return num_layers * sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)

  def num_blocks_for_memory(
    self,
    kv_cache_memory_bytes: int,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> int:
    """Pages (the null page included) of all `L` layers that fit in `kv_cache_memory_bytes`.

    A page costs `bytes_per_block` bytes in this backend's layout (keys and values, padded
    heads and fp8 scales included).

    Raises:
      ValueError: the memory holds fewer than 2 pages (the null page and one usable), naming
        the bytes per page.
    """
    per_block = self.bytes_per_block(
      num_layers=num_layers,
      block_size=block_size,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      dtype=dtype,
    )
    num_blocks = int(kv_cache_memory_bytes) // per_block
    if num_blocks < 2:
      raise ValueError(
        f"kv_cache_memory_bytes={kv_cache_memory_bytes} holds {num_blocks} KV cache blocks of "
        f"{per_block} bytes ({block_size} tokens x {num_layers} layers); at least 2 are needed"
      )
    return num_blocks

  @abc.abstractmethod
  def write_kv(
    self,
    pages: KVPages,
    key: jax.Array,
    value: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array | int | None = None,
  ) -> KVPages:
    """Writes `[T, K, D]` new keys and values at `[T] int32` slots (of layer `layer` when the
    pages have a leading layer axis)."""

  @abc.abstractmethod
  def attention(
    self,
    q: jax.Array,
    pages: KVPages,
    md: PagedAttentionMetadata,
    *,
    scale: float,
    num_kv_heads: int | None = None,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
  ) -> jax.Array:
    """`[T, H, D]` causal grouped-query attention of one layer's `[T, H, D]` queries; rows of
    padding tokens are 0.

    `num_kv_heads` is the model's `K` (static), needed where the layout pads heads (TPU);
    None: the pages' own head count. `sliding_window` `W` (static): a query at position `p`
    sees only `p - W < s <= p`; None: all `s <= p`. `soft_cap` `c` (static): scaled scores `s`
    become `c * tanh(s / c)` before masking; None: no cap. Raises `ValueError` (at trace time)
    for a window where `supports_sliding_window` is False, or a cap where `supports_soft_cap`
    is."""


@dataclasses.dataclass(frozen=True)
class XlaAttentionBackend(AttentionBackend):
  """Pure XLA (`ragged_paged_attention_xla`); pages `([N, B, K, D] keys, [N, B, K, D] values)`,
  fp8 pages as their bits (`FP8_KV_STORAGE`: XLA:CPU has no float8 arithmetic).

  Attributes:
    fixed_order: the batch-invariant arithmetic (`ragged_paged_attention_xla`'s
      ``fixed_order``): a query's output bits do not depend on the rest of the step.
    max_context: None, or a static bound on every request's context: a loop of static length,
      differentiable in reverse mode (`jaxengine.models.token_logprobs` sets it).
    k_scale: fp8 keys are stored as `key / k_scale` (clipped to fp8's range) and read back
      times `k_scale` (vLLM's per-tensor scale; 1.0, vLLM's value for a checkpoint without
      one). Unused for other page dtypes.
    v_scale: the same for values.
  """

  fixed_order: bool = False
  max_context: int | None = None
  k_scale: float = 1.0
  v_scale: float = 1.0
  name = "xla"
  kv_head_axis = 2

  def __post_init__(self) -> None:
    _set_kv_scales(self)

  def page_arrays(self, num_blocks, block_size, num_kv_heads, head_dim, dtype=jnp.float32):
    storage = FP8_KV_STORAGE if is_fp8_pages(dtype) else dtype
    array = jax.ShapeDtypeStruct((num_blocks, block_size, num_kv_heads, head_dim), storage)
    return array, array

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    key_pages, value_pages = pages
    return (
      write_kv_pages(key_pages, key, slot_mapping, layer, scale=self.k_scale),
      write_kv_pages(value_pages, value, slot_mapping, layer, scale=self.v_scale),
    )

  def attention(
    self, q, pages, md, *, scale, num_kv_heads=None, sliding_window=None, soft_cap=None
  ):
    return xla_attention(
      q,
      pages,
      md,
      scale=scale,
      kv_heads_first=False,
      sliding_window=sliding_window,
      soft_cap=soft_cap,
      fixed_order=self.fixed_order,
      max_context=self.max_context,
      k_scale=self.k_scale,
      v_scale=self.v_scale,
    )


def _set_kv_scales(backend: AttentionBackend) -> None:
  """Checks a frozen backend's `k_scale` and `v_scale` (`check_kv_scale`), then stores them as
  floats (the TPU kernel takes only floats)."""
  scales = {name: check_kv_scale(name, getattr(backend, name)) for name in ("k_scale", "v_scale")}
  for name, value in scales.items():
    object.__setattr__(backend, name, value)


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
    _set_kv_scales(self)

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


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
  "xla": XlaAttentionBackend,
  "pallas_tpu": PallasTpuAttentionBackend,
  "pallas_gpu": PallasGpuAttentionBackend,
}

#: The names `attention_backend` accepts.
BACKEND_NAMES = tuple(_BACKENDS)

#: The backend each platform gets when `attention_backend` is None.
DEFAULT_BACKEND = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}


def attention_backend(name: str | None = None, *, platform: str | None = None) -> AttentionBackend:
  """The paged attention backend named `name`, or the platform's default.

  Args:
    name: `"xla"`, `"pallas_tpu"`, `"pallas_gpu"`, or None to choose from the platform.
    platform: the platform to choose for (default `jax.default_backend()`): `"tpu"` gets the
      ragged paged kernel, `"gpu"` the Pallas decode kernel with XLA prefill, anything else XLA.

  Raises:
    ValueError: an unknown name (the message lists the known ones).
  """
  if name is None:
    name = DEFAULT_BACKEND.get(platform or jax.default_backend(), "xla")
  if name not in _BACKENDS:
    raise ValueError(f"attention_backend must be one of {sorted(_BACKENDS)} or None, got {name!r}")
  return _BACKENDS[name]()
