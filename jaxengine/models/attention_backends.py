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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxengine.models.paged_attention import (
  PagedAttentionMetadata,
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
) -> jax.Array:
  """`ragged_paged_attention_xla` with the tuned query tile and page chunk, for pages
  `[N, block_size, K, D]` (`kv_heads_first=False`) or `[K, N, block_size, D]` (True);
  `fixed_order` its batch-invariant arithmetic, `max_context` a static loop bound."""
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
  )


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

  @abc.abstractmethod
  def page_shapes(
    self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
  ) -> tuple[tuple[int, ...], ...]:
    """Shapes of one layer's page arrays (`N = num_blocks`, `B = block_size`)."""

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
      dtype: storage dtype.
      num_layers: a leading layer axis `L`, or None for one layer.
    """
    lead = () if num_layers is None else (num_layers,)
    shapes = self.page_shapes(num_blocks, block_size, num_kv_heads, head_dim)
    return tuple(jnp.zeros((*lead, *shape), dtype) for shape in shapes)

  def bytes_per_block(
    self,
    *,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = jnp.float32,
  ) -> int:
    """Bytes of one page of all `L` layers in this backend's layout: `L * sum(page array sizes)
    * itemsize` (keys and values, padded heads included)."""
    shapes = self.page_shapes(1, block_size, num_kv_heads, head_dim)
    return num_layers * jnp.dtype(dtype).itemsize * sum(math.prod(s) for s in shapes)

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

    A page costs `L * sum(page array sizes) * itemsize` bytes in this backend's layout (keys
    and values, padded heads included).

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
  """Pure XLA (`ragged_paged_attention_xla`); pages `([N, B, K, D] keys, [N, B, K, D] values)`.

  Attributes:
    fixed_order: the batch-invariant arithmetic (`ragged_paged_attention_xla`'s
      ``fixed_order``): a query's output bits do not depend on the rest of the step.
    max_context: None, or a static bound on every request's context: a loop of static length,
      differentiable in reverse mode (`jaxengine.models.token_logprobs` sets it).
  """

  fixed_order: bool = False
  max_context: int | None = None
  name = "xla"
  kv_head_axis = 2

  def page_shapes(self, num_blocks, block_size, num_kv_heads, head_dim):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return shape, shape

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    key_pages, value_pages = pages
    return (
      write_kv_pages(key_pages, key, slot_mapping, layer),
      write_kv_pages(value_pages, value, slot_mapping, layer),
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
    )


def _tpu_kernel() -> Callable[..., jax.Array]:
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

  return ragged_paged_attention


def tpu_kv_heads(num_kv_heads: int) -> int:
  """Key/value heads the TPU kernel's pages hold: `K` rounded up so that its `2K` combined heads
  tile (the kernel raises "can not be XLA fully tiled" otherwise, e.g. for SmolLM2's `K = 3`):
  1, 2, 4, 8 or a multiple of 8 works for float32 and bfloat16 pages alike."""
  if num_kv_heads in (1, 2, 4) or num_kv_heads % 8 == 0:
    return num_kv_heads
  return 1 << (num_kv_heads - 1).bit_length() if num_kv_heads < 8 else -(-num_kv_heads // 8) * 8


@dataclasses.dataclass(frozen=True)
class PallasTpuAttentionBackend(AttentionBackend):
  """JAX's TPU ragged paged attention kernel; pages `([N, B, 2K', D] keys and values,)` with
  `K' = tpu_kv_heads(K)` (heads past `K` hold zeros; their queries are dropped).

  Attributes:
    kernel: a function with the kernel's signature (tests pass its reference function); None
      imports `ragged_paged_attention` on first use.
  """

  kernel: Callable[..., jax.Array] | None = None
  name = "pallas_tpu"
  kv_head_axis = 2
  platforms = ("tpu",)

  def check_platform(self, platform: str) -> None:
    """Any platform with a `kernel` of one's own (tests pass the reference function)."""
    if self.kernel is None:
      super().check_platform(platform)

  def page_shapes(self, num_blocks, block_size, num_kv_heads, head_dim):
    return ((num_blocks, block_size, 2 * tpu_kv_heads(num_kv_heads), head_dim),)

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    (kv_pages,) = pages
    num_tokens, num_kv_heads, head_dim = key.shape
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
      # Only when set: a `kernel` of one's own without the argument serves uncapped models.
      **({} if soft_cap is None else {"soft_cap": soft_cap}),
    )
    out = out[:, :num_heads].astype(q.dtype)
    # The kernel leaves rows past the last request's tokens undefined.
    real = jnp.arange(num_tokens) < md.query_start_loc[md.num_reqs]
    return jnp.where(real[:, None, None], out, 0)


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


@dataclasses.dataclass(frozen=True)
class PallasGpuAttentionBackend(AttentionBackend):
  """JAX's GPU Pallas paged decode kernel, XLA for steps with prefill chunks; pages
  `([K, N, B, D] keys, [K, N, B, D] values)`.

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

  def page_shapes(self, num_blocks, block_size, num_kv_heads, head_dim):
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    return shape, shape

  def write_kv(self, pages, key, value, slot_mapping, layer=None):
    block_size = pages[0].shape[-2]
    page, offset = slot_mapping // block_size, slot_mapping % block_size
    if layer is None:  # adjacent array indices: the indexed block is [K, T, D]
      return tuple(
        p.at[:, page, offset].set(jnp.swapaxes(new, 0, 1).astype(p.dtype))
        for p, new in zip(pages, (key, value))
      )
    # `layer` and the arrays are split by a slice: NumPy's rule moves [T] first, [T, K, D].
    return tuple(
      p.at[layer, :, page, offset].set(new.astype(p.dtype)) for p, new in zip(pages, (key, value))
    )

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

    key_pages, value_pages = pages
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
      k_splits=k_splits,
      pages_per_compute_block=_largest_divisor(pages_per_req // k_splits, 8),
      interpret=self.interpret,
    )
    return jnp.zeros_like(q).at[jnp.where(has_token, first, num_tokens)].set(out, mode="drop")

  def _xla(self, q, pages, md, scale):
    return xla_attention(q, pages, md, scale=scale, kv_heads_first=True)


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
