"""The pure XLA paged attention backend (`XlaAttentionBackend`, the CPU default) and the XLA
path the GPU backend shares for prefill steps (`xla_attention`).

Keys and values are `[N, B, K, D]` each, read by `paged_attention.ragged_paged_attention_xla`
with a query tile and page chunk tuned per shape bucket; fp8 pages are stored as their bits
(`FP8_KV_STORAGE`: XLA:CPU has no float8 arithmetic) scaled by a per-tensor `k_scale` /
`v_scale`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxengine.models.attention_contract import AttentionBackend, set_kv_scales
from jaxengine.models.paged_attention import (
  FP8_KV_STORAGE,
  KVScale,
  is_fp8_pages,
  ragged_paged_attention_xla,
  write_kv_pages,
)

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
    set_kv_scales(self)

  def describe(self, spec, num_heads):
    """XLA paged attention, with its batch-invariant order when set."""
    del spec, num_heads  # every shape alike
    return "XLA paged attention" + (" (batch-invariant order)" if self.fixed_order else "")

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
