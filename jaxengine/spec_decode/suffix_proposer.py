"""Suffix decoding: drafts from suffix trees over the request, its prompt's other samples, and
recent outputs (`speculative_config={"method": "suffix"}`, vLLM's name).

`SuffixProposer` keeps two kinds of `SuffixTree` (`spec_decode/suffix_tree.py`):

  - one per prompt (its token ids), over the prompt and the outputs of the completions of that
    prompt: the request's own output (what n-gram lookup sees), the other `n` samples of the
    request (a GRPO group) and any other request with the same prompt, running or finished and
    still cached. The prompt enters once however many samples it has; each output enters led by
    the prompt's last `depth - 1` tokens, so that the context at the prompt's end (before the
    first token of an answer) finds the answers given so far;
  - one over the outputs of finished completions (each led by its prompt's last tokens too), at
    most `suffix_decoding_max_cached_requests` of them, the oldest dropped first (its output
    leaves its prompt's tree too).

Each step, for every running completion, its prompt's tree first takes the tokens it gained
since the last step: the completion's open suffixes in that tree (`SuffixTree.extend`) are then
the nodes of its last 1 .. `depth - 1` tokens, its matches there for free; in the finished
outputs' tree its last tokens are looked up (`SuffixTree.matches`). From each match of `m` tokens
with a continuation `greedy_draft` follows the most frequent continuation for at most
`min(k, limit, factor * m)` tokens (`suffix_decoding_max_spec_factor`) while the draft's
estimated probability stays at or above `suffix_decoding_min_token_prob`. The draft with the
highest expected number of accepted tokens (the sum of its prefixes' probabilities) wins, the
prompt's tree first on a tie. Drafts are verified by the rejection sampler like n-gram drafts, so
outputs are those of plain decoding; only speed changes.

A completion that leaves the running decodes (finished, aborted or preempted) is seen gone at the
next call: a finished one's output joins the cache (it stays in its prompt's tree and enters the
finished outputs'); a preempted one's output leaves its prompt's tree and is added again when it
runs again. Host cost per step: `depth` node updates per new token of each row, plus the lookups
and drafts (`SpecDecodingStats.draft_time_s` measures them).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import cast

import numpy as np

from jaxengine.core.request import Completion
from jaxengine.spec_decode.config import SpeculativeConfig
from jaxengine.spec_decode.ngram_proposer import (
  AcceptanceEstimate,
  Drafts,
  expected_gain,
  record_acceptance,
)
from jaxengine.spec_decode.suffix_tree import TOTAL, Node, SuffixTree, greedy_draft


@dataclasses.dataclass
class _Group:
  """One prompt's tree: the prompt, then the outputs of its running and cached completions."""

  tree: SuffixTree
  num_running: int = 0
  num_cached: int = 0


@dataclasses.dataclass
class _State(AcceptanceEstimate):
  """One running completion: its place in its prompt's tree.

  Attributes:
    completion: the `Completion` (a reused `seq_id` with another one starts afresh).
    key: its prompt's token ids (its group's key).
    ends: its open suffixes in its prompt's tree (`SuffixTree.extend`): the nodes of its last
      1, 2, ... `depth - 1` tokens (prompt then output).
    num_synced: output tokens the tree holds.
  """

  completion: object = None
  key: tuple[int, ...] = ()
  ends: list[Node] = dataclasses.field(default_factory=list)
  num_synced: int = 0


