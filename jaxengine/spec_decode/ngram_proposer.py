"""Speculative decoding with n-gram (prompt lookup) drafts: the proposer and the stats.

Each step, for every running completion, `NgramProposer` looks for the longest suffix n-gram of
its tokens (prompt then output; `n` from `prompt_lookup_max` down to `prompt_lookup_min`) earlier
in the same sequence, and proposes the (up to `k`) tokens that followed its last occurrence
(the last one followed by `k` tokens; see `ngram_draft`). The
runner then feeds each row's last token and its drafts to the model in one pass over `k + 1`
positions and `jaxengine.sample.rejection_sample` keeps the longest prefix the target model
agrees with, plus one recovered or bonus token (`worker/verify_step.py`). Everything here is host
NumPy: the search costs microseconds per row (`SpecDecodingStats.draft_time_s` measures it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from jaxengine.spec_decode.config import SpeculativeConfig

#: The acceptance estimate's prior (accepted draft tokens out of trials: optimistic, so a new row
#: gets verified and shows what its drafts are worth) and decays: per verify of the row, and per
#: step (so a row whose drafts failed is tried again after a while).
PRIOR_ACCEPTED, PRIOR_TRIALS = 1.0, 1.0
VERIFY_DECAY, STEP_DECAY = 0.8, 0.97
#: The verify decision's cost model, per backend: the batch tokens whose compute costs as much as
#: one read of the weights (`worth_verifying` weighs cost `crossover + tokens`). Small on CPUs,
#: where compute dominates at once; large on accelerators, where a pass is bound by reading the
#: weights.
CROSSOVER_TOKENS = {"cpu": 4}
DEFAULT_CROSSOVER_TOKENS = 256


def ngram_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
  """Prompt lookup on one sequence: the tokens that followed the suffix's last earlier match.

  Args:
    tokens: `[L] int32` the sequence (prompt then output).
    min_n, max_n: the suffix n-gram lengths tried, longest first.
    k: the most tokens proposed.

  Returns:
    `[d] int32`, `0 <= d <= k`: the tokens after an earlier occurrence of the longest suffix
    n-gram (`min_n <= n <= max_n`) that occurs earlier: its last occurrence followed by at
    least `k` tokens, else its first (followed by the most); empty when none occurs.
  """
  length = len(tokens)
  if length < min_n + 1 or k < 1:
    return tokens[:0]
  # Ends of earlier matches of the last token, then how far each match extends backwards.
  ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
  if len(ends) == 0:
    return tokens[:0]
  matched = np.ones(len(ends), np.int32)
  alive = np.ones(len(ends), bool)
  for j in range(1, min(max_n, length - 1)):
    before = ends - j
    alive &= (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[length - 1 - j])
    if not alive.any():
      break
    matched += alive
  best = int(matched.max())
  if best < min_n:
    return tokens[:0]
  longest = ends[matched == best]
  # The most recent match with k tokens after it, else the earliest (the most tokens after it):
  # in a periodic tail the latest matches overlap the suffix and leave too few tokens to copy.
  full = longest[longest + k <= length - 1]
  end = int(full[-1] if len(full) else longest[0])
  return tokens[end + 1 : end + 1 + k]


@dataclasses.dataclass
class SpecDecodingStats:
  """Counters of an engine's speculative steps (vLLM's metric names).

  Attributes:
    num_drafts: row-steps that verified at least one draft token.
    num_draft_tokens: draft tokens verified.
    num_accepted_tokens: draft tokens the target model accepted.
    num_accepted_tokens_per_pos: accepted drafts by position `0..k-1`.
    num_spec_steps: steps that ran the verify pass (the others decoded one token per row).
    num_declined_steps: steps with drafts that decoded one token instead, the cost model
      expecting too few accepted drafts to pay for the wider pass (`worth_verifying`).
    num_steps: steps that looked for drafts (a step while a structured-output row runs does
      not: it decodes one token per row).
    draft_time_s: host seconds spent proposing drafts.
  """

  num_drafts: int = 0
  num_draft_tokens: int = 0
  num_accepted_tokens: int = 0
  num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
  num_spec_steps: int = 0
  num_declined_steps: int = 0
  num_steps: int = 0
  draft_time_s: float = 0.0

  @property
  def acceptance_rate(self) -> float:
    """Accepted over proposed draft tokens (0 before any draft)."""
    return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

  def record(self, num_draft: np.ndarray, num_sampled: np.ndarray) -> None:
    """Counts one verify step: `[N]` drafts per row and tokens emitted per row."""
    has_draft = num_draft > 0
    accepted = np.minimum(np.maximum(num_sampled - 1, 0), num_draft)
    self.num_spec_steps += 1
    self.num_drafts += int(has_draft.sum())
    self.num_draft_tokens += int(num_draft.sum())
    self.num_accepted_tokens += int(accepted.sum())
    per_pos = self.num_accepted_tokens_per_pos
    for count in accepted[accepted > 0].tolist():
      per_pos.extend([0] * (count - len(per_pos)))
      for j in range(count):
        per_pos[j] += 1


class Proposer(Protocol):
  """What `SpeculativePolicy` asks of a drafter (`NgramProposer`, `SuffixProposer`)."""

  def propose(self, completions: Sequence, limits: Sequence[int]) -> Drafts: ...

  def record(
    self, completions: Sequence, num_draft: np.ndarray, num_sampled: np.ndarray
  ) -> None: ...

  def expected_gain(self, completions: Sequence, drafts: Drafts) -> float: ...


@dataclasses.dataclass(frozen=True)
class Drafts:
  """One step's drafts over the batch's live rows (`N` rows, `k` draft slots).

  Attributes:
    token_ids: `[N, k] int32` draft tokens (0 past each row's count).
    num_draft_tokens: `[N] int32` drafts per row, in `[0, k]`.
  """

  token_ids: np.ndarray
  num_draft_tokens: np.ndarray


@dataclasses.dataclass
class AcceptanceEstimate:
  """A row's decayed counts of accepted drafts, the cost model's estimate of its next draft.

  Attributes:
    accepted: decayed count of accepted draft tokens.
    trials: decayed count of draft positions decided (accepted, or the first rejected).
  """

  accepted: float = 0.0
  trials: float = 0.0

  @property
  def acceptance(self) -> float:
    """Estimated chance that the next draft token is accepted (1 to start)."""
    return (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

  def decay(self) -> None:
    """One step passed (`STEP_DECAY`): old outcomes weigh less."""
    self.accepted *= STEP_DECAY
    self.trials *= STEP_DECAY

  def update(self, drafted: int, emitted: int) -> None:
    """A verify of `drafted` drafts that emitted `emitted` tokens (`VERIFY_DECAY`)."""
    accepted = min(max(emitted - 1, 0), drafted)
    self.accepted = self.accepted * VERIFY_DECAY + accepted
    self.trials = self.trials * VERIFY_DECAY + accepted + (accepted < drafted)


def record_acceptance(
  estimates: Mapping[str, AcceptanceEstimate],
  completions: Sequence,
  num_draft: np.ndarray,
  num_sampled: np.ndarray,
) -> None:
  """Updates each drafted row's estimate (by `seq_id`) after a verify step (`[N]` drafts and
  emitted tokens per row, rows in `completions` order)."""
  for completion, drafted, emitted in zip(completions, num_draft.tolist(), num_sampled.tolist()):
    if drafted > 0:
      estimates[completion.seq_id].update(drafted, emitted)


def expected_gain(
  estimates: Mapping[str, AcceptanceEstimate], completions: Sequence, drafts: Drafts
) -> float:
  """Draft tokens the rows are expected to have accepted: `sum_i sum_{j <= d_i} a_i^j`, `a_i`
  row i's acceptance estimate (accepting draft j needs drafts 1..j accepted)."""
  gain = 0.0
  for completion, drafted in zip(completions, drafts.num_draft_tokens.tolist()):
    a = estimates[completion.seq_id].acceptance
    gain += sum(a**j for j in range(1, drafted + 1))
  return gain


