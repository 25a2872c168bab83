"""Speculative decoding on the host: which decodes get drafts before a step, what a step accepted.

Each step with `speculative_config`, `Speculation.propose` asks the engine's `SpeculativePolicy`
for drafts of the running decodes (none while a row with structured outputs runs); the
`Scheduler` schedules a drafted decode as `1 + d` query tokens, and the worker verifies them
(`worker/verify_step.py`). `Speculation.record` counts the accepted drafts afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxengine.core.request import Completion
from jaxengine.core.scheduler import Scheduler, SchedulerOutput
from jaxengine.spec_decode.ngram_proposer import Drafts
from jaxengine.spec_decode.policy import SpeculativePolicy


class Speculation:
  """The paged engine's drafts: what to propose before a step, what to count after it.

  Args:
    policy: the engine's `SpeculativePolicy` (drafts, cost model, `spec_decode_stats`).
  """

  def __init__(self, policy: SpeculativePolicy) -> None:
    self.policy = policy
    self._completions: list[Completion] = []  # the rows last proposed for, in that order

  def propose(
    self, scheduler: Scheduler, num_rows: int, crossover_tokens: float
  ) -> dict[str, list[int]]:
    """Drafts for the running decodes (completions whose only token left to compute is their
    last): `seq_id` -> tokens, empty when none has a draft or the cost model declines.

    Args:
      scheduler: the paged scheduler (before `schedule`).
      num_rows: the row bucket of the step.
      crossover_tokens: the cost model's crossover (`LLMEngine.spec_crossover_tokens`).
    """
    decodes = [c for c in scheduler.running.values() if c.num_tokens - c.num_computed_tokens == 1]
    self._completions = []
    if not decodes:
      return {}
    drafts = self.policy.drafts(decodes, num_rows, crossover_tokens)
    if drafts is None:
      return {}
    self._completions = decodes
    counts = drafts.num_draft_tokens.tolist()
    return {
      c.seq_id: drafts.token_ids[i, :n].tolist()
      for i, (c, n) in enumerate(zip(decodes, counts))
      if n
    }

  def record(
    self, scheduled: SchedulerOutput, req_ids: Sequence[str], num_sampled: np.ndarray
  ) -> dict[str, int]:
    """Counts a step's verified drafts (`spec_decode_stats`, each row's acceptance estimate).

    Args:
      scheduled: the step's plan (the drafts it scheduled, maybe fewer than proposed).
      req_ids: the batch's rows, the order of `num_sampled`.
      num_sampled: `[N] int32` tokens each row emitted.

    Returns:
      Accepted drafts by `seq_id`, for `Scheduler.update_after_step`.
    """
    if not scheduled.spec_token_ids:
      return {}
    emitted = dict(zip(req_ids, num_sampled.tolist()))
    completions = self._completions
    num_draft = np.array([len(scheduled.spec_token_ids.get(c.seq_id, ())) for c in completions])
    sampled = np.array([emitted.get(c.seq_id, 0) for c in completions])
    counts = Drafts(token_ids=np.zeros((len(completions), 0), np.int32), num_draft_tokens=num_draft)
    self.policy.record(completions, counts, sampled)
    return {seq_id: max(emitted[seq_id] - 1, 0) for seq_id in scheduled.spec_token_ids}