class SuffixProposer:
  """Suffix-tree drafts for the running completions, and the cache of finished outputs.

  Args:
    config: the speculative config (`method == "suffix"`).
    max_model_len: longest prompt plus output (unused: drafts are capped by `limits`).
  """

  def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
    self.config = config
    self.max_model_len = max_model_len
    self.depth = config.suffix_decoding_max_tree_depth
    self._states: dict[str, _State] = {}
    self._groups: dict[tuple[int, ...], _Group] = {}
    #: Finished outputs, oldest first: (prompt key, output tokens).
    self._cache: collections.deque[tuple[tuple[int, ...], tuple[int, ...]]] = collections.deque()
    self._finished = SuffixTree(self.depth)  # over the outputs in `_cache`

  @property
  def num_cached(self) -> int:
    """Finished outputs held for drafting (at most `suffix_decoding_max_cached_requests`)."""
    return len(self._cache)

  # --- the trees' upkeep ----------------------------------------------------------------------

  def _sync(self, completion) -> _State:
    """The completion's state, started on first sight (its prompt's tree made if new) and given
    the output tokens the tree does not hold yet."""
    state = self._states.get(completion.seq_id)
    if state is not None and state.completion is not completion:
      self._leave(state)
      state = None
    if state is None:
      key = tuple(completion.request.prompt_token_ids)
      group = self._groups.get(key)
      if group is None:
        group = self._groups[key] = _Group(SuffixTree(self.depth))
        group.tree.extend(group.tree.start(), key)
      group.num_running += 1
      ends = group.tree.extend(group.tree.start(), self._lead(key))
      state = self._states[completion.seq_id] = _State(completion=completion, key=key, ends=ends)
    new = completion.token_ids[state.num_synced :]
    if new:
      state.ends = self._groups[state.key].tree.extend(state.ends, new)
      state.num_synced += len(new)
    return state

  def _leave(self, state: _State) -> None:
    """A completion left the running decodes: a finished one's output is cached, a preempted
    one's leaves its prompt's tree (it is added again if the completion runs again)."""
    completion = cast(Completion, state.completion)
    del self._states[completion.seq_id]
    group = self._groups[state.key]
    group.num_running -= 1
    output, lead = tuple(completion.token_ids), self._lead(state.key)
    if completion.finish_reason is not None and self.config.suffix_decoding_max_cached_requests:
      group.tree.extend(state.ends, output[state.num_synced :])  # the tokens since
      group.num_cached += 1
      self._finished.extend(self._finished.start(), lead + output)
      self._cache.append((state.key, output))
      while len(self._cache) > self.config.suffix_decoding_max_cached_requests:
        self._evict()
    else:
      group.tree.remove(lead + output[: state.num_synced])
    self._drop_if_empty(state.key)

  def _evict(self) -> None:
    """Drops the oldest cached output from the finished-outputs tree and its prompt's."""
    key, output = self._cache.popleft()
    sequence = self._lead(key) + output
    self._finished.remove(sequence)
    group = self._groups[key]
    group.tree.remove(sequence)
    group.num_cached -= 1
    self._drop_if_empty(key)

  def _lead(self, key: tuple[int, ...]) -> tuple[int, ...]:
    """The prompt's last `depth - 1` tokens, which lead each output in the trees."""
    return key[max(len(key) - self.depth + 1, 0) :]

  def _drop_if_empty(self, key: tuple[int, ...]) -> None:
    """Drops a prompt's tree once no completion of it runs or is cached."""
    group = self._groups[key]
    if group.num_running == 0 and group.num_cached == 0:
      del self._groups[key]

  # --- drafting -------------------------------------------------------------------------------

  def _draft(self, state: _State, limit: int) -> list[int]:
    """The best draft of at most `limit` tokens over the completion's trees (module docstring)."""
    config = self.config
    factor, min_prob = config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob
    completion, width = cast(Completion, state.completion), self.depth - 1  # the longest context
    if width == 0:
      return []
    output = completion.token_ids
    context = output[-width:]
    if len(context) < width:
      prompt = completion.request.prompt_token_ids
      context = list(prompt[max(len(prompt) - (width - len(context)), 0) :]) + context
    own = [(m, node) for m, node in enumerate(state.ends, 1) if node[TOTAL]][::-1]
    sources = [own]
    if self._finished.num_sequences:
      sources.append(self._finished.matches(context))
    best: list[int] = []
    best_score = 0.0
    for matches in sources:
      seen = 0  # occurrences of the longer match tried: a shorter one with no more drafts alike
      for m, node in matches:
        if node[TOTAL] <= seen:
          continue
        seen = node[TOTAL]
        tokens, score = greedy_draft(node, min(limit, int(factor * m)), min_prob)
        if score > best_score:
          best, best_score = tokens, score
    return best

  def propose(self, completions: Sequence, limits: Sequence[int]) -> Drafts:
    """Drafts for each running completion, at most `limits[i]` (and `k`) for the i-th.

    Completions no longer passed leave (`_leave`): finished outputs are cached.

    Args:
      completions: the `Completion`s of the batch's live decodes, in row order.
      limits: the most drafts each row may take (0 for rows that must not speculate).

    Returns:
      `Drafts` over those rows.
    """
    k = self.config.num_speculative_tokens
    token_ids = np.zeros((len(completions), k), np.int32)
    counts = np.zeros((len(completions),), np.int32)
    current = {completion.seq_id for completion in completions}
    for seq_id in [s for s in self._states if s not in current]:
      self._leave(self._states[seq_id])
    for row, (completion, limit) in enumerate(zip(completions, limits)):
      state = self._sync(completion)
      state.decay()
      if limit <= 0:
        continue
      draft = self._draft(state, min(k, limit))
      token_ids[row, : len(draft)] = draft
      counts[row] = len(draft)
    return Drafts(token_ids=token_ids, num_draft_tokens=counts)

  def record(self, completions: Sequence, num_draft: np.ndarray, num_sampled: np.ndarray) -> None:
    """Updates each row's acceptance estimate after a verify step (`record_acceptance`)."""
    record_acceptance(self._states, completions, num_draft, num_sampled)

  def expected_gain(self, completions: Sequence, drafts: Drafts) -> float:
    """Draft tokens the rows are expected to have accepted (`expected_gain`)."""
    return expected_gain(self._states, completions, drafts)