@dataclasses.dataclass
class _Buffer(AcceptanceEstimate):
  """One completion's tokens on the host: `tokens[:length]`, the prompt then the output, as one
  NumPy array for the vectorised search (vLLM's proposer reads the batch's `token_ids_cpu` for
  the same reason). It copies one way from the completion's `token_ids`, the tokens' one record:
  each lookup appends the tokens it does not hold yet, and nothing else reads or writes them."""

  completion: object = None
  tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int32))
  length: int = 0


class NgramProposer:
  """Per-completion token buffers on the host and the n-gram lookup over them.

  Args:
    config: the speculative config.
    max_model_len: longest prompt plus output (the buffers' size).
  """

  def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
    self.config = config
    self.max_model_len = max_model_len
    self._buffers: dict[str, _Buffer] = {}

  def _sync(self, completion) -> np.ndarray:
    """The completion's tokens so far: its buffer, started with the prompt on first sight (a
    reused id with a new completion starts afresh) and extended with the output tokens it does
    not hold yet."""
    buffer = self._buffers.get(completion.seq_id)
    if buffer is None or buffer.completion is not completion:
      prompt = completion.request.prompt_token_ids
      tokens = np.zeros((self.max_model_len,), np.int32)
      tokens[: len(prompt)] = prompt
      buffer = _Buffer(completion=completion, tokens=tokens, length=len(prompt))
      self._buffers[completion.seq_id] = buffer
    new = completion.token_ids[buffer.length - len(completion.request.prompt_token_ids) :]
    if new:
      buffer.tokens[buffer.length : buffer.length + len(new)] = new
      buffer.length += len(new)
    return buffer.tokens[: buffer.length]

  def propose(self, completions: Sequence, limits: Sequence[int]) -> Drafts:
    """Drafts for each running completion, at most `limits[i]` (and `k`) for the i-th.

    Buffers of completions no longer passed are dropped.

    Args:
      completions: the `Completion`s of the batch's live rows, in row order.
      limits: the most drafts each row may take (so that it never passes `max_tokens` or
        `max_model_len`; 0 for rows that must not speculate).

    Returns:
      `Drafts` over those rows.
    """
    config = self.config
    k = config.num_speculative_tokens
    token_ids = np.zeros((len(completions), k), np.int32)
    counts = np.zeros((len(completions),), np.int32)
    for row, (completion, limit) in enumerate(zip(completions, limits)):
      tokens = self._sync(completion)
      self._buffers[completion.seq_id].decay()
      if limit <= 0:
        continue
      draft = ngram_draft(tokens, config.prompt_lookup_min, config.prompt_lookup_max, min(k, limit))
      token_ids[row, : len(draft)] = draft
      counts[row] = len(draft)
    if len(self._buffers) > len(completions):
      for seq_id in set(self._buffers) - {c.seq_id for c in completions}:
        del self._buffers[seq_id]
    return Drafts(token_ids=token_ids, num_draft_tokens=counts)

  def record(self, completions: Sequence, num_draft: np.ndarray, num_sampled: np.ndarray) -> None:
    """Updates each row's acceptance estimate after a verify step (`record_acceptance`)."""
    record_acceptance(self._buffers, completions, num_draft, num_sampled)

  def expected_gain(self, completions: Sequence, drafts: Drafts) -> float:
    """Draft tokens the rows are expected to have accepted (`expected_gain`)."""
    return expected_gain(self._buffers, completions, drafts)


