"""The paged engine's scheduler: a token budget per step, chunked prefill and preemption.

vLLM V1's policy, for a KV cache of shared pages (`KVCacheManager`):

1. **Running requests first**, in the order they were admitted: those with one token to compute
   (a decode: the token sampled last step) before those with more (a prompt not yet finished, or
   a preempted request being recomputed), which get as many tokens as the budget leaves (all of
   them, or none, without chunked prefill). A running request holding pages that finds no free
   page preempts the most recently admitted running request not scheduled yet this step (its
   pages are freed and its tokens recomputed later; possibly the request itself), until the page
   is found. One holding no pages (being recomputed) waits for free pages instead.
2. **Waiting requests** are admitted (given a row of the batch) while rows, budget and pages
   last, after their longest cached prefix (`KVCacheManager.get_computed_blocks`); the samples
   of an `n > 1` request share the first sample's prompt pages (`KVCacheManager.fork`) when
   prefix caching is off. Nothing is admitted in a step that preempted. With LoRA adapters
   (`max_loras`), a waiting request whose adapter is not running while `max_loras` others are
   keeps its place and waits; the requests behind it may be admitted. Pages are keyed by the
   request's adapter (`KVCacheManager`'s `cache_key`): a prefix is shared only between requests
   of the same adapter (or of none).

With speculative decoding, a decode's draft tokens (`schedule(draft_token_ids)`) are more query
tokens of its row, scheduled after the running requests and before admissions while budget and
free pages last (a step never preempts for drafts, and a step that preempted takes none).

A preempted request keeps its row of the batch (its sampling state is exact as it is) and only
loses its pages: it is scheduled again as a prefill of its prompt and output so far, ahead of
every waiting request, and its next token is the one it would have sampled without preemption.

Host bookkeeping only: token counts and block ids. `ModelRunner` turns a
`SchedulerOutput` into one ragged model step.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from jaxengine.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from jaxengine.core.request import Completion, Request
from jaxengine.core.state_slots import StateSlots
from jaxengine.core.state_snapshots import StateRoute, StateSnapshots, StepStates, step_states


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
  """What one ragged step computes.

  Attributes:
    admitted: completions that join the batch this step (each needs a row).
    num_scheduled_tokens: query tokens of each scheduled completion (`seq_id` -> count `>= 1`),
      in scheduling order.
    num_computed_tokens: tokens of each scheduled completion already in its pages before the step.
    block_ids: the whole block table, one tuple of page ids per KV cache group
      (`KVCacheManager.get_group_block_ids`), of each completion whose table changed this step:
      pages appended, pages a sliding window freed (`NULL_BLOCK_ID` in their place), or every
      page freed by preemption (empty tables). The runner replaces its rows' tables with these:
      the one way a table reaches the device side.
    preempted: completions whose pages were freed this step (their `block_ids` are empty; they
      stay in the batch and are recomputed later).
    spec_token_ids: draft tokens of each decode scheduled with drafts (speculative decoding):
      they are its last query tokens, after its last known token (counted in
      `num_scheduled_tokens`; `worker/verify_step.py`).
    num_decode_steps: for a k-step decode (`Scheduler.schedule_decode_steps`), the most
      tokens each scheduled completion may sample in the step's device loop (its pages hold
      that many positions from its last token on); empty for a single ragged step.
    state_slots: the recurrent state slot each scheduled completion's state is written into (a
      hybrid model, `core/state_slots.py`); empty for a model without recurrent state.
    state_routes: with a hybrid model's prefix caching or speculative decoding, where each
      scheduled completion reads and saves its state (`core/state_snapshots.py`); else empty.
  """

  admitted: list[Completion]
  num_scheduled_tokens: dict[str, int]
  num_computed_tokens: dict[str, int]
  block_ids: dict[str, tuple[tuple[int, ...], ...]]
  preempted: list[str]
  spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
  num_decode_steps: dict[str, int] = dataclasses.field(default_factory=dict)
  state_slots: dict[str, int] = dataclasses.field(default_factory=dict)
  state_routes: dict[str, StateRoute] = dataclasses.field(default_factory=dict)

  @property
  def total_num_scheduled_tokens(self) -> int:
    """Query tokens of the step."""
    return sum(self.num_scheduled_tokens.values())


class Scheduler:
  """Chooses each step's tokens within a budget, over the pages of a `KVCacheManager`.

  Keeps the completions waiting for a row (`waiting`, arrival order) and the running ones
  (`running`, admission order, which is the preemption order, latest last); `schedule` returns
  a `SchedulerOutput`, `update_after_step` advances the computed counts and `finish` frees
  a completion's place and pages.

  Args:
    max_num_reqs: completions that may run at once (the batch's rows).
    manager: the pages.
    max_num_batched_tokens: query tokens per step (`>= max_num_reqs`).
    enable_chunked_prefill: whether a prompt may be split over steps.
    max_loras: distinct LoRA adapters that may run at once (`EngineConfig.max_loras`); a waiting
      completion of another adapter waits while later ones of running adapters (or of none)
      are admitted before it.
    num_state_slots: a hybrid model's recurrent state slots (`core/state_slots.py`: one per
      row), 0 for a model without recurrent state. With slots, the samples of an ``n > 1``
      request each compute their own prompt (a forked page holds no state).
    num_state_snapshots: a hybrid model's snapshot slots for prefix caching (after the
      running completions' slots; `core/state_snapshots.py`), 0: none.
    num_draft_states: with a hybrid model's speculative decoding, `k` (`core/state_slots.py`:
      ``k + 1`` of `num_state_slots` per row), 0: none.
  """

  def __init__(
    self,
    max_num_reqs: int,
    manager: KVCacheManager,
    max_num_batched_tokens: int,
    enable_chunked_prefill: bool = True,
    max_loras: int = 1,
    num_state_slots: int = 0,
    num_state_snapshots: int = 0,
    num_draft_states: int = 0,
  ) -> None:
    self.max_num_reqs = max_num_reqs
    #: The recurrent state slots of the running completions; None without recurrent state.
    self.state_slots = (
      StateSlots(num_state_slots, 1 + num_draft_states) if num_state_slots else None
    )
    #: A hybrid model's saved states (its prefix caching: slots after the null slot and the
    #: running completions'); None without.
    self.state_snapshots = None
    if num_state_snapshots:
      first, size = num_state_slots + 1, manager.block_size
      self.state_snapshots = StateSnapshots(first, num_state_snapshots, size)
    self.waiting: collections.deque[Completion] = collections.deque()
    #: Running completions in admission order.
    self.running: dict[str, Completion] = {}
    self.manager = manager
    self.max_num_batched_tokens = max_num_batched_tokens
    self.enable_chunked_prefill = enable_chunked_prefill
    self.max_loras = max_loras

  def add_request(self, request: Request) -> None:
    """Queues every completion of `request`."""
    self.waiting.extend(request.completions)

  def has_unfinished(self) -> bool:
    """Whether any completion is waiting or running."""
    return bool(self.waiting or self.running)

  def abort(self, request_ids: set[str]) -> list[Completion]:
    """Drops every waiting completion of these requests; returns the running ones, which the
    caller finishes (`finish`) once it has freed their rows."""
    self.waiting = collections.deque(
      c for c in self.waiting if c.request.request_id not in request_ids
    )
    return [c for c in self.running.values() if c.request.request_id in request_ids]

  def schedule(self, draft_token_ids: Mapping[str, Sequence[int]] | None = None) -> SchedulerOutput:
    """Plans one step: decodes, then prefill chunks, then drafts, then admissions (see the
    module).

    Args:
      draft_token_ids: speculative draft tokens of running decodes (`seq_id` -> tokens): each
        decode scheduled this step also computes its drafts, as many as the budget left after
        the running requests' tokens and the free pages hold (a step that preempted takes none).
    """
    step = _StepPlan(self.max_num_batched_tokens)
    decodes_first = sorted(self.running, key=lambda seq_id: self._num_remaining(seq_id) > 1)
    for seq_id in decodes_first:
      if step.budget and seq_id not in step.preempted:
        self._schedule_running(step, seq_id)
    if draft_token_ids and not step.preempted:
      self._schedule_drafts(step, draft_token_ids)
    skipped: list[Completion] = []  # of adapters that cannot run now: they keep their place
    while self.waiting and step.budget and not step.preempted:
      if self._lora_waits(self.waiting[0]):
        skipped.append(self.waiting.popleft())
        continue
      if len(self.running) >= self.max_num_reqs or not self._admit(step, self.waiting[0]):
        break
      step.admitted.append(self.waiting.popleft())
    self.waiting.extendleft(reversed(skipped))
    states = StepStates({}, {})
    if self.state_slots is not None:
      states = step_states(
        self.state_slots,
        self.state_snapshots,
        step.num_scheduled,
        step.spec_token_ids,
        self.running,
      )
    return SchedulerOutput(
      admitted=step.admitted,
      num_scheduled_tokens=step.num_scheduled,
      num_computed_tokens={s: self.running[s].num_computed_tokens for s in step.num_scheduled},
      block_ids=self._changed_tables(step),
      preempted=step.preempted,
      spec_token_ids=step.spec_token_ids,
      state_slots=states.slots,
      state_routes=states.routes,
    )

  def reset_prefix_cache(self) -> int:
    """`KVCacheManager.reset_prefix_cache`, and a hybrid model's saved states forgotten;
    returns the number of page hashes dropped."""
    if self.state_snapshots is not None:
      self.state_snapshots.reset(self.running)
    return self.manager.reset_prefix_cache()

  def _changed_tables(self, step: _StepPlan) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The tables of the completions whose pages changed in `step` (`SchedulerOutput.block_ids`):
    preempted, admitted, given pages, or (when a window frees pages) scheduled at all."""
    admitted = {c.seq_id for c in step.admitted}
    frees = self.manager.frees_pages
    changed = [s for s, new in step.new_block_ids.items() if new or frees or s in admitted]
    return {s: self.manager.get_group_block_ids(s) for s in (*step.preempted, *changed)}

  def update_after_step(
    self, output: SchedulerOutput, num_accepted: Mapping[str, int] | None = None
  ) -> None:
    """Counts the step's tokens as computed (call after the model ran them).

    Args:
      output: the step's plan.
      num_accepted: drafts the rejection sampler accepted, by `seq_id` (rows with drafts): the
        rejected ones are not computed (their keys and values lie past the computed length and
        are overwritten later; a hybrid model's state after the accepted ones is kept).
    """
    num_accepted = num_accepted or {}
    slots = self.state_slots
    for seq_id, count in output.num_scheduled_tokens.items():
      completion = self.running.get(seq_id)
      if completion is not None:
        drafts = output.spec_token_ids.get(seq_id, ())
        accepted = min(num_accepted.get(seq_id, 0), len(drafts))
        completion.num_computed_tokens += count - (len(drafts) - accepted)
        if drafts and slots is not None and slots.group_size > 1:
          slots.use(seq_id, accepted)

  def finish(self, completion: Completion) -> None:
    """Frees a finished completion's row and pages."""
    del self.running[completion.seq_id]
    self.manager.free(completion.seq_id)
    if self.state_slots is not None:
      self.state_slots.free(completion.seq_id)
    if self.state_snapshots is not None:
      self.state_snapshots.finish(completion.seq_id)

  # --- one step ---------------------------------------------------------------------------------

  def _num_remaining(self, seq_id: str) -> int:
    completion = self.running[seq_id]
    return completion.num_tokens_with_placeholders - completion.num_computed_tokens

  def _schedule_running(self, step: _StepPlan, seq_id: str) -> None:
    """Schedules a running completion's decode or next prefill chunk, preempting if needed."""
    completion = self.running[seq_id]
    computed = completion.num_computed_tokens
    hit = ComputedBlocks()
    if computed == 0 and not self.manager.get_block_ids(seq_id):  # preempted: look up again
      hit = self._cached_prefix(completion)
    remaining = completion.num_tokens_with_placeholders - computed - hit.num_computed_tokens
    count = self._chunk(remaining, step.budget)
    if not count:
      return
    while True:
      blocks = self.manager.allocate_slots(
        seq_id,
        count,
        num_computed_tokens=computed,
        token_ids=completion.all_token_ids,
        new_computed_blocks=hit,
        cache_key=completion.cache_key,
      )
      if blocks is not None or not self.manager.get_block_ids(seq_id):
        break  # one holding no pages (being recomputed) waits for pages, as a new one does
      victim = self._preempt_latest(step)
      if victim in (seq_id, ""):
        return
    if blocks is not None:
      completion.num_computed_tokens = computed + hit.num_computed_tokens
      step.add(seq_id, count, blocks)

  def _schedule_drafts(self, step: _StepPlan, draft_token_ids: Mapping[str, Sequence[int]]) -> None:
    """Adds drafts to decodes scheduled this step, while budget and free pages last (never
    preempting for them). Only known tokens are hashed: the pages' prefix-cache entries never
    hold a draft."""
    for seq_id, drafts in draft_token_ids.items():
      count = min(len(drafts), step.budget)
      completion = self.running.get(seq_id)
      if not count or completion is None or step.num_scheduled.get(seq_id) != 1:
        continue
      computed = completion.num_computed_tokens
      if computed + 1 != completion.num_tokens:  # not a decode
        continue
      blocks = self.manager.allocate_slots(
        seq_id,
        count,
        num_computed_tokens=computed + 1,
        token_ids=self.running[seq_id].all_token_ids,
      )
      if blocks is None:
        continue
      step.num_scheduled[seq_id] += count
      step.new_block_ids[seq_id].extend(blocks)
      step.budget -= count
      step.spec_token_ids[seq_id] = list(drafts[:count])

  def _admit(self, step: _StepPlan, completion: Completion) -> bool:
    """Gives a waiting completion its first chunk's pages; False (nothing changed) if none."""
    seq_id = completion.seq_id
    token_ids = completion.all_token_ids
    hit = self._cached_prefix(completion)
    forked = not hit.block_ids and self._fork_from_first_sample(completion, step)
    if forked:
      shared = self.manager.get_block_ids(seq_id)
      hit = ComputedBlocks(shared, len(shared) * self.manager.block_size)
    count = self._chunk(
      completion.num_tokens_with_placeholders - hit.num_computed_tokens, step.budget
    )
    blocks = None
    if count and forked:  # the shared pages are held already: allocate after them
      new = self.manager.allocate_slots(
        seq_id, count, num_computed_tokens=hit.num_computed_tokens, token_ids=token_ids
      )  # the fork gave it the first sample's cache key
      blocks = None if new is None else [*hit.block_ids, *new]
    elif count:
      blocks = self.manager.allocate_slots(
        seq_id,
        count,
        token_ids=token_ids,
        new_computed_blocks=hit,
        cache_key=completion.cache_key,
      )
    if blocks is None:
      self.manager.free(seq_id)  # a fork's shared pages, if any
      return False
    self.running[seq_id] = completion
    if self.state_slots is not None:
      self.state_slots.allocate(seq_id)
    completion.num_computed_tokens = hit.num_computed_tokens
    step.add(seq_id, count, blocks)
    return True

  def _lora_waits(self, completion: Completion) -> bool:
    """Whether a waiting completion's LoRA adapter is not running and `max_loras` others are."""
    lora_id = completion.lora_id
    if not lora_id:
      return False
    running = {c.lora_id for c in self.running.values()} - {0}
    return lora_id not in running and len(running) >= self.max_loras

  def _cached_prefix(self, completion: Completion) -> ComputedBlocks:
    """The completion's longest cached prefix (none for one computing prompt logprobs)."""
    if completion.wants_prompt_logprobs:
      return ComputedBlocks()
    token_ids, key = completion.all_token_ids, completion.cache_key
    hit = self.manager.get_computed_blocks(token_ids, key)
    if self.state_snapshots is not None:  # a hybrid: the prefix must end in a saved state
      shorter = self.state_snapshots.shorten_hit(completion.seq_id, hit, token_ids, key)
      self.manager.uncount_hit_tokens(hit.num_computed_tokens - shorter.num_computed_tokens)
      hit = shorter
    return hit

  def _fork_from_first_sample(self, completion: Completion, step: _StepPlan) -> bool:
    """For sample `j > 0` of a request, shares the first sample's full prompt pages (written
    already or this step) by reference; False when there are none."""
    first = completion.request.completions[0].seq_id
    if completion.index == 0 or first not in self.running or self.state_slots is not None:
      return False
    written = self.running[first].num_computed_tokens + step.num_scheduled.get(first, 0)
    shared = min(written, len(completion.request.prompt_token_ids) - 1)
    if shared < self.manager.block_size:
      return False
    self.manager.fork(first, completion.seq_id, shared)
    return True

  def _chunk(self, remaining: int, budget: int) -> int:
    """This step's tokens of a request with `remaining` to compute: all of them, or as many as
    the budget holds with chunked prefill; 0 when they do not fit."""
    if remaining <= budget:
      return remaining
    return budget if self.enable_chunked_prefill else 0

  def _preempt_latest(self, step: _StepPlan) -> str:
    """Frees the pages of the most recently admitted running completion that holds any and is
    not scheduled this step; returns its id, or "" when there is none."""
    held = (s for s in reversed(self.running) if self.manager.get_block_ids(s))
    victim = next((s for s in held if s not in step.num_scheduled), None)
    if victim is None:  # every page is held by this step's earlier requests: wait
      return ""
    self.manager.preempt(victim)
    self.running[victim].num_computed_tokens = 0
    step.preempted.append(victim)
    return victim

  # --- k-step decode ----------------------------------------------------------------------------

  def schedule_decode_steps(
    self, scheduled: SchedulerOutput, num_steps: int, max_model_len: int
  ) -> SchedulerOutput | None:
    """Turns a decode-only step into a k-step decode: reserves pages ahead for each row.

    A step qualifies when it admits nothing and each scheduled completion computes exactly its
    last sampled token. Each row may then sample up to `min(num_steps, its outputs left under
    max_tokens, max_model_len - its tokens)` tokens; the pages for the positions those need are
    allocated now (lookahead, in scheduling order). Lookahead never preempts: a row the pool
    cannot serve in full gets the positions left in its own pages and in the free ones (at
    least its one token).
    Call right after `schedule`; after the step, advance the computed counts by the tokens each
    row actually sampled (`update_after_step` of an output whose `num_scheduled_tokens` are
    those counts).

    Args:
      scheduled: this step's plan from `schedule`.
      num_steps: `k`, the most tokens per row (`>= 2`).
      max_model_len: the engine's limit on a sequence's tokens.

    Returns:
      `scheduled` with the tables of the rows given lookahead pages in `block_ids` and
      `num_decode_steps`
      set, or None (nothing changed) when the step does not qualify or no row may take more
      than one token.
    """
    counts = scheduled.num_scheduled_tokens
    if scheduled.admitted or not counts or any(n != 1 for n in counts.values()):
      return None
    if any(self._num_remaining(seq_id) != 1 for seq_id in counts):
      return None
    wanted = {
      seq_id: self._decode_steps_wanted(seq_id, num_steps, max_model_len) for seq_id in counts
    }
    if max(wanted.values()) < 2:
      return None
    block_ids = dict(scheduled.block_ids)
    granted = {}
    for seq_id, steps in wanted.items():
      lookahead, blocks = self._allocate_lookahead(seq_id, steps - 1)
      granted[seq_id] = 1 + lookahead
      if blocks or self.manager.frees_pages:
        block_ids[seq_id] = self.manager.get_group_block_ids(seq_id)
    return dataclasses.replace(scheduled, block_ids=block_ids, num_decode_steps=granted)

  def _allocate_lookahead(self, seq_id: str, lookahead: int) -> tuple[int, list[int]]:
    """Pages for `lookahead` positions after a decoding completion's token this step, or for as
    many as its own pages and the free pages hold (never preempting); returns the positions
    reserved and the pages appended."""
    computed = self.running[seq_id].num_computed_tokens + 1  # this step's token included
    token_ids = self.running[seq_id].all_token_ids
    blocks = self.manager.allocate_slots(
      seq_id, 0, num_computed_tokens=computed, token_ids=token_ids, num_lookahead_tokens=lookahead
    )
    if blocks is not None:
      return lookahead, blocks
    block_size = self.manager.block_size
    held = len(self.manager.get_block_ids(seq_id)) * block_size - computed
    lookahead = min(lookahead, held + self.manager.block_pool.num_free_blocks * block_size)
    blocks = self.manager.allocate_slots(
      seq_id, 0, num_computed_tokens=computed, token_ids=token_ids, num_lookahead_tokens=lookahead
    )
    return (lookahead, blocks) if blocks is not None else (held, [])

  def _decode_steps_wanted(self, seq_id: str, num_steps: int, max_model_len: int) -> int:
    """The most tokens a decoding completion can sample in a k-step loop before its length
    limits stop it (`max_tokens`, `max_model_len`)."""
    completion = self.running[seq_id]
    max_tokens = completion.params.max_tokens or max_model_len
    num_output = len(completion.token_ids) + completion.num_output_placeholders  # unread too
    left = min(max_tokens - num_output, max_model_len - completion.num_tokens_with_placeholders)
    return max(1, min(num_steps, left))


@dataclasses.dataclass
class _StepPlan:
  """The step being planned: the budget left and what is scheduled so far."""

  budget: int
  admitted: list[Completion] = dataclasses.field(default_factory=list)
  num_scheduled: dict[str, int] = dataclasses.field(default_factory=dict)
  new_block_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
  preempted: list[str] = dataclasses.field(default_factory=list)
  spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)

  def add(self, seq_id: str, count: int, block_ids: list[int]) -> None:
    self.num_scheduled[seq_id] = count
    self.new_block_ids[seq_id] = list(block_ids)
    self.budget -= count
