"""Suffix decoding on the host (no model): the suffix tree's counts against brute force, and
the proposer's sources (the request, the other samples of its prompt, finished outputs), its
adaptive draft length and its bounded cache. Outputs equal to plain decoding: test_speculative.py
and tests/engine/test_composition.py."""

from __future__ import annotations

import collections
import random

from jaxengine.spec_decode.config import SpeculativeConfig
from jaxengine.spec_decode.suffix_proposer import SuffixProposer
from jaxengine.spec_decode.suffix_tree import CHILDREN, COUNT, TOTAL, Node, SuffixTree, greedy_draft


class Fake:
  """The fields of a `Completion` the proposer reads."""

  def __init__(self, seq_id: str, prompt: list[int], output: tuple[int, ...] = ()) -> None:
    self.seq_id = seq_id
    self.request = type("R", (), {"prompt_token_ids": prompt})()
    self.token_ids = list(output)
    self.finish_reason: str | None = None


def _proposer(**options) -> SuffixProposer:
  config = SpeculativeConfig.build({"method": "suffix", "num_speculative_tokens": 4, **options})
  assert config is not None
  return SuffixProposer(config, max_model_len=256)


def _drafts(proposer: SuffixProposer, completions: list[Fake], limit: int = 4) -> list[list[int]]:
  drafts = proposer.propose(completions, [limit] * len(completions))
  return [row[:n].tolist() for row, n in zip(drafts.token_ids, drafts.num_draft_tokens)]


def _counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
  """Every path of the tree with its count (and each node's total checked on the way)."""
  found: dict[tuple[int, ...], int] = {}

  def visit(node: Node, path: tuple[int, ...]) -> None:
    assert node[TOTAL] == sum(child[COUNT] for child in node[CHILDREN].values())
    for token, child in node[CHILDREN].items():
      found[path + (token,)] = child[COUNT]
      visit(child, path + (token,))

  visit(tree.root, ())
  return found


