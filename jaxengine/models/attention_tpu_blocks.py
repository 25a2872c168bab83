"""Block sizes of JAX's TPU ragged paged attention kernel, chosen without querying local devices.

The kernel (`jax.experimental.pallas.ops.tpu.ragged_paged_attention.ragged_paged_attention`)
walks each request's pages `num_kv_pages_per_block` at a time and its queries
`num_queries_per_block` at a time. Left unset, it looks both up in its tuned table keyed by
`jax.devices()[0].device_kind`, which fails when compiling for a TPU topology on a machine
without one ("TPU version must be 4 or higher"). `tpu_block_sizes` reads the same table for the
device being compiled for (`jaxengine.models.target_device.target_device_kind`) and otherwise
takes the kernel's own defaults (128 pages and 32 queries; 32 and 32 on TPU v4), with the
double-buffered key/value block held under `KV_BUFFER_BYTES` of VMEM: the default 128 pages of
16 positions x 16 combined heads x 128 lanes of bfloat16 would take 16 MiB, all of TPU v5e's
default scoped VMEM, before the queries, the accumulator and the softmax statistics.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

#: Largest VMEM bytes of the kernel's two key/value buffers (`2 * pages * B * 2K_blk * D`) when
#: the tuned table has no entry: half of TPU v5e's (and v4's) 16 MiB default scoped VMEM, so
#: the query and output blocks, the float32 accumulator and the softmax statistics fit beside.
KV_BUFFER_BYTES = 8 << 20

#: The kernel's untuned defaults (its `get_tuned_block_sizes`): pages per key/value block on
#: TPU v5 and later / on TPU v4, and queries per block.
DEFAULT_KV_PAGES, DEFAULT_KV_PAGES_V4, DEFAULT_QUERIES = 128, 32, 32


def kernel_heads_per_block(
  num_q_heads: int, num_combined_kv_heads: int, q_dtype: Any, kv_dtype: Any
) -> tuple[int, int]:
  """The query heads and combined key/value heads the kernel reads per block (its
  `get_min_heads_per_blk`).

  Raises:
    ValueError: the combined heads do not tile (`tpu_kv_heads` pads them so that they do).
  """
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
    get_min_heads_per_blk,
  )

  return get_min_heads_per_blk(num_q_heads, num_combined_kv_heads, q_dtype, kv_dtype)


def tpu_block_sizes(
  *,
  q_dtype: Any,
  kv_dtype: Any,
  num_q_heads: int,
  num_combined_kv_heads: int,
  head_dim: int,
  page_size: int,
  num_tokens: int,
  pages_per_seq: int,
  device_kind: str | None,
) -> tuple[int, int]:
  """`(num_kv_pages_per_block, num_queries_per_block)` for one call of the kernel.

  Args:
    q_dtype: the queries' dtype.
    kv_dtype: the pages' dtype.
    num_q_heads: query heads of the call (padded as the kernel gets them).
    num_combined_kv_heads: the pages' `2K'` combined key/value heads.
    head_dim: the pages' head width (128 for the kernel).
    page_size: positions per page `B`.
    num_tokens: the call's query rows `T`.
    pages_per_seq: the block table's width `P` (the kernel needs at most that many pages per
      block).
    device_kind: the target TPU's `device_kind` ("TPU v5 lite"), or None (untuned defaults).

  Returns:
    The tuned table's entry for the device and shape when it has one, else the kernel's
    defaults with the key/value buffers under `KV_BUFFER_BYTES`; pages at most `pages_per_seq`,
    queries at most `num_tokens`.
  """
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes import (
    TUNED_BLOCK_SIZES,
    simplify_key,
  )

  q_heads_blk, combined_blk = kernel_heads_per_block(
    num_q_heads, num_combined_kv_heads, q_dtype, kv_dtype
  )
  kv_pages, queries = DEFAULT_KV_PAGES, DEFAULT_QUERIES
  tuned = None
  if device_kind is not None:
    table = TUNED_BLOCK_SIZES.get(" ".join(device_kind.split()[:2]), {})
    key = (q_dtype, kv_dtype, q_heads_blk, combined_blk // 2, head_dim, page_size)
    tuned = table.get(simplify_key((*key, num_tokens, pages_per_seq)))
    if device_kind.startswith("TPU v4"):
      kv_pages = DEFAULT_KV_PAGES_V4
  if tuned is not None:
    kv_pages, queries = tuned
  else:
    per_page = 2 * page_size * combined_blk * head_dim * jnp.dtype(kv_dtype).itemsize
    while kv_pages > 1 and kv_pages * per_page > KV_BUFFER_BYTES:
      kv_pages //= 2
  return min(pages_per_seq, kv_pages), min(num_tokens, queries)