def worth_verifying(
  gain: float, num_reqs: int, num_rows: int, k: int, crossover_tokens: float
) -> bool:
  """Whether a verify pass is expected to emit tokens faster than a one-token decode step.

  A pass over `T` batch tokens is modelled to cost `crossover_tokens + T`: decode computes
  `num_rows` tokens (the row bucket) and emits `num_reqs`; verify computes `num_rows * (k + 1)`
  and emits `num_reqs + gain`. The decision depends on the rows' tokens only (no timing), so
  seeded outputs repeat from run to run.
  """
  verify_rate = (num_reqs + gain) / (crossover_tokens + num_rows * (k + 1))
  return verify_rate > num_reqs / (crossover_tokens + num_rows)


def draft_limits(completions: Sequence, max_model_len: int, k: int) -> list[int]:
  """The most drafts each completion may verify this step: one step emits at most
  `drafts + 1` tokens, which must fit its `max_tokens` and `max_model_len`."""
  limits = []
  for completion in completions:
    max_tokens = completion.params.max_tokens or max_model_len
    remaining = min(max_tokens - len(completion.token_ids), max_model_len - completion.num_tokens)
    limits.append(max(0, min(k, remaining - 1)))
  return limits


def timed_propose(
  proposer: Proposer, stats: SpecDecodingStats, completions: Sequence, limits: Sequence[int]
) -> Drafts:
  """`proposer.propose`, its host time added to `stats.draft_time_s`."""
  start = time.perf_counter()
  drafts = proposer.propose(completions, limits)
  stats.draft_time_s += time.perf_counter() - start
  return drafts
