"""The paged key/value cache: a pool of fixed-size pages per layer, in one backend's layout.

Rather than a fixed row of ``S`` positions per request, a `PagedKVCache` holds `num_blocks`
pages of `block_size` positions per layer, and the engine lists each request's pages in a block
table (`PagedAttentionMetadata.block_tables`). Only the attention seam
(`jaxengine.models.attention.attention`) reads and writes it, through the cache's
`AttentionBackend`, which owns the page layout (``[N, B, K, D]`` keys and values on XLA,
``[K, N, B, D]`` for the GPU Pallas kernel, ``[N, B, 2K', 128]`` keys and values together on TPU,
XLA's layout there for heads wider than the kernel's 128 lanes)
and the storage of fp8 pages (bytes on XLA, float8_e4m3fn on TPU, float8_e4m3fn and
``[K, N, B]`` float32 scales on GPU).

Each layer's pages are buffers of their own (a tuple per layer, not one ``[L, ...]`` array), so
a layer's write and read never slice a stacked array (a slice XLA may copy) and every buffer can
be donated.

With KV cache groups (`jaxengine.core.kv_cache_groups`: a model with sliding-window layers) a page
holds ``group_size`` layers rather than all ``L``: the tuple has ``group_size`` entries (slots),
and `layer_groups` says which slot each layer uses and whose block table (the metadata then
carries one table and slot mapping per group).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxengine.models.attention_backends import AttentionBackend, KVPages
from jaxengine.models.kv_cache import KVCacheSpec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedKVCache:
  """Per-layer pages of keys and values, and the backend that lays them out and reads them.

  Page 0 is the null page: padding tokens write there and nothing real is read from it. A
  position of a page holds meaningful data only once the request owning the page has written it;
  the seam never lets a query see a position past its own.

  Attributes:
    pages: ``L`` tuples of one layer's page arrays in the backend's layout
      (`AttentionBackend.page_arrays`), keys after rotary embedding, in the cache dtype's
      storage.
    backend: the `AttentionBackend` that writes and reads the pages (static).
    block_size: positions per page ``B`` (static).
    num_kv_heads: the model's key/value heads ``K`` (static; the TPU layout may pad them).
    layer_groups: None (one group: layer ``i`` in ``pages[i]``), or ``(group, slot)`` of each
      layer (static): layer ``i`` keeps its keys and values in ``pages[slot]`` and reads them
      through its group's block table (`PagedAttentionMetadata` with a leading group axis).
  """

  pages: tuple[KVPages, ...]
  backend: AttentionBackend = dataclasses.field(metadata={"static": True})
  block_size: int = dataclasses.field(metadata={"static": True})
  num_kv_heads: int = dataclasses.field(metadata={"static": True})
  layer_groups: tuple[tuple[int, int], ...] | None = dataclasses.field(
    default=None, metadata={"static": True}
  )

  @classmethod
  def create(
    cls,
    spec: KVCacheSpec,
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    layer_groups: tuple[tuple[int, int], ...] | None = None,
  ) -> PagedKVCache:
    """Allocates zero-filled pages for every layer of a model.

    Args:
      spec: the model's `KVCacheSpec` (layers, key/value heads, head dim, dtype); with
        `layer_groups`, its `num_layers` is the page's slots (``group_size``).
      backend: the attention backend whose layout the pages take (`attention_backend()`).
      num_blocks: pages ``N`` per layer, the null page 0 included (`>= 2`).
      block_size: positions per page ``B`` (`>= 1`).
      layer_groups: ``(group, slot)`` of each layer, or None (class docstring).

    Returns:
      A `PagedKVCache` whose arrays are separate buffers (so all can be donated).

    Raises:
      ValueError: `num_blocks < 2` or `block_size < 1`, naming the value.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
      raise ValueError(
        f"num_blocks must be an int >= 2 (the null page and one more), got {num_blocks!r}"
      )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
      raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    pages = tuple(
      backend.init_pages(num_blocks, block_size, spec.num_kv_heads, spec.head_dim, spec.dtype)
      for _ in range(spec.num_layers)
    )
    return cls(
      pages=pages,
      backend=backend,
      block_size=block_size,
      num_kv_heads=spec.num_kv_heads,
      layer_groups=layer_groups,
    )

  def layer_view(self, layer: int) -> tuple[PagedKVCache, int]:
    """`(view, slot)`: a cache holding only `layer`'s pages, which the layer reads and writes as
    its layer 0 (its group kept), and the slot of `pages` they came from (`with_slot`).

    Every layer's view has the same structure, so a step traced layer by layer
    (`jaxengine.models.layer_stack.apply_layers`) traces one body per distinct layer, not one per
    layer.
    """
    if self.layer_groups is None:
      return dataclasses.replace(self, pages=(self.pages[layer],)), layer
    group, slot = self.layer_groups[layer]
    view = dataclasses.replace(self, pages=(self.pages[slot],), layer_groups=((group, 0),))
    return view, slot

  def with_slot(self, slot: int, view: PagedKVCache) -> PagedKVCache:
    """This cache with `pages[slot]` replaced by the one-layer `view`'s pages (`layer_view`)."""
    pages = (*self.pages[:slot], view.pages[0], *self.pages[slot + 1 :])
    return dataclasses.replace(self, pages=pages)

  @property
  def num_layers(self) -> int:
    """Page slots: decoder layers ``L`` without `layer_groups`."""
    return len(self.pages)

  @property
  def dtype(self) -> jax.typing.DTypeLike:
    """Storage dtype of the first page array (fp8 pages: `FP8_KV_STORAGE` on XLA)."""
    return self.pages[0][0].dtype
