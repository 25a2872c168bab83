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

Stacked pages (`KVCacheSpec.stacked`, a model whose layers run under `jax.lax.scan`:
`jaxengine.models.layer_scan`): `pages` is then one entry whose arrays hold the pages of every
slot, ``L * N`` pages in the backend's one-layer layout (the page axis ``L`` times as long), slot
``l``'s pages being ``l * N .. l * N + N - 1``. A scan body cannot pick a buffer of a tuple by a
traced layer index, and slicing a layer out of an ``[L, N, ...]`` stack would copy the whole
layer's pages every layer and step; offsetting the step's page ids instead (`layer_metadata`:
``block_tables + l * N``, ``slot_mapping + l * N * B``) leaves the backends' write and read
untouched, every backend's kernel takes the longer page axis as it is, the one buffer is carried
through the scan (written in place) and stays donatable, and its head axis (the one a mesh
splits) is where it was. Each slot keeps a null page of its own (page ``l * N``), where the
offset sends padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.attention_backends import AttentionBackend, KVPages
from jaxengine.models.kv_cache import KVCacheSpec
from jaxengine.models.paged_attention import PagedAttentionMetadata


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
    stacked_layers: None (one entry of `pages` per slot), or the slots ``L`` whose pages one
      entry holds, stacked along the page axis (module docstring; static).
    blocks_per_layer: with `stacked_layers`, the pages ``N`` of each slot (static).
    recurrent: None, or a hybrid model's pool of per-request recurrent state slots beside the
      pages (`jaxengine.models.gated_deltanet.RecurrentState`), donated and updated with them.
  """

  pages: tuple[KVPages, ...]
  backend: AttentionBackend = dataclasses.field(metadata={"static": True})
  block_size: int = dataclasses.field(metadata={"static": True})
  num_kv_heads: int = dataclasses.field(metadata={"static": True})
  layer_groups: tuple[tuple[int, int], ...] | None = dataclasses.field(
    default=None, metadata={"static": True}
  )
  stacked_layers: int | None = dataclasses.field(default=None, metadata={"static": True})
  blocks_per_layer: int | None = dataclasses.field(default=None, metadata={"static": True})
  recurrent: Any = None

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
    shape = (block_size, spec.num_kv_heads, spec.head_dim, spec.dtype)
    pages: tuple[KVPages, ...]
    if spec.stacked:  # one entry, every slot's pages along the page axis (module docstring)
      pages = (backend.init_pages(spec.num_layers * num_blocks, *shape),)
    else:
      pages = tuple(backend.init_pages(num_blocks, *shape) for _ in range(spec.num_layers))
    return cls(
      pages=pages,
      backend=backend,
      block_size=block_size,
      num_kv_heads=spec.num_kv_heads,
      layer_groups=layer_groups,
      stacked_layers=spec.num_layers if spec.stacked else None,
      blocks_per_layer=num_blocks if spec.stacked else None,
    )

  def layer_view(self, layer: int) -> tuple[PagedKVCache, int]:
    """`(view, slot)`: a cache holding only `layer`'s pages, which the layer reads and writes as
    its layer 0 (its group kept), and the slot of `pages` they came from (`with_slot`).

    Every layer's view has the same structure, so a step traced layer by layer
    (`jaxengine.models.layer_stack.apply_layers`) traces one body per distinct layer, not one per
    layer.
    """
    if self.stacked_layers is not None:
      raise ValueError("layer_view needs per-layer pages; these are stacked (a scanned model)")
    if self.layer_groups is None:
      return dataclasses.replace(self, pages=(self.pages[layer],)), layer
    group, slot = self.layer_groups[layer]
    view = dataclasses.replace(self, pages=(self.pages[slot],), layer_groups=((group, 0),))
    return view, slot

  def with_slot(self, slot: int, view: PagedKVCache) -> PagedKVCache:
    """This cache with `pages[slot]` replaced by the one-layer `view`'s pages (`layer_view`)."""
    pages = (*self.pages[:slot], view.pages[0], *self.pages[slot + 1 :])
    return dataclasses.replace(self, pages=pages)

  def layer_metadata(
    self, metadata: PagedAttentionMetadata, layer: jax.Array | int
  ) -> tuple[PagedAttentionMetadata, jax.Array | int]:
    """`(metadata, slot)` for layer `layer` (a traced int32 scalar under a scan) of stacked
    pages: its group's slot mapping and block table (with `layer_groups`), offset to the slot's
    pages in the one stacked entry (module docstring).

    Args:
      metadata: the step's `PagedAttentionMetadata` (``[G, T]`` slots and ``[G, R, P]`` tables
        with `layer_groups`).
      layer: the decoder layer.

    Returns:
      The layer's metadata (``[T]`` slots, ``[R, P]`` tables, page ids of the stacked pages)
      and the slot it uses.
    """
    slot: jax.Array | int = layer
    if self.layer_groups is not None:
      groups, slots = (np.asarray(column, np.int32) for column in zip(*self.layer_groups))
      group, slot = jnp.asarray(groups)[layer], jnp.asarray(slots)[layer]
      if metadata.slot_mapping.ndim == 2:  # [G, T] slots, [G, R, P] tables
        metadata = dataclasses.replace(
          metadata,
          slot_mapping=metadata.slot_mapping[group],
          block_tables=metadata.block_tables[group],
        )
    first_page = slot * cast(int, self.blocks_per_layer)  # the slot's null page
    metadata = dataclasses.replace(
      metadata,
      slot_mapping=metadata.slot_mapping + first_page * self.block_size,
      block_tables=metadata.block_tables + first_page,
    )
    return metadata, slot

  @property
  def num_layers(self) -> int:
    """Page slots: decoder layers ``L`` without `layer_groups`."""
    return len(self.pages) if self.stacked_layers is None else self.stacked_layers

  @property
  def dtype(self) -> jax.typing.DTypeLike:
    """Storage dtype of the first page array (fp8 pages: `FP8_KV_STORAGE` on XLA)."""
    return self.pages[0][0].dtype
