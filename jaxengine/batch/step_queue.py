"""The batch's in-flight steps: dispatched to the device, not read yet, oldest first.

`InputBatch.dispatch_step` pushes each step it runs; `InputBatch.resolve` pops them in dispatch
order and appends their tokens to the rows still in the batch. A step whose token counts are
known at dispatch (`PendingStep.num_new_tokens`, one token per sampling row) counts them here
until it is read, so `InputBatch.num_tokens` (what the next step plans with) includes them: that
is what lets asynchronous scheduling dispatch the next step before reading this one. The queue
holds at most `max_pending` steps: one more reads the oldest (its output has long been computed
by then, so reading it costs a copy, not a wait).
"""

from __future__ import annotations

import collections

from jaxengine.batch.host_output import PendingStep

#: Dispatched steps a batch keeps unread; one more resolves the oldest.
MAX_PENDING_STEPS = 4


class StepQueue:
  """Dispatched steps oldest first, and the tokens each request has in flight.

  Args:
    max_pending: steps kept unread before `push` asks for the oldest to be read.
  """

  def __init__(self, max_pending: int = MAX_PENDING_STEPS) -> None:
    self.max_pending = max_pending
    self._steps: collections.deque[PendingStep] = collections.deque()
    self._num_in_flight: dict[str, int] = {}

  def __len__(self) -> int:
    return len(self._steps)

  def push(self, step: PendingStep) -> bool:
    """Queues a dispatched step and counts its known tokens per request; True when the queue
    is past `max_pending` (the caller reads the oldest)."""
    if step.num_new_tokens is not None:
      for (req_id, _), count in zip(step.rows, step.num_new_tokens):
        self._num_in_flight[req_id] = self._num_in_flight.get(req_id, 0) + count
    self._steps.append(step)
    return len(self._steps) > self.max_pending

  def oldest(self) -> PendingStep:
    """The oldest unread step (IndexError when none)."""
    return self._steps[0]

  def pop_oldest(self) -> PendingStep:
    """Removes the oldest step and fetches its output to the host (`step.fetched`)."""
    step = self._steps.popleft()
    step.fetched = step.fetch(step.output, len(step.rows), step.num_logprobs)
    return step

  def landed(self, req_id: str, count: int) -> None:
    """`count` of a request's in-flight tokens were read (appended to its outputs)."""
    if count:
      self._num_in_flight[req_id] -= count

  def num_in_flight(self, req_id: str) -> int:
    """Tokens of `req_id` in unread steps whose counts were known at dispatch."""
    return self._num_in_flight.get(req_id, 0)

  def forget(self, req_id: str) -> None:
    """Drops a removed request's count (its tokens in unread steps are dropped when read)."""
    self._num_in_flight.pop(req_id, None)

  def last_counts_unknown(self) -> bool:
    """Whether the newest step's token counts are known only from its output (then it must be
    read before the next step is planned)."""
    return bool(self._steps) and self._steps[-1].num_new_tokens is None
