"""Recurrent state slots of a hybrid model's running requests (host bookkeeping).

A hybrid model (Qwen3.5's Gated DeltaNet layers, `jaxengine.models.gated_deltanet`) keeps, per
request, a fixed-size recurrent state in a device pool of slots beside the KV cache's pages. The
scheduler gives a completion a slot when it admits it and takes it back when it finishes or is
aborted; the slot reaches the device as data (`SchedulerOutput.state_slots`, then
`PagedAttentionMetadata.state_slots`), as block tables do. Slot 0 is the null slot of padding
tokens and is never given out.

With speculative decoding a completion holds a group of ``k + 1`` slots (``k`` the
``num_speculative_tokens``), one of them its current one, where its state is. A verify step
runs a row's last known token and its ``d`` drafts: it reads the current slot and writes the
state after ``j + 1`` of those tokens into the group's ``j``-th slot (`jaxengine.worker.
step_inputs`'s draft slots; the state after all ``1 + d`` into the ``d``-th). Once the rejection
sampler has accepted ``a`` drafts, the ``a``-th slot, the state after the accepted tokens, becomes
the current one (`use`): the states that rejected drafts advanced are never read, as the keys and
values of rejected drafts in the pages are not. Without speculative decoding a group is one slot.

A preempted completion keeps its slot, as it keeps its row of the batch: its recomputation starts
again from position 0, where the model starts the state from zero, so nothing stale is read.
The pool has one group per row (`max_num_reqs`) and the null slot, so admission never waits for a
slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["StateSlots"]


class StateSlots:
  """Groups of slots ``1..num_slots`` handed to running completions by `seq_id`.

  Args:
    num_slots: slots to hand out (the batch's rows times `group_size`; the null slot 0 comes on
      top).
    group_size: slots per completion: ``k + 1`` with speculative decoding, else 1 (module
      docstring).

  Raises:
    ValueError: a `group_size` below 1 or not dividing `num_slots`.
  """

  def __init__(self, num_slots: int, group_size: int = 1) -> None:
    if group_size < 1 or num_slots % group_size:
      raise ValueError(f"group_size={group_size} must be >= 1 and divide num_slots={num_slots}")
    self.num_slots = num_slots
    self.group_size = group_size
    self._free = list(range(num_slots - group_size + 1, 0, -group_size))  # pop(): lowest first
    self._held: dict[str, tuple[int, int]] = {}  # seq_id -> (its group's first slot, current)

  @property
  def num_free(self) -> int:
    """Groups no completion holds."""
    return len(self._free)

  def allocate(self, seq_id: str) -> int:
    """The completion's current slot, its group given now (the first slot current) if it holds
    none.

    Raises:
      RuntimeError: every group is held (more running completions than rows: a scheduler bug).
    """
    held = self._held.get(seq_id)
    if held is None:
      if not self._free:
        raise RuntimeError(f"no free recurrent state slot for {seq_id!r} ({self.num_slots} held)")
      first = self._free.pop()
      held = self._held[seq_id] = (first, first)
    return held[1]

  def slot(self, seq_id: str) -> int:
    """The current slot of `seq_id`, where its state is (KeyError when it holds none)."""
    return self._held[seq_id][1]

  def group(self, seq_id: str) -> tuple[int, ...]:
    """The `group_size` slots `seq_id` holds (KeyError when none)."""
    first = self._held[seq_id][0]
    return tuple(range(first, first + self.group_size))

  def step_slots(
    self, num_scheduled: Mapping[str, int], spec_token_ids: Mapping[str, Sequence[int]]
  ) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Where a step writes each scheduled completion's state: the slot of its state after all
    its tokens (its current slot; a drafted one's ``d``-th slot of its group, ``d`` its drafts),
    and its draft slots (the first ``d`` of its group, the ``j``-th its state after ``j + 1``
    tokens; none undrafted). It reads its current slot (`slot`)."""
    own, drafts = {}, {}
    for seq_id in num_scheduled:
      num_drafts = len(spec_token_ids.get(seq_id, ()))
      group = self.group(seq_id) if num_drafts else ()
      own[seq_id] = group[num_drafts] if num_drafts else self.slot(seq_id)
      drafts[seq_id] = group[:num_drafts]
    return own, drafts

  def use(self, seq_id: str, index: int) -> None:
    """Makes the `index`-th slot of the completion's group its current one (a verify step wrote
    its state after the accepted tokens there).

    Raises:
      KeyError: `seq_id` holds no slot.
      ValueError: `index` outside ``[0, group_size)``.
    """
    first = self._held[seq_id][0]
    if not 0 <= index < self.group_size:
      raise ValueError(f"index={index} outside a group of {self.group_size} slots")
    self._held[seq_id] = (first, first + index)

  def free(self, seq_id: str) -> None:
    """Takes back the completion's group, if it holds one."""
    held = self._held.pop(seq_id, None)
    if held is not None:
      self._free.append(held[0])
