"""KV cache groups: which layers share a block table, and which slot of a page each layer uses.

A model whose layers all attend to the whole context (Llama, Qwen) has one group: one block
table per request, and a page holds one `block_size`-token slice of every layer. A model with
sliding-window layers (Gemma 2 and 3's local layers, Mistral) can free the pages that slid out of
every window, but only for those layers: the global layers still read every position. So the
layers are split into groups of one kind each (full attention, or one window `W`), and each group
has a block table of its own per request (vLLM V1's hybrid KV cache).

All groups draw from one shared pool of pages. A page holds `group_size` layers (slots): layer
`i` keeps its keys and values in slot `layer_slot[i]` of the pages its group's table lists
(`layer_group[i]`). Groups therefore have equal sizes: `group_size` is the smaller of the two
kinds' layer counts and each kind is cut into `ceil(n / group_size)` groups (the last one may
leave slots unused). One free list then serves every group and any page serves any group, so no
split of the memory between local and global layers has to be guessed up front (the alternative,
a pool per kind, needs that split). Gemma 3 (5 local layers per global one) gets `group_size`
= its global layers and 5 or 6 local groups whose tables are alike; Gemma 2 (alternating) two
groups of `L / 2`.

Host integers only: the device side (`jaxengine.models.kv_pages.PagedKVCache.layer_groups`)
gets `(group, slot)` per layer as a static tuple.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
  """How the layers map onto groups and page slots.

  Attributes:
    group_windows: each group's sliding window `W`, or None for full attention (`G` entries).
    layer_group: each layer's group (`L` entries).
    layer_slot: each layer's slot in a page of its group (`0 <= slot < group_size`).
    group_size: layers a page holds (the pool's per-page layer count).
  """

  group_windows: tuple[int | None, ...]
  layer_group: tuple[int, ...]
  layer_slot: tuple[int, ...]
  group_size: int

  @property
  def num_groups(self) -> int:
    """`G`, block tables per request."""
    return len(self.group_windows)

  @property
  def frees_pages(self) -> bool:
    """Whether some group frees pages that slid out of its window."""
    return any(window is not None for window in self.group_windows)

  @property
  def layer_groups(self) -> tuple[tuple[int, int], ...]:
    """`(group, slot)` of each layer (what the device cache needs)."""
    return tuple(zip(self.layer_group, self.layer_slot))


def max_group_blocks(
  window: int | None, num_tokens: int, block_size: int, max_num_batched_tokens: int | None
) -> int:
  """The most pages one group holds for a request of `num_tokens` tokens: all
  `ceil(num_tokens / block_size)` for a full group, at most `ceil((W + chunk) / block_size) + 1`
  for a window group whose steps compute up to `chunk = max_num_batched_tokens` tokens
  (`jaxengine.core.kv_cache_manager.KVCacheManager`)."""
  full = -(-num_tokens // block_size)
  if window is None or max_num_batched_tokens is None:
    return full
  return min(full, -(-(window + max_num_batched_tokens) // block_size) + 1)


def single_group(num_layers: int, window: int | None = None) -> KVCacheGroups:
  """One group of every layer (slot `i` for layer `i`), full attention or one window."""
  layers = tuple(range(num_layers))
  return KVCacheGroups((window,), (0,) * num_layers, layers, num_layers)


def kv_cache_groups(
  num_layers: int,
  sliding_window: int | None,
  sliding_window_layers: Sequence[int] | None,
  *,
  enabled: bool = True,
) -> KVCacheGroups:
  """Splits a model's layers into KV cache groups (module docstring).

  Args:
    num_layers: decoder layers `L` (`>= 1`).
    sliding_window: the window `W` of the windowed layers, or None (no layer has one).
    sliding_window_layers: the windowed layers, or None: every layer when `sliding_window` is
      set (`jaxengine.models.kv_cache.KVCacheSpec`).
    enabled: False: one group of every layer that frees nothing (the cache before groups;
      `EngineConfig.disable_hybrid_kv_cache_manager`).

  Returns:
    The groups: one for a model without windows or with `enabled=False`; one window group when
    every layer has the window; otherwise full groups first, then window groups.

  Raises:
    ValueError: `num_layers < 1`, a window below 1, or a windowed layer out of range.
  """
  if num_layers < 1:
    raise ValueError(f"num_layers must be >= 1, got {num_layers}")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
  if sliding_window is None or not enabled:
    return single_group(num_layers)
  windowed = set(range(num_layers) if sliding_window_layers is None else sliding_window_layers)
  if not windowed <= set(range(num_layers)):
    raise ValueError(f"sliding_window_layers {sorted(windowed)} out of range for {num_layers}")
  full = [i for i in range(num_layers) if i not in windowed]
  if not full:
    return single_group(num_layers, sliding_window)
  if not windowed:
    return single_group(num_layers)
  size = min(len(full), len(windowed))
  windows: list[int | None] = []
  layer_group = [0] * num_layers
  layer_slot = [0] * num_layers
  for window, layers in ((None, full), (sliding_window, sorted(windowed))):
    for start in range(0, len(layers), size):
      for slot, layer in enumerate(layers[start : start + size]):
        layer_group[layer], layer_slot[layer] = len(windows), slot
      windows.append(window)
  return KVCacheGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
