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

#: A node is one substring of the sequences in a tree, a Python list (the cheapest object to
#: create: a long sequence creates up to `depth` nodes per token) of four fields:
#:   COUNT     occurrences of the substring (the path from the root to the node);
#:   TOTAL     occurrences followed by a token (the sum of the children's counts; below COUNT where
#:             an occurrence ends a sequence or is cut at the tree's depth);
#:   CHILDREN  the next token of each continuation -> its node;
#:   BEST      `(token, child)` of the child with the highest count, or None when unknown
#:             (recomputed on demand after a removal).
Node = list
COUNT, TOTAL, CHILDREN, BEST = range(4)


def new_node() -> Node:
  """A node with no occurrence yet."""
  return [0, 0, {}, None]


def most_frequent(node: Node) -> tuple[int, Node] | None:
  """The continuation of `node` seen most often (the first to reach that count), None for a
  leaf."""
  children = node[CHILDREN]
  if node[BEST] is None and children:
    token = max(children, key=lambda t: children[t][COUNT])
    node[BEST] = (token, children[token])
  return node[BEST]


class SuffixTree:
  """Counts of the substrings of at most `depth` tokens of the sequences added.

  Args:
    depth: the longest substring counted (`suffix_decoding_max_tree_depth`): a match of `m`
      tokens can draft at most `depth - m`.
  """

  def __init__(self, depth: int) -> None:
    self.depth = depth
    self.root = new_node()
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
        children = node[CHILDREN]
        child = children.get(token)
        if child is None:
          child = children[token] = [0, 0, {}, None]  # new_node(), without the call
        child[COUNT] += 1
        node[TOTAL] += 1
        best = node[BEST]
        if best is None:  # a new node's first child, else unknown since a removal
          node[BEST] = (token, child) if len(children) == 1 else None
        elif best[1] is not child and child[COUNT] > best[1][COUNT]:
          node[BEST] = (token, child)
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
        child = node[CHILDREN][token]
        node[TOTAL] -= 1
        child[COUNT] -= 1
        if node[BEST] is not None and node[BEST][1] is child:
          node[BEST] = None  # maybe no longer the most frequent
        if child[COUNT] == 0:  # its whole subtree counted this occurrence only
          del node[CHILDREN][token]
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
        node = node[CHILDREN].get(token)  # type: ignore[index]
        if node is None:
          break
      if node is not None and node[TOTAL]:
        found.append((len(tail) - start, node))
    return found


def greedy_draft(node: Node, max_len: int, min_prob: float) -> tuple[list[int], float]:
  """The most frequent continuation after a context's node.

  Args:
    node: the node of the matched context.
    max_len: the most tokens drafted.
    min_prob: the draft stops before a token whose estimated probability (the product of the
      frequencies `child COUNT / parent TOTAL` along the draft) falls below it.

  Returns:
    `(tokens, score)`: the draft and its expected number of accepted tokens under the same
    estimates (the sum of the probabilities of its prefixes).
  """
  tokens: list[int] = []
  prob, score = 1.0, 0.0
  while len(tokens) < max_len and node[TOTAL]:
    best = most_frequent(node)
    if best is None:
      break
    token, child = best
    prob *= child[COUNT] / node[TOTAL]
    if prob < min_prob:
      break
    tokens.append(token)
    score += prob
    node = child
  return tokens, score
