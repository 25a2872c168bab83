"""What a model runner hands back: a step's host output, and a step dispatched but not read."""

from __future__ import annotations

import dataclasses

from jaxengine.batch.host_output import LogprobsArrays, PendingStep
from jaxengine.batch.step_loop import HostMultiStepOutput
from jaxengine.core.scheduler import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """One ragged step on the host.

  Attributes:
    req_ids: the batch's row ids (`num_reqs`), the order of `sampled`'s arrays.
    sampled: the sampled token of each row (`num_sampled` 1 for rows that produced one).
    prompt_logprobs: by request id, `LogprobsArrays` of `[num_prompt_tokens - 1, k + 1]` (the
      logprobs of prompt tokens `1..`) of each prompt whose last prediction was in this step.
  """

  req_ids: list[str]
  sampled: HostMultiStepOutput
  prompt_logprobs: dict[str, LogprobsArrays]


@dataclasses.dataclass(frozen=True)
class InFlightStep:
  """A ragged step `ModelRunner.dispatch` sent to the device, not read yet.

  Attributes:
    scheduled: the scheduler's plan it runs.
    pending: the batch's record of it (`InputBatch.dispatch_step`).
    num_new_tokens: tokens it appends to each row (`seq_id` -> 0 or 1), or None with drafts
      (then only its output tells, and it must be collected before the next dispatch).
    prompt_logprobs_wanted: completions whose prompt logprobs it computes.
    query_starts: their first flat token index in the step.
  """

  scheduled: SchedulerOutput
  pending: PendingStep[HostMultiStepOutput]
  num_new_tokens: dict[str, int] | None
  prompt_logprobs_wanted: list[str]
  query_starts: dict[str, int]

  def num_counted_tokens(self, seq_id: str) -> int:
    """The tokens of `seq_id` it computes that were counted in `num_computed_tokens` at its
    dispatch (its counts known then: `num_new_tokens`), before it is collected; 0 with drafts
    (counted when collected)."""
    if self.num_new_tokens is None:
      return 0
    return self.scheduled.num_scheduled_tokens.get(seq_id, 0)
