"""Recurrent states saved at block boundaries: prefix caching for a hybrid model (host bookkeeping).

A prefix-cache hit gives a new request the pages of its cached prefix. A hybrid model's Gated
DeltaNet layers (`jaxengine.models.gated_deltanet`) need more than pages: their recurrent state
after the prefix's last token, which no page holds (the state is one matrix per sequence, not a
vector per position). With ``enable_prefix_caching=True`` the engine therefore keeps snapshot
slots in the state pool, past the running requests' slots, and saves states into them at block
boundaries, each under the prefix hash of the block it ends (the key the block's page is cached
under, `jaxengine.core.block_pool.extend_block_hashes`). A hit is then the longest cached prefix
of pages that ends where a state was saved, and the request's first step reads its state from
that snapshot instead of starting from zero.

What is saved: in each step, for each scheduled request whose tokens of the step reach a block
boundary within its prompt, the state after the last such boundary, unless a state of that block
is saved already. A prompt computed in one step leaves one snapshot (its last full block), a
prompt in chunks one per chunk; decoded tokens leave none (they would churn the snapshots of
prompts, which later requests share). So requests that repeat a prompt (the samples of one
prompt sent one after another, a chat's next turn, an eval run twice) hit; requests that share
only a part of their prompt (a system prompt) hit only where a chunk of an earlier one ended.

Snapshots are evicted least recently used first; a state saved this step is found by the steps
after it (the device writes it before their reads: the pool passes from step to step).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from jaxengine.core.block_pool import extend_block_hashes
from jaxengine.core.kv_cache_manager import ComputedBlocks
from jaxengine.core.request import Completion
from jaxengine.core.state_slots import StateSlots

__all__ = ["StateRoute", "StateSnapshots", "StepStates", "step_states"]


class StateRoute(NamedTuple):
  """Where one scheduled request of a hybrid model reads and saves state this step.

  Attributes:
    source: the slot its state is read from before its first token (its own slot, or after a
      prefix-cache hit the snapshot slot of the hit's last block).
    snapshot: the slot its state is saved into after `snapshot_len` tokens (0, the null slot:
      none saved).
    snapshot_len: tokens of the step after which the state is saved (0: none).
    drafts: in a verify step (speculative decoding), the slots its state is saved into after
      each of its tokens but the last (the ``j``-th after ``j + 1`` tokens: one per draft, of
      its group of slots, `jaxengine.core.state_slots`); empty otherwise.
  """

  source: int
  snapshot: int = 0
  snapshot_len: int = 0
  drafts: tuple[int, ...] = ()


class StateSnapshots:
  """Snapshot slots ``first_slot .. first_slot + num_slots - 1`` by block prefix hash (LRU), and
  the routes of each step's requests (`StateRoute`).

  Args:
    first_slot: the pool's first snapshot slot (after the null slot and the running requests').
    num_slots: snapshot slots (`>= 1`).
    block_size: tokens per block.

  Raises:
    ValueError: `num_slots < 1`.
  """

  def __init__(
    self,
    first_slot: int,
    num_slots: int,
    block_size: int,
  ) -> None:
    if num_slots < 1:
      raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    self.block_size = block_size
    self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
    self._saved: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self._sources: dict[str, int] = {}  # this step's hits: seq_id -> the slot read first
    self._stale: set[str] = set()  # running since before a reset: their states are not saved

  @property
  def num_saved(self) -> int:
    """Blocks whose state is saved."""
    return len(self._saved)

  def shorten_hit(
    self, seq_id: str, hit: ComputedBlocks, token_ids: Sequence[int], cache_key: bytes
  ) -> ComputedBlocks:
    """A prefix-cache hit of `seq_id` shortened to its longest prefix that ends in a saved
    state, whose slot the request's next scheduled step reads (`routes`)."""
    self._sources.pop(seq_id, None)
    size = self.block_size
    hashes = extend_block_hashes([], token_ids[: len(hit.block_ids) * size], size, cache_key)
    for num in range(len(hashes), 0, -1):
      slot = self._saved.get(hashes[num - 1])
      if slot is not None:
        self._saved.move_to_end(hashes[num - 1])
        self._sources[seq_id] = slot
        groups = tuple(table[:num] for table in hit.group_block_ids)
        return ComputedBlocks(hit.block_ids[:num], num * size, groups)
    return ComputedBlocks()

  def routes(
    self,
    num_scheduled: Mapping[str, int],
    running: Mapping[str, Completion],
    slots: StateSlots | None,
  ) -> dict[str, StateRoute]:
    """Each scheduled request's `StateRoute` for the step (after its lookups: the states it
    saves are found from the next step on); forgets the step's hits.

    Raises:
      ValueError: no `slots` (a model without recurrent state has no snapshots).
    """
    if slots is None:
      raise ValueError("state snapshots need the running requests' state slots")
    sources = {s: self._sources.get(s, slots.slot(s)) for s in num_scheduled}
    self._sources.clear()
    routes = {}
    for seq_id, count in num_scheduled.items():
      slot, length = 0, 0
      if seq_id not in self._stale:
        slot, length = self._plan(running[seq_id], count, set(sources.values()))
      routes[seq_id] = StateRoute(sources[seq_id], slot, length)
    return routes

  def reset(self, running: Iterable[str]) -> None:
    """Forgets every saved state (the prefix cache was reset: new weights, or the pool was
    freed); the `running` requests' states, computed before, are not saved from now on."""
    self._free.extend(self._saved.values())
    self._saved.clear()
    self._sources.clear()
    self._stale.update(running)

  def finish(self, seq_id: str) -> None:
    """Forgets a finished request."""
    self._stale.discard(seq_id)

  def _plan(self, completion: Completion, num_new: int, keep: set[int]) -> tuple[int, int]:
    """``(slot, snapshot_len)`` saving the completion's state at the last block boundary of its
    `num_new` tokens within its prompt, or ``(0, 0)``: no boundary there, its state saved
    already, or every slot read this step (`keep`). The slot is registered at once."""
    token_ids = completion.request.prompt_token_ids
    computed = completion.num_computed_tokens
    boundary = min(computed + num_new, len(token_ids))
    boundary -= boundary % self.block_size
    if boundary <= computed:
      return 0, 0
    key = completion.cache_key
    block_hash = extend_block_hashes([], token_ids[:boundary], self.block_size, key)[-1]
    if block_hash in self._saved:
      self._saved.move_to_end(block_hash)
      return 0, 0
    slot = self._take_slot(keep)
    if slot:
      self._saved[block_hash] = slot
    return slot, (boundary - computed) if slot else 0

  def _take_slot(self, keep: set[int]) -> int:
    if self._free:
      return self._free.pop()
    for block_hash, slot in self._saved.items():  # least recently used first
      if slot not in keep:
        del self._saved[block_hash]
        return slot
    return 0


