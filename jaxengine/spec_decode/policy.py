"""When a step verifies drafts instead of decoding one token per row: the speculative
cost policy of `LLMEngine` (`speculative_config`).

Each step with speculation on, `SpeculativePolicy.drafts` proposes drafts for the running
completions (`NgramProposer` or `SuffixProposer`, by `method`, within each row's
`draft_limits`) and weighs them: the verify pass runs only when some row has a draft and the
cost model (`worth_verifying`, each row's drafts weighted by its acceptance so far) expects it
to emit tokens faster than a one-token decode step. After a verify pass, `record` updates the
counters and each row's acceptance estimate. The policy only decides; the runner runs the steps
and the engine applies their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxengine.core.request import Completion
from jaxengine.spec_decode.config import SpeculativeConfig
from jaxengine.spec_decode.ngram_proposer import (
  Drafts,
  NgramProposer,
  Proposer,
  SpecDecodingStats,
  draft_limits,
  timed_propose,
  worth_verifying,
)
from jaxengine.spec_decode.suffix_proposer import SuffixProposer


class SpeculativePolicy:
  """The drafts to verify each step, and what verification taught about each row.

  Args:
    config: the engine's speculative config.
    max_model_len: longest prompt plus output (drafts never pass it).
    stats: the engine's counters (`LLMEngine.spec_decode_stats`), updated in place.
  """

  def __init__(
    self, config: SpeculativeConfig, max_model_len: int, stats: SpecDecodingStats
  ) -> None:
    self.config = config
    self.max_model_len = max_model_len
    self.stats = stats
    self.proposer: Proposer
    if config.method == "suffix":
      self.proposer = SuffixProposer(config, max_model_len)
    else:
      self.proposer = NgramProposer(config, max_model_len)

  def drafts(
    self, completions: Sequence[Completion], num_rows: int, crossover_tokens: float
  ) -> Drafts | None:
    """This step's drafts, or None when the step should decode one token per row instead.

    Args:
      completions: the running completions in batch row order (the batch condensed).
      num_rows: the row bucket a step over them computes.
      crossover_tokens: the cost model's crossover (`LLMEngine.spec_crossover_tokens`).

    Returns:
      `Drafts` over `completions` when some row has a draft and verifying them is expected to
      pay (`worth_verifying`), else None (a declined step is counted).
    """
    stats = self.stats
    stats.num_steps += 1
    k = self.config.num_speculative_tokens
    limits = draft_limits(completions, self.max_model_len, k)
    drafts = timed_propose(self.proposer, stats, completions, limits)
    if not drafts.num_draft_tokens.any():
      return None
    gain = self.proposer.expected_gain(completions, drafts)
    if not worth_verifying(gain, len(completions), num_rows, k, crossover_tokens):
      stats.num_declined_steps += 1
      return None
    return drafts

  def record(
    self, completions: Sequence[Completion], drafts: Drafts, num_sampled: np.ndarray
  ) -> None:
    """Counts a verify pass of `drafts` that emitted `num_sampled` (`[N] int32`) tokens per row,
    and updates each row's acceptance estimate."""
    self.stats.record(drafts.num_draft_tokens, num_sampled)
    self.proposer.record(completions, drafts.num_draft_tokens, num_sampled)
