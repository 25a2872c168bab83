"""Prompt logprobs gathered chunk by chunk: a prefill split over several steps computes its
prompt's logprobs a piece at a time; `PromptLogprobs` keeps the pieces until the prompt's last
prediction and hands the whole `[num_prompt_tokens - 1, k + 1]` arrays back once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np

from jaxengine.batch.host_output import LogprobsArrays
from jaxengine.core.request import Completion
from jaxengine.core.scheduler import SchedulerOutput
from jaxengine.sample import LogprobsTensors


@dataclasses.dataclass
class _Pending:
  """A prompt's logprobs gathered chunk by chunk until its last prediction (its request id and
  prompt read from the completion's `Request`, not copied)."""

  completion: Completion
  parts: list[LogprobsArrays] = dataclasses.field(default_factory=list)

  @property
  def num_prompt_tokens(self) -> int:
    """The prompt's tokens."""
    return len(self.completion.request.prompt_token_ids)


class PromptLogprobs:
  """The prompts whose logprobs the runner computes, by `seq_id` (the first sample of a request
  asking for `prompt_logprobs`), and their pieces so far."""

  def __init__(self) -> None:
    self._pending: dict[str, _Pending] = {}

  def add(self, completion: Completion) -> None:
    """Notes `completion`'s prompt when its logprobs are wanted (`Completion.wants_prompt_logprobs`)."""
    if completion.wants_prompt_logprobs:
      self._pending[completion.seq_id] = _Pending(completion)

  def remove(self, seq_id: str) -> None:
    """Forgets `seq_id`'s prompt (finished or aborted)."""
    self._pending.pop(seq_id, None)

  def restart(self, seq_id: str) -> None:
    """Drops the pieces of a preempted `seq_id` (its prompt is recomputed from the start)."""
    if seq_id in self._pending:
      self._pending[seq_id].parts.clear()

  def wanted(self, scheduled: SchedulerOutput) -> list[str]:
    """The scheduled completions whose prompt logprobs the step computes."""
    return [s for s in scheduled.num_scheduled_tokens if s in self._pending]

  def collect(
    self,
    scheduled: SchedulerOutput,
    wanted: list[str],
    query_starts: Mapping[str, int],
    token_logprobs: LogprobsTensors,
  ) -> dict[str, LogprobsArrays]:
    """Keeps the logprobs of the prompt tokens predicted in a step; returns, by request id,
    those of the prompts whose last prediction was in it.

    Args:
      scheduled: the step's plan.
      wanted: the completions `wanted` named at dispatch.
      query_starts: their first flat token index in the step.
      token_logprobs: the step's `[T, k + 1]` logprobs of each flat token's next token.
    """
    host = jax.device_get(token_logprobs)
    done = {}
    for seq_id in wanted:
      pending = self._pending.get(seq_id)
      if pending is None:  # finished or aborted since the dispatch
        continue
      computed = scheduled.num_computed_tokens[seq_id]
      scheduled_count = scheduled.num_scheduled_tokens[seq_id]
      count = min(scheduled_count, pending.num_prompt_tokens - 1 - computed)
      if count > 0:
        rows = slice(query_starts[seq_id], query_starts[seq_id] + count)
        pending.parts.append(
          LogprobsArrays(host.token_ids[rows], host.logprobs[rows], host.ranks[rows])
        )
      if computed + scheduled_count >= pending.num_prompt_tokens:
        del self._pending[seq_id]
        parts = pending.parts
        if not parts:  # a one-token prompt: nothing predicts its only token
          continue
        done[pending.completion.request.request_id] = LogprobsArrays(
          token_ids=np.concatenate([p.token_ids for p in parts]),
          logprobs=np.concatenate([p.logprobs for p in parts]),
          ranks=np.concatenate([p.ranks for p in parts]),
        )
    return done
