"""What the engine thread reports after each step, for metrics (vLLM's `IterationStats` and
`FinishedRequestStats`): `AsyncLLM` hands them to its stat loggers (`metrics.py` is one)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class FinishedRequestStats:
  """One finished request, for metrics (times in seconds)."""

  finish_reason: str
  e2e_latency_s: float
  num_prompt_tokens: int
  num_generation_tokens: int


@dataclasses.dataclass
class IterationStats:
  """What one engine step did, for metrics (times in seconds, tokens summed over requests).

  Attributes:
    num_running: completions holding a row after the step.
    num_waiting: completions waiting for a row after the step.
    num_prompt_tokens: prompt tokens of the requests that produced their first token.
    num_generation_tokens: tokens generated in the step.
    time_to_first_tokens_s: one entry per request that produced its first token.
    time_per_output_tokens_s: one entry per generated token after a request's first.
    finished: the requests that finished (or were aborted) in the step.
  """

  num_running: int = 0
  num_waiting: int = 0
  num_prompt_tokens: int = 0
  num_generation_tokens: int = 0
  time_to_first_tokens_s: list[float] = dataclasses.field(default_factory=list)
  time_per_output_tokens_s: list[float] = dataclasses.field(default_factory=list)
  finished: list[FinishedRequestStats] = dataclasses.field(default_factory=list)


#: Called on the engine thread after every step (and abort) with its `IterationStats`.
StatLogger = Callable[[IterationStats], None]
