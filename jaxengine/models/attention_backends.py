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
  call. Its pages hold keys and values together, `[N, B, 2 * K', 128]` with key head `k` at
  `2 * k` and value head `k` at `2 * k + 1` (`K' >= K` and narrower heads zero-padded so that
  they tile; the XLA backend's pages and attention for heads wider than 128, which the kernel
  refuses: `attention_pallas_tpu`); `kv_lens` are our `seq_lens`, `page_indices` our
  `block_tables`, `cu_q_lens` our `query_start_loc`, `num_seqs` our `num_reqs` as `[1] int32`.
* `"pallas_gpu"` (`PallasGpuAttentionBackend`): JAX's Pallas paged decode kernel
  `jax.experimental.pallas.ops.gpu.paged_attention.paged_attention(q, k_pages, v_pages,
  block_tables, lengths, *, block_h, pages_per_compute_block, k_splits, interpret, ...)` (one
  query token per sequence, no softmax scale: queries are pre-scaled) when every request of the
  step has at most one query token, the XLA path otherwise (prefill chunks). Its pages are
  `[K, N, B, D]` for keys and for values.

`attention_backend(None)` picks the backend of `jax.default_backend()`. This module is the
chooser; the contract lives in `attention_contract`, each backend in its own module
(`attention_xla`, `attention_pallas_tpu`, `attention_pallas_gpu`), and every name is re-exported
here.

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

from collections.abc import Callable

import jax

from jaxengine.models.attention_contract import (
  AttentionBackend,
  KVPages,
  check_kv_scale,
)
from jaxengine.models.attention_pallas_gpu import FP8_MIN_CUDA_CAPABILITY, PallasGpuAttentionBackend
from jaxengine.models.attention_pallas_tpu import PallasTpuAttentionBackend, tpu_kv_heads
from jaxengine.models.attention_xla import (
  XLA_CHUNK_TOKENS,
  XlaAttentionBackend,
  xla_attention,
  xla_query_tile,
)

__all__ = [
  "BACKEND_NAMES",
  "DEFAULT_BACKEND",
  "FP8_MIN_CUDA_CAPABILITY",
  "XLA_CHUNK_TOKENS",
  "AttentionBackend",
  "KVPages",
  "PallasGpuAttentionBackend",
  "PallasTpuAttentionBackend",
  "XlaAttentionBackend",
  "attention_backend",
  "check_kv_scale",
  "tpu_kv_heads",
  "xla_attention",
  "xla_query_tile",
]

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
