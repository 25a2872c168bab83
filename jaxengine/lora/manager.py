"""`LoRAManager`: a runner's adapters, host copies (an LRU) and device slots.

The device side is `max_loras + 1` slots of fixed shapes per layer and target projection
(`jaxengine.models.lora`); slot 0 stays zero (the base model). Putting an adapter in a slot is one
jitted update of those buffers with the same shapes (donated), so nothing that reads them
recompiles. A slot is taken by the completions running with its adapter (`acquire` / `release`);
a slot none uses keeps its adapter until another adapter needs a slot (least recently used
first), so switching back costs nothing.
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.lora.peft import LoRAAdapter, load_peft_adapter
from jaxengine.lora.request import LoRARequest, check_lora_request
from jaxengine.models.lora import LoRAInputs

#: Device buffers: per layer, target -> ``(A [N + 1, in, R], B [N + 1, R, out])``.
Buffers = tuple[dict[str, tuple[jax.Array, jax.Array]], ...]


class LoRAManager:
  """Host copies and device slots of the adapters of one model runner.

  Args:
    max_loras: device slots (adapters one step may mix).
    max_lora_rank: the slots' rank; smaller adapters are zero-padded.
    max_cpu_loras: host copies kept (least recently used dropped first), >= `max_loras`.
    num_layers: the model's decoder layers.
    target_shapes: ``(in, out)`` of every projection adapters may target (the model's
      `lora_target_shapes`).
    dtype: the model's dtype (the buffers').
  """

  def __init__(
    self,
    *,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int,
    num_layers: int,
    target_shapes: Mapping[str, tuple[int, int]],
    dtype,
  ) -> None:
    self.max_loras = max_loras
    self.max_lora_rank = max_lora_rank
    self.max_cpu_loras = max_cpu_loras
    self.num_layers = num_layers
    self.target_shapes = dict(target_shapes)
    n, r = max_loras + 1, max_lora_rank
    self.buffers: Buffers = tuple(
      {
        t: (jnp.zeros((n, i, r), dtype), jnp.zeros((n, r, o), dtype))
        for t, (i, o) in self.target_shapes.items()
      }
      for _ in range(num_layers)
    )
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
    )
    self._host[key] = (request, adapter)
    self._paths[key] = path
    self._host.move_to_end(key)
    while len(self._host) > self.max_cpu_loras:
      self._host.popitem(last=False)
    return adapter

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
    self.buffers = _set_slot(self.buffers, empty, np.int32(0))

  def _place(self, request: LoRARequest) -> int:
    free = [s for s in range(1, self.max_loras + 1) if self._users[s] == 0]
    if not free:
      raise RuntimeError(f"every one of max_loras={self.max_loras} LoRA slots is in use")
    slot = min(free, key=lambda s: (self._slot_ids[s] != 0, self._last_used[s]))
    adapter = self.load(request)
    self.buffers = _set_slot(self.buffers, self._host_slot(adapter), np.int32(slot))
    self._slot_ids[slot] = adapter.lora_int_id
    return slot

  def _host_slot(
    self, adapter: LoRAAdapter
  ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], ...]:
    """The adapter as one slot of every buffer: per layer, target -> ``([in, R], [R, out])``,
    zero-padded (zeros for projections it leaves alone)."""
    r = self.max_lora_rank
    layers = []
    for layer in range(self.num_layers):
      entry = {}
      for target, (n_in, n_out) in self.target_shapes.items():
        a, b = np.zeros((n_in, r), np.float32), np.zeros((r, n_out), np.float32)
        found = adapter.weights.get((layer, target))
        if found is not None:
          a[:, : adapter.rank], b[: adapter.rank] = found
        entry[target] = (a, b)
      layers.append(entry)
    return tuple(layers)


@functools.partial(jax.jit, donate_argnums=0)
def _set_slot(buffers: Buffers, new, slot: jax.Array) -> Buffers:
  """`buffers` with slot `slot` replaced by `new` (per layer, target -> ``(A, B)`` of one
  slot); donated, so the update is in place."""
  return jax.tree.map(lambda buf, one: buf.at[slot].set(one.astype(buf.dtype)), buffers, new)