def _brute_force(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
  counts: collections.Counter = collections.Counter()
  for tokens in sequences:
    for start in range(len(tokens)):
      for end in range(start + 1, min(start + depth, len(tokens)) + 1):
        counts[tuple(tokens[start:end])] += 1
  return dict(counts)


def test_tree_counts_every_bounded_substring_and_removal_restores_them():
  rng = random.Random(0)
  depth, tree = 5, SuffixTree(5)
  sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
  for tokens in sequences:
    ends, cut = tree.start(), rng.randrange(len(tokens) + 1)
    ends = tree.extend(ends, tokens[:cut])  # in two pieces, as a running output grows
    tree.extend(ends, tokens[cut:])
  assert _counts(tree) == _brute_force(sequences, depth) and tree.num_sequences == 6
  for removed in (1, 4):
    tree.remove(sequences[removed])
  kept = [s for i, s in enumerate(sequences) if i not in (1, 4)]
  assert _counts(tree) == _brute_force(kept, depth) and tree.num_sequences == 4
  for tokens in kept:
    tree.remove(tokens)
  assert tree.root[CHILDREN] == {} and tree.root[TOTAL] == 0 and tree.num_sequences == 0


def test_matches_and_greedy_draft_follow_the_counts():
  tree = SuffixTree(4)
  tree.extend(tree.start(), [1, 2, 3, 1, 2, 3, 1, 2, 4])
  found = tree.matches([9, 1, 2])  # "9 1 2" never occurred, "1 2" and "2" did
  assert [m for m, _ in found] == [2, 1]
  node = found[0][1]
  assert (node[COUNT], node[TOTAL]) == (3, 3)
  # "1 2" was followed by 3 twice and 4 once; then "1 2 3" by 1 (the depth ends the path).
  assert greedy_draft(node, 5, 0.0) == ([3, 1], 2 / 3 + 2 / 3)
  assert greedy_draft(node, 1, 0.0)[0] == [3]
  assert greedy_draft(node, 5, 0.7) == ([], 0.0)  # 2/3 is below the floor
  tree.remove([1, 2, 3, 1, 2, 3, 1, 2, 4])
  tree.extend(tree.start(), [1, 2, 4, 1, 2, 4, 1, 2, 3])  # the most frequent is found again
  assert greedy_draft(tree.matches([1, 2])[0][1], 1, 0.0)[0] == [4]


def test_samples_of_one_prompt_draft_from_each_other_from_their_first_token():
  proposer = _proposer()
  prompt = [7, 8, 9]
  first, second = Fake("r#0", prompt), Fake("r#1", prompt)
  other = Fake("s", [5, 8, 9])  # another prompt, with the same last tokens
  assert _drafts(proposer, [first, second, other]) == [[], [], []]
  first.token_ids += [20, 21, 22, 23, 24]
  # The second sample drafts the first's answer before it has a token of its own (its context
  # is the prompt's end); the other prompt's request sees no running output but its own.
  assert _drafts(proposer, [first, second, other]) == [[], [20, 21, 22], []]
  second.token_ids += [20, 21]
  assert _drafts(proposer, [first, second, other])[1] == [22, 23, 24]
  # Limits and the spec factor cap a draft: a match of m tokens drafts at most factor * m.
  assert _drafts(proposer, [first, second], limit=2) == [[], [22, 23]]
  half = _proposer(suffix_decoding_max_spec_factor=0.5)
  assert _drafts(half, [first, second]) == [[], [22, 23]]  # "7 8 9 20 21" matched: 2.5 tokens
  second.token_ids.append(25)  # now "25" ends it, which no other output holds
  assert _drafts(half, [first, second]) == [[], []]


def test_finished_outputs_are_cached_for_other_prompts_within_the_bound():
  proposer = _proposer(suffix_decoding_max_cached_requests=2)
  answers = {f"q{i}": [30 + i, 40, 41, 42, 43 + i] for i in range(3)}
  for seq_id, answer in answers.items():
    completion = Fake(seq_id, [int(seq_id[1])], tuple(answer))
    _drafts(proposer, [completion])
    completion.finish_reason = "stop"
  probe = Fake("probe", [99], (40, 41))
  # q0 and q1 finished and were cached; q2 is seen gone (and cached) now: q0 is evicted.
  assert _drafts(proposer, [probe]) == [[42, 44]]  # q1 then q2 follow "40 41 42" with 44, 45
  assert proposer.num_cached == 2
  assert set(proposer._groups) == {(1,), (2,), (99,)}  # q0's prompt is gone with its output
  assert _counts(proposer._finished) == _brute_force(
    [[1, *answers["q1"]], [2, *answers["q2"]]], proposer.depth
  )
  none = _proposer(suffix_decoding_max_cached_requests=0)
  done = Fake("d", [1], (40, 41, 42, 43))
  _drafts(none, [done])
  done.finish_reason = "length"
  assert _drafts(none, [Fake("p", [2], (40, 41))]) == [[]] and none.num_cached == 0
  _drafts(none, [])
  assert none._groups == {} and none._states == {}


def test_a_preempted_sample_leaves_its_prompts_tree_and_comes_back():
  proposer = _proposer(suffix_decoding_max_tree_depth=4)
  prompt = [1, 2, 3]
  running, preempted = Fake("a#0", prompt, (10, 11)), Fake("a#1", prompt, (12, 13, 14))
  _drafts(proposer, [running, preempted])
  tree = proposer._groups[(1, 2, 3)].tree
  # The prompt once, then each output led by the prompt's last depth - 1 tokens.
  lead = [1, 2, 3]
  assert _counts(tree) == _brute_force([prompt, lead + [10, 11], lead + [12, 13, 14]], 4)
  running.token_ids.append(15)
  _drafts(proposer, [running])  # a#1 gone without a finish reason: not cached
  assert _counts(tree) == _brute_force([prompt, lead + [10, 11, 15]], 4)
  assert proposer.num_cached == 0 and "a#1" not in proposer._states
  _drafts(proposer, [running, preempted])  # back: added again from its tokens
  assert _counts(tree) == _brute_force([prompt, lead + [10, 11, 15], lead + [12, 13, 14]], 4)
  replaced = Fake("a#0", prompt)  # the same id, another completion: the old one leaves
  _drafts(proposer, [replaced, preempted])
  assert proposer._states["a#0"].completion is replaced
  assert _counts(tree) == _brute_force([prompt, lead + [12, 13, 14], lead], 4)
  _drafts(proposer, [])  # both gone unfinished: the prompt's tree with them
  assert proposer._groups == {}
