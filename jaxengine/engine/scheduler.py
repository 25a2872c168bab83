"""The scheduler: which completions run, in arrival order, within the batch's rows.

First come, first served: waiting completions are admitted into free rows at the start of a step;
a completion keeps its row until it finishes. (Preemption, priorities and chunked prefill would
land here.)
"""

from __future__ import annotations

import collections
import dataclasses

from jaxengine.engine.requests import Completion, Request


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
  """What one step runs.

  Attributes:
    admitted: completions that join the batch this step (they need a row and a prefill).
  """

  admitted: list[Completion]


class RequestQueues:
  """The queues every scheduler keeps: completions waiting for a row, in arrival order, and the
  running ones, in admission order. `Scheduler` and the paged engine's `PagedScheduler` add
  their own `schedule`.

  Args:
    max_num_reqs: completions that may run at once (the batch's rows).
  """

  def __init__(self, max_num_reqs: int) -> None:
    self.max_num_reqs = max_num_reqs
    self.waiting: collections.deque[Completion] = collections.deque()
    #: Running completions in admission order.
    self.running: dict[str, Completion] = {}

  def add_request(self, request: Request) -> None:
    """Queues every completion of `request`."""
    self.waiting.extend(request.completions)

  def has_unfinished(self) -> bool:
    """Whether any completion is waiting or running."""
    return bool(self.waiting or self.running)

  def finish(self, completion: Completion) -> None:
    """Frees a finished completion's place."""
    del self.running[completion.seq_id]

  def abort(self, request_ids: set[str]) -> list[Completion]:
    """Drops every waiting completion of these requests; returns the running ones, which the
    caller finishes (`finish`) once it has freed their rows."""
    self.waiting = collections.deque(
      c for c in self.waiting if c.request.request_id not in request_ids
    )
    return [c for c in self.running.values() if c.request.request_id in request_ids]


class Scheduler(RequestQueues):
  """Admits waiting completions into at most `max_num_reqs` running ones.

  Args:
    max_num_reqs: completions that may run at once (the batch's rows).
  """

  def schedule(self) -> SchedulerOutput:
    """Admits waiting completions, oldest first, while rows are free."""
    admitted = []
    while self.waiting and len(self.running) < self.max_num_reqs:
      completion = self.waiting.popleft()
      self.running[completion.seq_id] = completion
      admitted.append(completion)
    return SchedulerOutput(admitted=admitted)
