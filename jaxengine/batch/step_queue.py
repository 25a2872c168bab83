"""The batch's in-flight steps: dispatched to the device, not read yet, oldest first.

`InputBatch.dispatch_step` pushes each step it runs; `InputBatch.resolve` pops them in dispatch
order and appends their tokens to the rows still in the batch. A step whose token counts are
known at dispatch (`PendingStep.num_new_tokens`, one token per sampling row) is counted in each
row's `RequestLedger.num_output_placeholders` until it is read (`jaxengine/batch/ledger.py`: the
request's own record, not a count kept here), so `InputBatch.num_tokens` (what the next step plans
with) includes them: that is what lets asynchronous scheduling dispatch the next step before
reading this one. The queue holds at most `max_pending` steps: one more reads the oldest (its
output has long been computed by then, so reading it costs a copy, not a wait).
"""

from __future__ import annotations

import collections

from jaxengine.batch.host_output import PendingStep

#: Dispatched steps a batch keeps unread; one more resolves the oldest.
MAX_PENDING_STEPS = 4


class StepQueue:
  """Dispatched steps, oldest first.

  Args:
    max_pending: steps kept unread before `push` asks for the oldest to be read.
  """

  def __init__(self, max_pending: int = MAX_PENDING_STEPS) -> None:
    self.max_pending = max_pending
    self._steps: collections.deque[PendingStep] = collections.deque()

  def __len__(self) -> int:
    return len(self._steps)

  def push(self, step: PendingStep) -> bool:
    """Queues a dispatched step; True when the queue is past `max_pending` (the caller reads
    the oldest)."""
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

  def last_counts_unknown(self) -> bool:
    """Whether the newest step's token counts are known only from its output (then it must be
    read before the next step is planned)."""
    return bool(self._steps) and self._steps[-1].num_new_tokens is None
