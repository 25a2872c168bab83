"""Attention over a paged KV cache, in pure JAX/XLA: the step's metadata, the write, the read.

A paged cache stores keys and values in `num_blocks` pages of `block_size` token positions
(`[N, B, K, D]` per layer; `N` pages, `B` positions per page). Position `p` of a request lives in
page `block_tables[r, p // B]` at offset `p % B`; the host decides which pages a request owns
(`core/kv_cache_manager.py`). One step computes a flat, ragged batch of `T` query tokens: the
tokens of request `r` are `q[query_start_loc[r] : query_start_loc[r + 1]]`, the last of its
`seq_lens[r]` context tokens (a decode token, a prefill chunk after earlier chunks, or draft
tokens), so prefill and decode run in the same call (vLLM V1's ragged step).

Shape legend: `T` query tokens of the step (padded bucket), `R` requests (padded bucket), `H` query
heads, `K` key/value heads (`H % K == 0`, grouped-query attention), `D` head width, `N` pages,
`B` block size, `P` block-table width (pages per request, a bucket of the step's longest context),
`S = P * B` context positions per request.

`ragged_paged_attention_xla` is the CPU path. It cuts every request's queries into work items
of `query_tile` tokens (a request of `q` tokens makes `ceil(q / query_tile)` of them) and reads
each item's pages `pages_per_chunk` at a time with an online softmax, for as many chunks as the
step's longest context needs. `query_tile=1` wastes no query rows (decode), larger tiles share
each page read among more queries (prefill chunks). Milliseconds per call (one layer, jitted,
median of 10 interleaved calls, `benchmarks/bench_paged_attention.py`) on the shared 2-core Xeon
it was written on, under a load average of about 8, SmolLM2-135M heads (`H=9, K=3, D=64`),
float32, `B=16`; `tT/cC` is `query_tile=T, pages_per_chunk=C`, "slot" the dense
decode attention over `[R, S, K, D]` rows (no gather) of the slot cache this replaced:

  ============================  ====  ====  =====  =====  =====  ======  ======  ======  =====
  step                           T     S    t1/c2  t1/c4  t1/c8  t16/c4  t64/c4  t64/c8  slot
  ============================  ====  ====  =====  =====  =====  ======  ======  ======  =====
  decode R=8                       8    64   0.78   1.10   0.87    2.84    8.14   12.09   0.59
  decode R=8                       8   256   2.04   2.37   1.50    7.95   27.95   26.94   3.11
  decode R=8                       8  1024   8.15   8.27   7.84   18.42   63.47   58.98  14.31
  decode R=32                     32    64   4.58   3.56   7.57    8.45   32.29   87.48   3.98
  decode R=32                     32   256  11.23  12.46   9.86   30.92  125.89  147.64  14.85
  decode R=32                     32  1024  43.99  33.68  36.87  125.47  508.33  508.37 104.85
  7 decodes + chunk of 248       256   512      -      -      -   47.21   82.43   76.87      -
  prefill chunk of 512           512   512      -      -      -   63.79   58.76   56.13      -
  prefill 4 x 128                512   128      -      -      -    9.72   12.95   11.62      -
  ============================  ====  ====  =====  =====  =====  ======  ======  ======  =====

Per-token items with 64-position chunks (`t1/c4`) match the slot cache's decode at short contexts
and beat it from 256 positions on (the dense form's `[R, K, G, S]` scores leave the cache); tiles
of 16 serve mixed steps best and long prefill chunks within 15% of the best. The backends
(`attention_backends.xla_query_tile`) use `t1` when `T <= R`, `t16` otherwise, and 64-position
chunks.

Sliding-window attention (Mistral): with `sliding_window=W` a query at position `p` sees only
positions `p - W < s <= p`. Each work item then starts reading at the chunk holding its first
query's window start, and the loop runs for the most chunks any item's window and queries span
(about `(W + Tq) / chunk + 1` instead of the longest context's chunks), so pages entirely before
every window are never read: decode R=8 at S=1024 with `W=128` took 0.71 ms against 4.51 ms
without a window (`t1/c4`, median of 10 interleaved calls, load average about 4). The engine
frees the pages that slid out of every window (KV cache groups, `jaxengine.core.kv_cache_groups`):
their block-table entries become the null page, which the window mask hides anyway.

fp8 pages (``kv_cache_dtype="fp8"``, `is_fp8_pages`): `write_kv_pages` stores `x / scale`
clipped to float8_e4m3fn's +-448 (`quantize_fp8`; a larger value would be NaN), as
`FP8_KV_DTYPE` or as its bits (`FP8_KV_STORAGE`, the XLA backend's); the read converts the rows a
chunk needs to float32, multiplies them by their scale and casts them to the query's dtype. A
scale is per tensor (vLLM's static `k_scale` / `v_scale`) or per position and head (an array
beside the pages, the GPU backend's: `fp8_row_scales`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxengine.models.layers import soft_cap_scores
from jaxengine.reductions import fixed_sum

#: Score of a masked position: finite, so a query that sees nothing yields no NaN.
NEG_INF = float(jnp.finfo(jnp.float32).min)

#: Slot of the null page (block 0, offset 0): padding tokens write their keys and values here.
NULL_SLOT = 0

#: The fp8 format of ``kv_cache_dtype="fp8"`` and its largest finite value: keys and values are
#: clipped to it before the cast (float8_e4m3fn has no infinity: an overflow is NaN).
FP8_KV_DTYPE = jnp.float8_e4m3fn
FP8_KV_MAX = float(jnp.finfo(FP8_KV_DTYPE).max)
#: The XLA backend's storage dtype of fp8 pages: their float8_e4m3fn bits as bytes. XLA:CPU has
#: no float8 arithmetic and widened every float8 gather and scatter over the whole pool (a step's
#: time grew with the pool's size); only the rows a step writes or reads are converted this way.
#: The Pallas backends store `FP8_KV_DTYPE` itself (their kernels read it).
FP8_KV_STORAGE = jnp.uint8

#: A per-tensor scale (vLLM's ``k_scale`` / ``v_scale``: a Python float, static) or per-position
#: scales (an array with the pages' shape less the head width: ``[N, B, K]``, or ``[K, N, B]``
#: with heads first).
KVScale = float | jax.Array


def is_fp8_pages(dtype) -> bool:
  """Whether pages of `dtype` hold fp8 values: `FP8_KV_DTYPE` itself or its bits as
  `FP8_KV_STORAGE`."""
  return jnp.dtype(dtype) in (jnp.dtype(FP8_KV_DTYPE), jnp.dtype(FP8_KV_STORAGE))


def quantize_fp8(x: jax.Array, scale: KVScale = 1.0) -> jax.Array:
  """`x / scale` clipped to +-`FP8_KV_MAX` and cast to `FP8_KV_DTYPE` (a value past the range
  would otherwise become NaN).

  Args:
    x: `[..., D]` keys or values, any float dtype.
    scale: a per-tensor float, or `[...]` float32 scales (one per row of `D`).

  Returns:
    `[..., D]` float8_e4m3fn; `x` is about `result * scale`.
  """
  if not isinstance(scale, float) or scale != 1.0:
    x = x / (scale if isinstance(scale, float) else scale[..., None])
  return jnp.clip(x, -FP8_KV_MAX, FP8_KV_MAX).astype(FP8_KV_DTYPE)


def fp8_row_scales(x: jax.Array) -> jax.Array:
  """`[...]` float32 scales of `[..., D]` rows, `max|x| / FP8_KV_MAX` each (1.0 for a row of
  zeros), so that `quantize_fp8(x, scales)` uses fp8's whole range without clipping."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
  return jnp.where(amax > 0, amax / FP8_KV_MAX, 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionMetadata:
  """Where a ragged step's tokens come from and go to (vLLM V1's attention metadata names).

  Every field is an int32 array so that one executable serves every step of a shape bucket.

  Attributes:
    slot_mapping: `[T] int32` cache slot of each query token, `page * B + offset`; padding tokens
      map to `NULL_SLOT`.
    block_tables: `[R, P] int32` pages of each request in order; unused entries and padding rows
      are 0 (the null page), never read past `seq_lens`.
    query_start_loc: `[R + 1] int32` cumulative query tokens: request `r`'s tokens are
      `query_start_loc[r] : query_start_loc[r + 1]`; padding requests repeat the last value.
    seq_lens: `[R] int32` context tokens of each request including this step's (`>=` its query
      tokens); 0 for padding requests.
    num_reqs: `[] int32` real requests (rows `num_reqs:` are padding).
    state_slots: None, or (a hybrid model's step: `jaxengine.models.gated_deltanet`) `[R] int32`
      each request's recurrent state slot (0, the null slot, for padding requests).
  """

  slot_mapping: jax.Array
  block_tables: jax.Array
  query_start_loc: jax.Array
  seq_lens: jax.Array
  num_reqs: jax.Array
  state_slots: jax.Array | None = None

  @property
  def query_lens(self) -> jax.Array:
    """`[R] int32` query tokens of each request this step (0 for padding requests)."""
    lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
    return jnp.where(jnp.arange(lens.shape[0]) < self.num_reqs, lens, 0)


def write_kv_pages(
  pages: jax.Array,
  new: jax.Array,
  slot_mapping: jax.Array,
  layer: jax.Array | int | None = None,
  *,
  scale: float = 1.0,
) -> jax.Array:
  """Scatters the step's new keys (or values) into their cache slots.

  Args:
    pages: `[N, B, K, D]` pages of one layer, or `[L, N, B, K, D]` with `layer` given.
    new: `[T, K, D]` this step's keys or values, cast to the pages' dtype; for fp8 pages
      (`is_fp8_pages`) `quantize_fp8(new, scale)`, stored as is (`FP8_KV_DTYPE`) or as its bits
      (`FP8_KV_STORAGE`).
    slot_mapping: `[T] int32` slots (`page * B + offset`); padding tokens point at `NULL_SLOT`,
      whose contents are never read.
    layer: index into a leading layer axis of `pages`, or None for one layer's pages.
    scale: fp8 pages' per-tensor scale (static; the reader multiplies it back); unused for
      other dtypes.

  Returns:
    `pages` with the new rows written (in place when `pages` is donated).
  """
  block_size = pages.shape[-3]
  page, offset = slot_mapping // block_size, slot_mapping % block_size
  if is_fp8_pages(pages.dtype):
    new = quantize_fp8(new, scale)
    if pages.dtype == FP8_KV_STORAGE:  # the float8_e4m3fn bits
      new = jax.lax.bitcast_convert_type(new, FP8_KV_STORAGE)
  return _scatter(pages, new.astype(pages.dtype), page, offset, layer)


def _scatter(pages, new, page, offset, layer) -> jax.Array:
  """`pages` with `new` at `(page, offset)` rows (of layer `layer` when given)."""
  if layer is None:
    return pages.at[page, offset].set(new)
  return pages.at[layer, page, offset].set(new)


@dataclasses.dataclass(frozen=True)
class _WorkItems:
  """The step's queries cut into `W` tiles of `Tq` tokens, each within one request."""

  req: jax.Array  # [W] int32 request of each item (clipped to R - 1 for unused items)
  token: jax.Array  # [W, Tq] int32 flat query index, T where the entry is unused
  position: jax.Array  # [W, Tq] int32 context position of each query


def num_work_items(num_tokens: int, num_reqs: int, query_tile: int) -> int:
  """Static bound on the work items of a step: `sum_r ceil(q_r / Tq)` over at most
  `min(R, T)` requests with `sum_r q_r <= T`."""
  return max(1, (num_tokens + min(num_reqs, num_tokens) * (query_tile - 1)) // query_tile)


def _work_items(md: PagedAttentionMetadata, num_tokens: int, query_tile: int) -> _WorkItems:
  num_reqs = md.block_tables.shape[0]
  query_lens = md.query_lens
  num_tiles = -(-query_lens // query_tile)  # [R]
  tiles_end = jnp.cumsum(num_tiles)  # [R]
  item = jnp.arange(num_work_items(num_tokens, num_reqs, query_tile), dtype=jnp.int32)
  req = jnp.minimum(jnp.searchsorted(tiles_end, item, side="right"), num_reqs - 1)  # [W]
  tile = item - (tiles_end - num_tiles)[req]  # [W] tile index within its request
  offset = tile[:, None] * query_tile + jnp.arange(query_tile, dtype=jnp.int32)  # [W, Tq]
  valid = (item < tiles_end[-1])[:, None] & (offset < query_lens[req][:, None])
  token = jnp.where(valid, md.query_start_loc[req][:, None] + offset, num_tokens)
  position = (md.seq_lens - query_lens)[req][:, None] + offset
  return _WorkItems(req=req, token=token, position=position)


@dataclasses.dataclass(frozen=True)
class _ChunkSpan:
  """The chunks of `chunk_len` positions each work item reads: `first[w]` onwards, for
  `num_chunks` loop iterations (the most any item needs)."""

  first: jax.Array  # [W] int32 chunk holding the item's first visible position
  num_chunks: jax.Array  # [] int32

  @classmethod
  def of(
    cls, items: _WorkItems, seq_lens: jax.Array, chunk_len: int, sliding_window: int | None
  ) -> _ChunkSpan:
    end = -(-seq_lens[items.req] // chunk_len)  # [W] chunks up to the request's last position
    if sliding_window is None:
      first = jnp.zeros_like(end)
    else:
      first = jnp.maximum(items.position[:, 0] - sliding_window + 1, 0) // chunk_len
    return cls(first=first, num_chunks=jnp.max(end - first, initial=0))


def _read_pages(
  pages: jax.Array, ids: jax.Array, kv_heads_first: bool, dtype, scale: KVScale
) -> jax.Array:
  """`[W, C * B, K, D]` rows of pages `ids [W, C]` in `dtype`; fp8 pages (`is_fp8_pages`) times
  their `scale` (per tensor, or `[N, B, K]` / `[K, N, B]` per position), in float32 first."""
  rows = _gather(pages, ids, kv_heads_first)  # [W, C, B, K, D]
  if is_fp8_pages(pages.dtype):
    if pages.dtype == FP8_KV_STORAGE:
      rows = jax.lax.bitcast_convert_type(rows, FP8_KV_DTYPE)
    if isinstance(scale, float) and scale == 1.0:
      rows = rows.astype(dtype)  # exact: every fp8 value is a bfloat16 and a float32
    elif isinstance(scale, float):
      rows = (rows.astype(jnp.float32) * scale).astype(dtype)
    else:
      scales = _gather(scale, ids, kv_heads_first)  # [W, C, B, K]
      rows = (rows.astype(jnp.float32) * scales[..., None]).astype(dtype)
  num_items, num_pages, block_size, num_kv_heads, head_dim = rows.shape
  return rows.reshape(num_items, num_pages * block_size, num_kv_heads, head_dim)


def _gather(pages: jax.Array, ids: jax.Array, kv_heads_first: bool) -> jax.Array:
  """`[W, C, B, K, ...]` entries of pages `ids [W, C]` from `[N, B, K, ...]` (or, heads first,
  `[K, N, B, ...]`) arrays."""
  if not kv_heads_first:
    return pages[ids]
  return jnp.moveaxis(pages[:, ids], 0, 3)  # [K, W, C, B, ...] -> [W, C, B, K, ...]


def ragged_paged_attention_xla(
  q: jax.Array,
  key_pages: jax.Array,
  value_pages: jax.Array,
  md: PagedAttentionMetadata,
  *,
  scale: float,
  query_tile: int = 1,
  pages_per_chunk: int = 4,
  kv_heads_first: bool = False,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
  fixed_order: bool = False,
  max_context: int | None = None,
  k_scale: KVScale = 1.0,
  v_scale: KVScale = 1.0,
) -> jax.Array:
  """Causal grouped-query attention of a ragged step over paged keys and values, in XLA.

  Query `i` of request `r` sits at context position `seq_lens[r] - query_lens[r] + i` and attends
  to positions `0 ..` that one of the same request (its keys and values already written by
  `write_kv_pages`); with `sliding_window` `W`, to the last `W` of them (`p - W < s <= p`).
  Keys and values are read `pages_per_chunk` pages at a time with an online softmax (running
  maximum and sum, as in flash attention: Dao et al., 2022), for only as many chunks as the
  step's longest context (or widest window) needs, so a wide block-table bucket costs nothing
  and a chunk's keys stay in cache while it is used. Scores and the softmax are float32.

  Args:
    q: `[T, H, D]` queries (rotary embedding applied), any float dtype.
    key_pages: `[N, B, K, D]` one layer's keys (`[K, N, B, D]` with `kv_heads_first`).
    value_pages: `[N, B, K, D]` one layer's values (`[K, N, B, D]` with `kv_heads_first`).
    md: the step's `PagedAttentionMetadata` (`R` requests, `P` pages per request).
    scale: softmax scale (usually `D ** -0.5`).
    query_tile: query tokens per work item (static; a performance knob: any value `>= 1` gives
      the same result).
    pages_per_chunk: pages read per loop iteration (static; a performance knob).
    kv_heads_first: the pages are `[K, N, B, D]` (the GPU Pallas kernel's layout).
    sliding_window: `W` (static), or None for full causal attention. Pages before a work item's
      window are skipped (the engine may have freed them: module docstring).
    soft_cap: `c` (static), or None: each scaled score `s` becomes `c * tanh(s / c)` before
      masking (attention logit soft-capping, Gemma 2).
    fixed_order: batch-invariant arithmetic (static): each query's scores, its weights' sum and
      its weighted sum of values are float32 elementwise products summed by
      `jaxengine.reductions.fixed_sum` (no matrix product or XLA reduction, whose order XLA
      picks by shape), chunk by chunk in absolute position order. A query's output is then
      the same bits whatever the step's other queries, its query tile, the chunks other items
      need, and whether its context was written by this step or earlier ones: a chunk it sees
      nothing of is an exact no-op (weights exactly 0 beside a real maximum, or rescaled by
      exactly 0 before its first real chunk). Used by ``LLM(..., batch_invariant=True)`` and
      `jaxengine.models.token_logprobs`.
    max_context: None, or a static bound on every request's `seq_lens`: the chunk loop then
      runs `ceil(max_context / chunk)` iterations, a static count, so the attention can be
      differentiated in reverse mode (`token_logprobs`); None: as many as the step needs.
    k_scale: what fp8 keys (`is_fp8_pages`) are multiplied by when read: a per-tensor float
      (static; 1.0: none), or `[N, B, K]` float32 scales per position and head (`[K, N, B]`
      with `kv_heads_first`; the GPU backend's). Unused for other page dtypes.
    v_scale: the same for fp8 values.

  Returns:
    `[T, H, D]` in `q`'s dtype; rows of padding tokens are 0.

  Raises:
    ValueError: `query_tile` or `pages_per_chunk` below 1, `sliding_window` below 1, or `H`
      not a multiple of `K`.
  """
  if query_tile < 1 or pages_per_chunk < 1:
    raise ValueError(
      f"query_tile and pages_per_chunk must be >= 1, got {query_tile} and {pages_per_chunk}"
    )
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
  num_tokens, num_heads, head_dim = q.shape
  if kv_heads_first:
    num_kv_heads, _, block_size, _ = key_pages.shape
  else:
    _, block_size, num_kv_heads, _ = key_pages.shape
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
  group = num_heads // num_kv_heads
  items = _work_items(md, num_tokens, query_tile)
  num_items = items.req.shape[0]
  q_items = q[jnp.minimum(items.token, num_tokens - 1)]  # [W, Tq, H, D]
  q_items = q_items.reshape(num_items, query_tile, num_kv_heads, group, head_dim)
  blocks = md.block_tables[items.req]  # [W, P]
  blocks = jnp.pad(blocks, ((0, 0), (0, -blocks.shape[1] % pages_per_chunk)))  # null pages
  chunk_len = pages_per_chunk * block_size
  stats_shape = (num_items, num_kv_heads, group, query_tile)
  span = _ChunkSpan.of(items, md.seq_lens, chunk_len, sliding_window)
  lowest = None if sliding_window is None else items.position[:, :, None] - sliding_window

  def chunk(index, carry):
    running_max, running_sum, acc = carry
    first_page = (span.first + index) * pages_per_chunk  # [W]
    page_index = first_page[:, None] + jnp.arange(pages_per_chunk, dtype=jnp.int32)  # [W, C]
    # Items past their own last chunk read clipped (real or null) pages, all masked below.
    pages = jnp.take_along_axis(blocks, page_index, axis=1, mode="clip")
    keys, values = (
      _read_pages(p, pages, kv_heads_first, q.dtype, s)
      for p, s in ((key_pages, k_scale), (value_pages, v_scale))
    )
    scores = _scores(q_items, keys, fixed_order)  # [W, K, G, Tq, C * B] float32
    position = first_page[:, None, None] * block_size + jnp.arange(chunk_len, dtype=jnp.int32)
    visible = position <= items.position[:, :, None]  # [W, Tq, C * B]
    if lowest is not None:
      visible &= position > lowest
    scores = soft_cap_scores(scores * scale, soft_cap)
    scores = jnp.where(visible[:, None, None], scores, NEG_INF)
    new_max = jnp.maximum(running_max, scores.max(axis=-1))  # [W, K, G, Tq]
    correction = jnp.exp(running_max - new_max)
    probs = jnp.exp(scores - new_max[..., None])  # masked: underflows to 0
    update = _weighted_values(probs, values, fixed_order)  # [W, K, G, Tq, D] float32
    mass = fixed_sum(probs) if fixed_order else probs.sum(-1)
    return new_max, running_sum * correction + mass, acc * correction[..., None] + update

  # An item's first chunk holds its first query's first visible position, so that query's
  # maximum is a real score from chunk 0 on. A later query of the tile may see nothing in a chunk
  # (a window narrower than the tile): its maximum stays NEG_INF, its weights are exp(0) = 1 over
  # garbage, and its first real chunk multiplies all of that by exp(NEG_INF - real) = 0 (values
  # are finite). Entries of unused items see nothing and average garbage, dropped by the scatter
  # below (never NaN).
  init = (
    jnp.full(stats_shape, NEG_INF, jnp.float32),
    jnp.zeros(stats_shape, jnp.float32),
    jnp.zeros((*stats_shape, head_dim), jnp.float32),
  )
  num_chunks = span.num_chunks if max_context is None else -(-max_context // chunk_len)
  _, total, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
  out = acc / total[..., None]  # [W, K, G, Tq, D]
  out = out.transpose(0, 3, 1, 2, 4).reshape(num_items, query_tile, num_heads, head_dim)
  return jnp.zeros_like(q).at[items.token].set(out.astype(q.dtype), mode="drop")


def _scores(q_items: jax.Array, keys: jax.Array, fixed_order: bool) -> jax.Array:
  """`[W, K, G, Tq, S] float32` dot products of `[W, Tq, K, G, D]` queries and `[W, S, K, D]`
  keys: a batched matrix product, or (`fixed_order`) products summed along the last axis."""
  if not fixed_order:
    return jnp.einsum("wqkgd,wskd->wkgqs", q_items, keys, preferred_element_type=jnp.float32)
  q32 = q_items.astype(jnp.float32).transpose(0, 2, 3, 1, 4)[:, :, :, :, None, :]  # [W,K,G,Tq,1,D]
  k32 = keys.astype(jnp.float32).transpose(0, 2, 1, 3)[:, :, None, None, :, :]  # [W,K,1,1,S,D]
  return fixed_sum(q32 * k32)


def _weighted_values(probs: jax.Array, values: jax.Array, fixed_order: bool) -> jax.Array:
  """`[W, K, G, Tq, D] float32` sums of `[W, S, K, D]` values weighted by `[W, K, G, Tq, S]`
  probabilities: a batched matrix product, or (`fixed_order`) float32 products summed along the
  last axis."""
  if not fixed_order:
    return jnp.einsum(
      "wkgqs,wskd->wkgqd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
  v32 = values.astype(jnp.float32).transpose(0, 2, 3, 1)[:, :, None, None, :, :]  # [W,K,1,1,D,S]
  return fixed_sum(probs[:, :, :, :, None, :] * v32)
