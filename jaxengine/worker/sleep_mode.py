"""Sleep and wake for colocated training: the device buffers of the weights and of the KV cache
freed, and put back exactly as they were placed.

A buffer comes back with the shape, dtype, sharding and commitment (`jax.Array.committed`) it had
before, so the jitted steps see the same argument signature and reuse their executables: nothing
compiles on `wake_up`. These are host-side helpers over trees of arrays (`nnx.State`,
`PagedKVCache`), and `SleepState`, which a runner's `sleep` / `wake_up` / `free_kv_cache` drive.
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


class EngineAsleepError(RuntimeError):
  """A request or step refused while the engine sleeps or has no weights (`check_awake`); the
  server answers it with a 503."""


class UnfinishedRequestsError(RuntimeError):
  """`sleep` refused: requests are unfinished (waiting, running, or kept by a "keep" pause);
  nothing changed.

  Args:
    num_unfinished: how many completions are unfinished.
    advice: what the caller can do about them (the Python API's or the server's way).
  """

  def __init__(self, num_unfinished: int, advice: str) -> None:
    super().__init__(f"sleep needs no unfinished requests: {unfinished(num_unfinished)} ({advice})")
    self.num_unfinished = num_unfinished


def unfinished(num: int) -> str:
  """The phrase for `num` unfinished completions: "1 completion is ...", "3 completions are
  ..." (waiting, running or kept by a pause)."""
  return f"{num} completion{' is' if num == 1 else 's are'} waiting, running or kept by a pause"


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


def check_empty_batch(num_reqs: int, action: str) -> None:
  """Raises `RuntimeError` naming `action` when the batch still holds `num_reqs` > 0 requests."""
  if num_reqs:
    raise RuntimeError(
      f"{action} needs an empty batch, it holds {num_reqs} requests (finish or abort them first)"
    )


def check_level(level: Any) -> int:
  """`sleep`'s level.

  Raises:
    ValueError: a level other than the int 1 or 2 (1.0 too), naming it.
  """
  if isinstance(level, bool) or not isinstance(level, int) or level not in (1, 2):
    raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
  return int(level)


@dataclasses.dataclass
class SleepState:
  """What `ModelRunner.sleep` freed and how to put it back; its methods take and return the
  runner's trees (weights, KV cache), the runner keeps them.

  Attributes:
    asleep: the parts asleep (`SLEEP_TAGS` names), empty when awake.
    level: the level of the last `sleep` (0: never slept).
    host_weights: the weights in pinned host memory (level 1), None otherwise.
    weight_slots: the weights' `Slot`s while they are on the host.
    weights_discarded: level 2 dropped the weights; the runner's `weights` hold `Slot`s until
      `load_weights` fills every one.
    kv_cache_slots: the KV cache's `Slot`s while it is freed.
  """

  asleep: set[str] = dataclasses.field(default_factory=set)
  level: int = 0
  host_weights: Any = None
  weight_slots: Any = None
  weights_discarded: bool = False
  kv_cache_slots: Any = None

  def sleep(self, level: int, weights: Any, kv_cache: Any) -> Any:
    """Frees `kv_cache` (`release_kv_cache`) and lets go of the weights; returns what the
    runner holds as weights now (their `Slot`s).

    Level 1 moves the weights to pinned host memory (same shardings, memory kind
    "pinned_host"); level 2 discards them (`load_weights` after `wake_up` brings new ones). The
    KV cache's buffers are deleted; the weights are only let go of (freed when nothing else
    holds them: a module given to the engine or arrays `load_weights` used without a copy are
    the caller's and stay intact). Sleeping again frees what is still held (level 2 after level
    1 drops the host copy).

    Raises:
      ValueError: a level other than 1 or 2 (nothing changes).
    """
    level = check_level(level)
    on_device = "weights" not in self.asleep and not self.weights_discarded
    # The host copy first: should it fail (host memory), nothing is freed yet.
    host = to_host(weights) if on_device and level == 1 else None
    self.release_kv_cache(kv_cache)
    if on_device:
      self.weight_slots = slots(weights)
      self.host_weights = host
      weights = self.weight_slots  # let go, not deleted: a trainer may share the arrays
    if level == 2:
      self.host_weights = None  # asleep at level 1 before: the host copy goes too
      self.weights_discarded = True
    self.asleep.update(SLEEP_TAGS)
    self.level = max(self.level, level)
    return weights

  def release_kv_cache(self, kv_cache: Any) -> int:
    """Deletes `kv_cache`'s buffers (None: already freed), keeping their slots for `wake_up`;
    returns the device bytes freed."""
    if kv_cache is None:
      return 0
    freed = device_bytes(kv_cache)
    self.kv_cache_slots = slots(kv_cache)
    delete(kv_cache)
    return freed

  def free_kv_cache(self, kv_cache: Any) -> int:
    """`release_kv_cache`, the KV cache then asleep alone (the weights stay)."""
    freed = self.release_kv_cache(kv_cache)
    self.asleep.add("kv_cache")
    self.level = max(self.level, 1)
    return freed

  def wake_up(self, tags: Any, weights: Any, kv_cache: Any) -> tuple[Any, Any]:
    """The `(weights, kv_cache)` with the parts `tags` names put back (`check_tags`): the
    weights as they were placed (level 1; after level 2 they stay `Slot`s until `load_weights`)
    and a zero KV cache of the same pages and shardings. A part awake is returned as given.

    Raises:
      ValueError: an unknown tag (nothing changes).
    """
    tags = check_tags(tags)
    if "weights" in tags and "weights" in self.asleep:
      if self.host_weights is not None:
        weights = to_device(self.host_weights, self.weight_slots)
        self.host_weights = None
      self.asleep.discard("weights")
    if "kv_cache" in tags and "kv_cache" in self.asleep:
      kv_cache = zeros(self.kv_cache_slots)
      self.kv_cache_slots = None
      self.asleep.discard("kv_cache")
    if not self.asleep:
      self.level = 0
    return weights, kv_cache

  def check_loadable(self) -> None:
    """Refuses `load_weights` while the weights sleep (RuntimeError: wake them first)."""
    if "weights" in self.asleep:
      where = (
        "discarded the weights" if self.weights_discarded else "moved the weights to host memory"
      )
      raise RuntimeError(
        f"load_weights while asleep: sleep(level={self.level}) {where}; call wake_up() (or "
        "wake_up(tags=['weights'])) first"
      )

  def check_awake(self) -> None:
    """Refuses to run steps while asleep or without weights (`EngineAsleepError`, a
    RuntimeError, on the host)."""
    if self.asleep:
      parts = " and ".join(p for p in SLEEP_TAGS if p in self.asleep)
      raise EngineAsleepError(
        f"the engine is asleep (sleep(level={self.level}) freed its {parts}); call wake_up() first"
      )
    if self.weights_discarded:
      raise EngineAsleepError(
        "the engine has no weights: sleep(level=2) discarded them; call load_weights with every "
        "weight of the model after wake_up()"
      )
