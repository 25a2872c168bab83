"""Recurrent state slots of a hybrid model's running requests (host bookkeeping).

A hybrid model (Qwen3.5's Gated DeltaNet layers, `jaxengine.models.gated_deltanet`) keeps, per
request, a fixed-size recurrent state in a device pool of slots beside the KV cache's pages. The
scheduler gives a completion a slot when it admits it and takes it back when it finishes or is
aborted; the slot reaches the device as data (`SchedulerOutput.state_slots`, then
`PagedAttentionMetadata.state_slots`), as block tables do. Slot 0 is the null slot of padding
tokens and is never given out.

A preempted completion keeps its slot, as it keeps its row of the batch: its recomputation starts
again from position 0, where the model starts the state from zero, so nothing stale is read.
The pool has one slot per row (`max_num_reqs`) and the null slot, so admission never waits for a
slot.
"""

from __future__ import annotations

__all__ = ["StateSlots"]


class StateSlots:
  """Slots ``1..num_slots`` handed to running completions by `seq_id`.

  Args:
    num_slots: slots to hand out (the batch's rows; the null slot 0 comes on top).
  """

  def __init__(self, num_slots: int) -> None:
    self.num_slots = num_slots
    self._free = list(range(num_slots, 0, -1))  # pop() gives the lowest first
    self._held: dict[str, int] = {}

  @property
  def num_free(self) -> int:
    """Slots no completion holds."""
    return len(self._free)

  def allocate(self, seq_id: str) -> int:
    """The completion's slot, given now if it holds none.

    Raises:
      RuntimeError: every slot is held (more running completions than rows: a scheduler bug).
    """
    slot = self._held.get(seq_id)
    if slot is None:
      if not self._free:
        raise RuntimeError(f"no free recurrent state slot for {seq_id!r} ({self.num_slots} held)")
      slot = self._held[seq_id] = self._free.pop()
    return slot

  def slot(self, seq_id: str) -> int:
    """The slot `seq_id` holds (KeyError when none)."""
    return self._held[seq_id]

  def free(self, seq_id: str) -> None:
    """Takes back the completion's slot, if it holds one."""
    slot = self._held.pop(seq_id, None)
    if slot is not None:
      self._free.append(slot)
