"""`LoRAManager`: a runner's adapters, host copies (an LRU) and device slots.

The device side is `max_loras + 1` slots of fixed shapes per layer and target projection
(`jaxengine.models.lora`); slot 0 stays zero (the base model). Putting an adapter in a slot is one
jitted update of those buffers with the same shapes (donated), so nothing that reads them
recompiles. A slot is taken by the completions running with its adapter (`acquire` / `release`);
a slot none uses keeps its adapter until another adapter needs a slot (least recently used
first), so switching back costs nothing.

Adapters come from PEFT directories (`load`, by the request's path) or from memory
(`set_adapter`: a trainer's LoRA parameters after each optimizer step, replacing the host copy
and, when the adapter is in a slot, the slot's values; nothing is read from disk and nothing
recompiles). Adapters given in memory have no directory to read again, so the host LRU never
drops them.
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxengine.lora.peft import LoRAAdapter, load_peft_adapter
from jaxengine.lora.request import LoRARequest, check_lora_request
from jaxengine.models.lora import LoRAInputs
from jaxengine.models.weights import check_finite

#: Device buffers: per layer, target -> ``(A [N + 1, in, R], B [N + 1, R, out])`` (an expert
#: target's ``(A [N + 1, X, in, R], B [N + 1, X, R, out])``).
Buffers = tuple[dict[str, tuple[jax.Array, jax.Array]], ...]


class LoRAManager:
  """Host copies and device slots of the adapters of one model runner.

  Args:
    max_loras: device slots (adapters one step may mix).
    max_lora_rank: the slots' rank; smaller adapters are zero-padded.
    max_cpu_loras: host copies kept (least recently used dropped first), >= `max_loras`.
    num_layers: the model's decoder layers.
    target_shapes: ``(in, out)`` of every projection adapters may target (the model's
      `lora_target_shapes`; ``(X, in, out)`` for a mixture of experts' expert targets, one
      pair per expert: `jaxengine.models.moe_lora`).
    dtype: the model's dtype (the buffers').
    device: the device the buffers are committed to (the weights'), so that the steps see one
      placement whether a slot was written from the host or from device arrays (a trainer's,
      committed); None: uncommitted, on the default device.
    shardings: None, or on a mesh the buffers' shardings, per layer target -> ``(A's, B's)``
      (`jaxengine.worker.placement.MeshPlacement.lora_shardings`: split as their base
      projections); every write keeps them (`device` is then unused).
    target_layers: None, or the layers that have each target (the model's
      `lora_target_layers`: a mixture of experts' dense MLP targets only on its dense layers,
      its expert targets only on its sparse ones); a target not named is in every layer. An
      adapter with a pair on a layer without its target is refused, not half applied.
    layer_shapes: None, or ``(layer, target)`` -> that layer's shape where it is narrower than
      `target_shapes` (the model's `lora_layer_shapes`: Gemma 4's layers differ in width); its
      pair fills the first rows of ``A`` and columns of ``B`` of the slot.
  """

  def __init__(
    self,
    *,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int,
    num_layers: int,
    target_shapes: Mapping[str, tuple[int, ...]],
    dtype,
    device: jax.Device | None = None,
    shardings: Buffers | None = None,
    target_layers: Mapping[str, Sequence[int]] | None = None,
    layer_shapes: Mapping[tuple[int, str], tuple[int, ...]] | None = None,
  ) -> None:
    self.max_loras = max_loras
    self.max_lora_rank = max_lora_rank
    self.max_cpu_loras = max_cpu_loras
    self.num_layers = num_layers
    self.target_shapes = dict(target_shapes)
    self.target_layers = {t: frozenset(v) for t, v in (target_layers or {}).items()}
    self.layer_shapes = dict(layer_shapes or {})
    n, r = max_loras + 1, max_lora_rank
    buffers: Buffers = tuple(
      {
        t: (jnp.zeros((n, *lead, i, r), dtype), jnp.zeros((n, *lead, r, o), dtype))
        for t, (*lead, i, o) in self.target_shapes.items()
      }
      for _ in range(num_layers)
    )
    #: The buffers' shardings on a mesh, else None.
    self.shardings = shardings
    if shardings is not None:
      buffers = jax.device_put(buffers, shardings)
    elif device is not None:
      buffers = jax.device_put(buffers, device)
    self.buffers = buffers
    #: Host copies by `lora_int_id`, least recently used first.
    self._host: collections.OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = (
      collections.OrderedDict()
    )
    #: Slot `s` (1..max_loras) holds adapter `_slot_ids[s]` (0: none); `_users[s]` completions.
    self._slot_ids = [0] * n
    self._users = [0] * n
    self._last_used = [0] * n
    self._clock = 0
    self._slot_of_seq: dict[str, int] = {}
    #: The directory of every `lora_int_id` loaded so far: an id names one adapter.
    self._paths: dict[int, str] = {}
    #: `lora_int_id`s given in memory (`set_adapter`): never dropped from the host LRU.
    self._in_memory: set[int] = set()

  # --- host copies ------------------------------------------------------------------------------

  def load(self, request: LoRARequest) -> LoRAAdapter:
    """The adapter of `request`, read from its directory once and kept in the host LRU.

    Raises:
      ValueError: an invalid request or adapter directory (`load_peft_adapter`); nothing changes.
    """
    request = check_lora_request(request)
    key = int(request.lora_int_id)
    path = os.fspath(request.lora_path)
    known = self._paths.get(key)
    if known is not None and known != path:
      raise ValueError(
        f"lora_int_id={key} is the adapter at {known!r}, not lora_path={path!r} (give each "
        "adapter its own lora_int_id)"
      )
    cached = self._host.get(key)
    if cached is not None:
      self._host.move_to_end(key)
      return cached[1]
    adapter = load_peft_adapter(
      request.lora_path,
      key,
      max_lora_rank=self.max_lora_rank,
      num_layers=self.num_layers,
      target_shapes=self.target_shapes,
      layer_shapes=self.layer_shapes,
    )
    self._check_layers(adapter, f"lora_path={path!r}")
    self._remember(request, adapter)
    return adapter

  def set_adapter(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
    """Gives adapter `request.lora_int_id` the values of `adapter` (made in memory, e.g. by
    `lora_adapter_from_arrays`), replacing its host copy and, when a slot holds it, the slot's
    values (one jitted update of the same shapes: nothing recompiles). Completions running with
    it read the new values from their next step on. `request.lora_path` only names it (an id
    keeps one path, as in `load`); the adapter is never read from there nor dropped from the
    host LRU.

    Raises:
      ValueError: (nothing changes) an invalid request, `adapter.lora_int_id` not the
        request's, the id known under another path, or an adapter that does not fit the slots
        (`check_adapter`).
    """
    request = check_lora_request(request)
    key, path = int(request.lora_int_id), os.fspath(request.lora_path)
    if adapter.lora_int_id != key:
      raise ValueError(
        f"adapter.lora_int_id={adapter.lora_int_id} is not lora_request.lora_int_id={key}"
      )
    known = self._paths.get(key)
    if known is not None and known != path:
      raise ValueError(f"lora_int_id={key} is the adapter at {known!r}, not lora_path={path!r}")
    self.check_adapter(adapter)
    self._in_memory.add(key)
    self._remember(request, adapter)
    if key in self._slot_ids[1:]:
      self._write_slot(adapter, self._slot_ids.index(key, 1))

  def check_adapter(self, adapter: LoRAAdapter) -> None:
    """Refuses (ValueError, naming the pair and the expected shapes) an adapter these slots
    cannot hold: a rank above `max_lora_rank`, a layer out of range, a target outside
    `target_shapes`, ``A``, ``B`` not ``[in, rank]``, ``[rank, out]``, or values that are NaN
    or infinite (a diverged trainer's step: `jaxengine.models.weights.check_finite`)."""
    who = f"lora_int_id={adapter.lora_int_id}"
    if not 1 <= adapter.rank <= self.max_lora_rank:
      raise ValueError(
        f"{who}: rank {adapter.rank} is not in 1..max_lora_rank={self.max_lora_rank}"
      )
    for (layer, target), (a, b) in adapter.weights.items():
      if target not in self.target_shapes:
        raise ValueError(
          f"{who}: target {target!r} is not supported (supported: {sorted(self.target_shapes)})"
        )
      if not 0 <= layer < self.num_layers:
        raise ValueError(f"{who}: layer {layer} is out of range (num_layers={self.num_layers})")
      *lead, n_in, n_out = self.layer_shapes.get((layer, target), self.target_shapes[target])
      want_a, want_b = (*lead, n_in, adapter.rank), (*lead, adapter.rank, n_out)
      if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
        raise ValueError(
          f"{who}: layer {layer} {target} has A, B of shapes {a.shape}, {b.shape}, expected "
          f"{want_a}, {want_b}"
        )
    self._check_layers(adapter, who)
    halves = (
      (f"{who} layer {layer} {target} {half}", array)
      for (layer, target), pair in adapter.weights.items()
      for half, array in zip("AB", pair)
    )
    check_finite(halves)

  def _check_layers(self, adapter: LoRAAdapter, who: str) -> None:
    """Refuses (ValueError naming the pair) a pair on a layer without its target
    (`target_layers`)."""
    for layer, target in adapter.weights:
      layers = self.target_layers.get(target)
      if layers is not None and layer not in layers:
        raise ValueError(
          f"{who}: layer {layer} has no {target} (this model's {target} is on layers "
          f"{sorted(layers)}), so its adapter pair there cannot be applied"
        )

  def _remember(self, request: LoRARequest, adapter: LoRAAdapter) -> None:
    """Keeps `adapter` as the most recently used host copy, dropping the least recently used
    ones read from directories beyond `max_cpu_loras`."""
    key = adapter.lora_int_id
    self._host[key] = (request, adapter)
    self._paths[key] = os.fspath(request.lora_path)
    self._host.move_to_end(key)
    droppable = [k for k in self._host if k not in self._in_memory and k != key]
    while len(self._host) > self.max_cpu_loras and droppable:
      del self._host[droppable.pop(0)]

  @property
  def cached_ids(self) -> list[int]:
    """`lora_int_id`s of the host copies, least recently used first."""
    return list(self._host)

  # --- device slots -----------------------------------------------------------------------------

  def acquire(self, seq_id: str, request: LoRARequest | None) -> int:
    """Gives completion `seq_id` its adapter's slot (0 without one), putting the adapter on the
    device when no slot holds it (in the least recently used free slot).

    Raises:
      RuntimeError: every slot is used by another adapter (the scheduler admits at most
        `max_loras` adapters at once, so this is a bug).
    """
    slot = 0
    if request is not None:
      key = int(request.lora_int_id)
      slot = self._slot_ids.index(key, 1) if key in self._slot_ids[1:] else self._place(request)
      self._users[slot] += 1
      self._clock += 1
      self._last_used[slot] = self._clock
    self._slot_of_seq[seq_id] = slot
    return slot

  def release(self, seq_id: str) -> None:
    """Frees `seq_id`'s use of its slot (the adapter stays there until the slot is needed)."""
    slot = self._slot_of_seq.pop(seq_id, 0)
    if slot:
      self._users[slot] -= 1

  def slot(self, seq_id: str) -> int:
    """The slot of a completion `acquire` placed (0: the base model)."""
    return self._slot_of_seq.get(seq_id, 0)

  def token_slots(self, seq_ids: Sequence[str], counts: Any, size: int) -> np.ndarray:
    """``[size] int32`` each query token's slot: `counts` tokens (an int, or one per
    completion) for each of `seq_ids` in order, then 0 (padding tokens: the base model)."""
    slots = np.repeat([self.slot(seq_id) for seq_id in seq_ids], counts).astype(np.int32)
    return np.pad(slots, (0, size - len(slots)))

  @property
  def slot_ids(self) -> list[int]:
    """The `lora_int_id` in each slot ``1..max_loras`` (0: empty)."""
    return self._slot_ids[1:]

  def inputs(self, slots: jax.Array) -> LoRAInputs:
    """The step's `LoRAInputs` for ``[T] int32`` token slots on the device."""
    return LoRAInputs(slots=slots, layers=self.buffers)

  def precompile(self) -> None:
    """Compiles the slot update (writing zeros into slot 0, which stays zero), so that the
    first adapter placed compiles nothing."""
    empty = self._host_slot(LoRAAdapter(0, self.max_lora_rank, 1.0, {}))
    self._keep_shardings(_set_slot(self.buffers, empty, np.int32(0)))

  def _place(self, request: LoRARequest) -> int:
    free = [s for s in range(1, self.max_loras + 1) if self._users[s] == 0]
    if not free:
      raise RuntimeError(f"every one of max_loras={self.max_loras} LoRA slots is in use")
    slot = min(free, key=lambda s: (self._slot_ids[s] != 0, self._last_used[s]))
    adapter = self.load(request)
    self._write_slot(adapter, slot)
    self._slot_ids[slot] = adapter.lora_int_id
    return slot

  def _write_slot(self, adapter: LoRAAdapter, slot: int) -> None:
    """Puts `adapter` in slot `slot` of every buffer: host arrays zero-padded on the host
    (`_host_slot`, one compiled update for every adapter); an adapter held on the device padded
    there (`_set_slot_pairs`, compiled once per adapter structure, rank and slot, nothing through
    the host)."""
    if any(isinstance(x, jax.Array) for pair in adapter.weights.values() for x in pair):
      self._keep_shardings(
        _set_slot_pairs(self.buffers, self._on_slot_device(adapter.weights), slot)
      )
    else:
      self._keep_shardings(_set_slot(self.buffers, self._host_slot(adapter), np.int32(slot)))

  def _keep_shardings(self, buffers: Buffers) -> None:
    """Stores updated `buffers` in `shardings` (the steps declare them; a write whose output the
    partitioner placed otherwise is moved back, and one already there is kept as it is)."""
    self.buffers = buffers if self.shardings is None else jax.device_put(buffers, self.shardings)

  def _on_slot_device(self, pairs: dict) -> dict:
    """`pairs` as plain arrays where the slot buffers live, for the jitted write.

    A trainer's arrays may be committed to another device than the engine's (Tunix's actor and
    rollout on meshes of their own), and one jitted write cannot take both; on a mesh with
    explicit axes their type carries the trainer's sharding, which the engine's steps cannot
    take either. Each pair is relabelled on its own devices with `Auto` axes (no data moves),
    then moved device to device (nothing through the host; pairs already there stay put)."""
    sharding = jax.tree.leaves(self.buffers)[0].sharding
    # The buffers are ``[N + 1, in, R]``, the pairs 2-D: whole on every device of the buffers
    # (on a mesh the jitted write keeps each device's share of the slot).
    placement = (
      NamedSharding(sharding.mesh, PartitionSpec())
      if isinstance(sharding, NamedSharding)
      else next(iter(sharding.device_set))
    )
    return jax.tree.map(
      lambda x: jax.device_put(_auto_axes(x), placement) if isinstance(x, jax.Array) else x, pairs
    )

  def _host_slot(
    self, adapter: LoRAAdapter
  ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]:
    """The adapter as one slot of every buffer: per layer, target -> ``([in, R], [R, out])``
    (``[X, in, R]``, ``[X, R, out]`` for an expert target), zero-padded (zeros for projections
    it leaves alone)."""
    r = self.max_lora_rank
    layers = []
    for layer in range(self.num_layers):
      entry = {}
      for target, (*lead, n_in, n_out) in self.target_shapes.items():
        a, b = np.zeros((*lead, n_in, r), np.float32), np.zeros((*lead, r, n_out), np.float32)
        found = adapter.weights.get((layer, target))
        if found is not None:  # a narrower layer's pair: the first rows and columns
          n_in, n_out = found[0].shape[-2], found[1].shape[-1]
          a[..., :n_in, : adapter.rank], b[..., : adapter.rank, :n_out] = found
        entry[target] = (a, b)
      layers.append(entry)
    return tuple(layers)


def _auto_axes(x: jax.Array) -> jax.Array:
  """`x` relabelled with `Auto` axes when its mesh has explicit ones (the same devices and
  shards: no data moves), else `x`."""
  sharding = x.sharding
  if not isinstance(sharding, NamedSharding) or AxisType.Explicit not in sharding.mesh.axis_types:
    return x
  mesh = sharding.mesh
  auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
  return jax.device_put(x, NamedSharding(auto, sharding.spec))


@functools.partial(jax.jit, donate_argnums=0)
def _set_slot(buffers: Buffers, new, slot: jax.Array) -> Buffers:
  """`buffers` with slot `slot` replaced by `new` (per layer, target -> ``(A, B)`` of one
  slot); donated, so the update is in place."""
  return jax.tree.map(lambda buf, one: buf.at[slot].set(one.astype(buf.dtype)), buffers, new)


@functools.partial(jax.jit, donate_argnums=0, static_argnums=2)
def _set_slot_pairs(
  buffers: Buffers, pairs: dict[tuple[int, str], tuple[jax.Array, jax.Array]], slot: int
) -> Buffers:
  """`buffers` with slot `slot` holding `pairs` (``(layer, target)`` -> ``(A [in, r],
  B [r, out])``), zero-padded to the buffers' rank, zeros for projections not in `pairs`;
  donated. `slot` is static: no host value enters (Tunix syncs under a transfer guard)."""
  layers = []
  for layer, entry in enumerate(buffers):
    new = {}
    for target, (a_buf, b_buf) in entry.items():
      pair = pairs.get((layer, target))
      a, b = jnp.zeros(a_buf.shape[1:], a_buf.dtype), jnp.zeros(b_buf.shape[1:], b_buf.dtype)
      if pair is not None:
        (n_in, r), n_out = pair[0].shape[-2:], pair[1].shape[-1]
        a = a.at[..., :n_in, :r].set(pair[0].astype(a.dtype))
        b = b.at[..., :r, :n_out].set(pair[1].astype(b.dtype))
      new[target] = (a_buf.at[slot].set(a), b_buf.at[slot].set(b))
    layers.append(new)
  return tuple(layers)
