"""A depth-bounded suffix tree with counts: the data structure of suffix decoding.

`SuffixTree` counts every substring of at most `depth` tokens of the sequences added to it: the
path from the root spelling a substring ends at a node whose `count` is the number of its
occurrences, and whose children are the tokens that followed them (a suffix trie cut at `depth`).
A sequence is added token by token (`extend`, `depth` node updates per token: each suffix of the
sequence so far, of at most `depth` tokens, grows by the token) and removed whole (`remove`).

Drafting walks it: the longest suffixes of a request's tokens found in the tree
(`matches`) are contexts seen before, and from a context's node `greedy_draft` follows the most
frequent continuation while the estimated probability of the draft so far (the product of the
continuations' frequencies) stays above a floor. Pure Python dicts: a few microseconds per node
visited, so a step's host cost grows with rows times `depth` (`SpecDecodingStats.draft_time_s`
measures it).
"""

from __future__ import annotations

from collections.abc import Sequence


class Node:
  """One substring of the sequences in a tree.

  Attributes:
    count: occurrences of the substring (the path from the root to the node).
    total: occurrences followed by a token (the sum of the children's counts; below `count`
      where an occurrence ends a sequence or is cut at the tree's depth).
    children: the next token of each continuation -> its node.
    best: the child with the highest count, or None when unknown (recomputed on demand after a
      removal).
  """

  __slots__ = ("best", "children", "count", "total")

  def __init__(self) -> None:
    self.count = 0
    self.total = 0
    self.children: dict[int, Node] = {}
    self.best: tuple[int, Node] | None = None

  def most_frequent(self) -> tuple[int, Node] | None:
    """The continuation seen most often (the first to reach that count), None for a leaf."""
    if self.best is None and self.children:
      token = max(self.children, key=lambda t: self.children[t].count)
      self.best = (token, self.children[token])
    return self.best


class SuffixTree:
  """Counts of the substrings of at most `depth` tokens of the sequences added.

  Args:
    depth: the longest substring counted (`suffix_decoding_max_tree_depth`): a match of `m`
      tokens can draft at most `depth - m`.
  """

  def __init__(self, depth: int) -> None:
    self.depth = depth
    self.root = Node()
    self.num_sequences = 0  # sequences started and not removed

  def start(self) -> list[Node]:
    """Starts a sequence (counted in `num_sequences`): its open suffixes, none yet."""
    self.num_sequences += 1
    return []

  def extend(self, ends: list[Node], tokens: Sequence[int]) -> list[Node]:
    """Appends `tokens` to one sequence of the tree.

    Args:
      ends: the sequence's open suffixes: the nodes of its last 1, 2, ... `depth - 1` tokens, in
        that order (the previous call's result, or `start()`'s for a new sequence).
      tokens: the tokens appended.

    Returns:
      The sequence's open suffixes after them.
    """
    root, keep = self.root, self.depth - 1
    for token in tokens:
      grown = []
      for node in (root, *ends):
        child = node.children.get(token)
        if child is None:
          child = node.children[token] = Node()
        child.count += 1
        node.total += 1
        best = node.best
        if best is None:  # a new node's first child, else unknown since a removal
          node.best = (token, child) if len(node.children) == 1 else None
        elif best[1] is not child and child.count > best[1].count:
          node.best = (token, child)
        grown.append(child)
      ends = grown[:keep]
    return ends

  def remove(self, tokens: Sequence[int]) -> None:
    """Removes one sequence started before and extended by exactly these tokens: each of its
    substrings counts once less, and nodes left with no occurrence are dropped."""
    self.num_sequences -= 1
    depth = self.depth
    for start in range(len(tokens)):
      node = self.root
      for token in tokens[start : start + depth]:
        child = node.children[token]
        node.total -= 1
        child.count -= 1
        if node.best is not None and node.best[1] is child:
          node.best = None  # maybe no longer the most frequent
        if child.count == 0:  # its whole subtree counted this occurrence only
          del node.children[token]
          break
        node = child

  def matches(self, context: Sequence[int]) -> list[tuple[int, Node]]:
    """The suffixes of `context` that occur in the tree and were followed by a token.

    Args:
      context: the request's last tokens (at most `depth - 1` are used).

    Returns:
      `(m, node)` for each suffix of `m` tokens found with a continuation, longest first.
    """
    found = []
    tail = list(context[max(len(context) - self.depth + 1, 0) :])
    for start in range(len(tail)):
      node: Node | None = self.root
      for token in tail[start:]:
        node = node.children.get(token)  # type: ignore[union-attr]
        if node is None:
          break
      if node is not None and node.total:
        found.append((len(tail) - start, node))
    return found


def greedy_draft(node: Node, max_len: int, min_prob: float) -> tuple[list[int], float]:
  """The most frequent continuation after a context's node.

  Args:
    node: the node of the matched context.
    max_len: the most tokens drafted.
    min_prob: the draft stops before a token whose estimated probability (the product of the
      frequencies `child.count / parent.total` along the draft) falls below it.

  Returns:
    `(tokens, score)`: the draft and its expected number of accepted tokens under the same
    estimates (the sum of the probabilities of its prefixes).
  """
  tokens: list[int] = []
  prob, score = 1.0, 0.0
  while len(tokens) < max_len and node.total:
    best = node.most_frequent()
    if best is None:
      break
    token, child = best
    prob *= child.count / node.total
    if prob < min_prob:
      break
    tokens.append(token)
    score += prob
    node = child
  return tokens, score
