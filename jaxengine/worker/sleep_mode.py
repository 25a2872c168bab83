"""Sleep and wake for colocated training: the device buffers of the weights and of the KV cache
freed, and put back exactly as they were placed.

A buffer comes back with the shape, dtype, sharding and commitment (`jax.Array.committed`) it had
before, so the jitted steps see the same argument signature and reuse their executables: nothing
compiles on `wake_up`. These are host-side helpers over trees of arrays (`nnx.State`,
`PagedKVCache`); `ModelRunner.sleep` / `ModelRunner.wake_up` use them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

#: The memory kind the weights move to at sleep level 1.
HOST_MEMORY_KIND = "pinned_host"

#: The parts `wake_up(tags=...)` can wake (vLLM's tags).
SLEEP_TAGS = ("weights", "kv_cache")


@dataclasses.dataclass(frozen=True)
class Slot:
  """Where a freed array lived: enough to put it back in place, or to check a new one against.

  Attributes:
    shape: the array's shape.
    dtype: its dtype.
    sharding: its sharding on the device (memory kind "device").
    committed: whether it was committed to that sharding (JAX caches committed and
      uncommitted arguments apart; see `jaxengine.models.weights.put`).
  """

  shape: tuple[int, ...]
  dtype: Any
  sharding: jax.sharding.Sharding
  committed: bool

  @classmethod
  def of(cls, array: jax.Array) -> Slot:
    """The slot `array` occupies."""
    return cls(tuple(array.shape), array.dtype, array.sharding, bool(array.committed))


def slots(tree: Any) -> Any:
  """`tree` with every array replaced by its `Slot` (other leaves, such as slots, kept)."""
  return jax.tree.map(lambda a: Slot.of(a) if isinstance(a, jax.Array) else a, tree)


def delete(tree: Any) -> None:
  """Deletes the buffers of every array of `tree` that is not deleted yet (slots skipped)."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()


def to_host(tree: Any) -> Any:
  """Copies of `tree`'s arrays in pinned host memory, with the same shardings; waits for the
  copies (so the device buffers can be deleted afterwards)."""
  host = jax.tree.map(
    lambda a: jax.device_put(a, a.sharding.with_memory_kind(HOST_MEMORY_KIND)), tree
  )
  return jax.block_until_ready(host)


def to_device(host: Any, layout: Any) -> Any:
  """`host`'s arrays back on the device, each placed as its `Slot` in `layout` says: a committed
  array to its sharding, an uncommitted one to the default device, uncommitted again (through
  NumPy: JAX has no device-to-device put that leaves an array uncommitted)."""

  def back(array: jax.Array, slot: Slot) -> jax.Array:
    if slot.committed:
      return jax.device_put(array, slot.sharding)
    return jax.device_put(np.asarray(array))

  return jax.block_until_ready(jax.tree.map(back, host, layout))


def zeros(layout: Any) -> Any:
  """Zero arrays in the place of every `Slot` of `layout`, filled on the host (no executable:
  nothing compiles), each shard transferred to its device."""

  def make(slot: Slot) -> jax.Array:
    if not slot.committed:
      return jax.device_put(np.zeros(slot.shape, slot.dtype))
    shard_shape = slot.sharding.shard_shape(slot.shape)
    return jax.make_array_from_callback(
      slot.shape, slot.sharding, lambda _: np.zeros(shard_shape, slot.dtype)
    )

  return jax.tree.map(make, layout, is_leaf=lambda x: isinstance(x, Slot))


def device_bytes(tree: Any) -> int:
  """Bytes `tree`'s live arrays hold in device memory: every shard's buffer, each counted once
  (two arrays over the same buffer, as JAX can make of a NumPy-backed array on CPU, count once;
  host copies and slots count nothing)."""
  buffers = {}
  for leaf in jax.tree.leaves(tree):
    if not isinstance(leaf, jax.Array) or leaf.is_deleted():
      continue
    if leaf.sharding.memory_kind in ("pinned_host", "unpinned_host"):
      continue
    for shard in leaf.addressable_shards:
      data = shard.data
      buffers[(shard.device.id, data.unsafe_buffer_pointer())] = data.nbytes
  return sum(buffers.values())


def live_device_bytes() -> int:
  """Bytes held in device memory by every live JAX array of the process (`jax.live_arrays`),
  each buffer counted once (`device_bytes`)."""
  return device_bytes(jax.live_arrays())


def check_tags(tags: Any) -> tuple[str, ...]:
  """`wake_up`'s tags as a tuple; None: all of `SLEEP_TAGS`.

  Raises:
    ValueError: tags that are not a non-empty list of `SLEEP_TAGS` names, naming the first bad
      one (an empty list would wake nothing, silently).
  """
  if tags is None:
    return SLEEP_TAGS
  if isinstance(tags, str) or not all(isinstance(t, str) for t in tags) or not tags:
    raise ValueError(
      f"tags must be a non-empty list of {list(SLEEP_TAGS)} (None: both), got {tags!r}"
    )
  for tag in tags:
    if tag not in SLEEP_TAGS:
      raise ValueError(f"unknown sleep tag {tag!r}; tags are {list(SLEEP_TAGS)}")
  return tuple(tags)


def check_level(level: Any) -> int:
  """`sleep`'s level.

  Raises:
    ValueError: a level other than the int 1 or 2 (1.0 too), naming it.
  """
  if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
    raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
  return int(level)