class StepStates(NamedTuple):
  """Where a step writes and reads each scheduled request's recurrent state (a hybrid model).

  Attributes:
    slots: by `seq_id`, the slot its state after all its tokens is written into.
    routes: by `seq_id`, its `StateRoute` (prefix caching's sources and snapshots, speculative
      decoding's draft slots); empty when the engine has neither.
  """

  slots: dict[str, int]
  routes: dict[str, StateRoute]


def step_states(
  slots: StateSlots,
  snapshots: StateSnapshots | None,
  num_scheduled: Mapping[str, int],
  spec_token_ids: Mapping[str, Sequence[int]],
  running: Mapping[str, Completion],
) -> StepStates:
  """The `StepStates` of a step that schedules `num_scheduled` tokens (with `spec_token_ids`
  drafts) of the `running` completions: `StateSlots.step_slots`, and the routes of the
  snapshots (`StateSnapshots.routes`) with, under speculative decoding, every row's draft
  slots."""
  own, drafts = slots.step_slots(num_scheduled, spec_token_ids)
  routes = {} if snapshots is None else snapshots.routes(num_scheduled, running, slots)
  if slots.group_size > 1:  # speculative decoding: every row routed (its draft slots)
    plain = {s: routes.get(s, StateRoute(slots.slot(s))) for s in own}
    routes = {s: StateRoute(*route[:3], drafts=drafts[s]) for s, route in plain.items()}
  return StepStates(own, routes)
