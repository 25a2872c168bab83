"""The prefix cache's host side: block hashes, the block index with its LRU order, statistics.

A prompt is cut into full blocks of `BLOCK_SIZE` (16) tokens. Block `i`'s hash covers the hash of
block `i - 1` and block `i`'s tokens (vLLM V1's hash chain), so equal hashes mean equal prompts up
to the end of that block, and the keys and values cached for one prompt's block serve every prompt
that starts the same way. The hash is BLAKE2b (128 bits) over the parent digest and the tokens'
int32 bytes: collisions are not a practical concern.

`PrefixCache` maps hashes to block ids of the device pool (`engine/prefix_prefill.py` holds the
pool and the copies) and keeps every stored block in least-recently-used order. A block is stored
once and never changes until it is evicted; a lookup or a store touches the blocks of its chain
from the last to the first, so the first blocks of a prefix (those most prompts share) are the
last to go. Nothing is pinned: a request that matched blocks has its own copy of them in its slot
once the step's copies ran, so any stored block may be evicted at any time after that.

Shapes and sizes are host integers; nothing here touches the device.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

#: Tokens per cached block (vLLM's default block size).
BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
  """Cumulative prefix-cache counters since the engine started (vLLM-like names).

  Attributes:
    requests: prefills that looked the cache up (one per completion prefilled with the cache on;
      prompt_logprobs requests skip the cache, as in vLLM, and are not counted).
    queries: prompt tokens of those lookups.
    hits: prompt tokens found in the cache (multiples of the block size).
    evictions: blocks dropped to make room (least recently used first).
    resets: times the whole cache was emptied (`reset_prefix_cache`, `load_weights`).
    stored_blocks: blocks held now.
  """

  requests: int = 0
  queries: int = 0
  hits: int = 0
  evictions: int = 0
  resets: int = 0
  stored_blocks: int = 0

  @property
  def hit_rate(self) -> float:
    """`hits / queries` (0.0 before any query)."""
    return self.hits / self.queries if self.queries else 0.0


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
  """The hash chain of a prompt's full blocks.

  Args:
    token_ids: the prompt.
    block_size: tokens per block.

  Returns:
    `len(token_ids) // block_size` digests; entry `i` covers tokens `0 .. (i + 1) * block_size`.
  """
  tokens = np.asarray(token_ids, np.int32)
  hashes: list[bytes] = []
  parent = b""
  for start in range(0, len(tokens) - block_size + 1, block_size):
    parent = hashlib.blake2b(
      parent + tokens[start : start + block_size].tobytes(), digest_size=16
    ).digest()
    hashes.append(parent)
  return hashes


class PrefixCache:
  """Which prompt blocks the device pool holds, in least-recently-used order.

  Args:
    num_blocks: blocks of the device pool (`>= 1`).
  """

  def __init__(self, num_blocks: int) -> None:
    self.num_blocks = num_blocks
    self._block_of: dict[bytes, int] = {}
    self._lru: collections.OrderedDict[int, bytes] = collections.OrderedDict()  # oldest first
    self._free = list(range(num_blocks))
    self._counts = collections.Counter[str]()

  def __len__(self) -> int:
    return len(self._lru)

  @property
  def stats(self) -> PrefixCacheStats:
    """The counters now."""
    return PrefixCacheStats(stored_blocks=len(self), **self._counts)

  def __contains__(self, block_hash: bytes) -> bool:
    return block_hash in self._block_of

  def match(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
    """The pool blocks of the longest cached prefix of a chain, touched; counted as a query.

    Args:
      hashes: the prompt's `block_hashes`.
      num_tokens: the prompt's length (counted in `queries`).

    Returns:
      Block ids of hashes `0 .. m - 1`, for the largest `m` with all of them cached.
    """
    blocks = []
    for block_hash in hashes:
      block = self._block_of.get(block_hash)
      if block is None:
        break
      blocks.append(block)
    self._touch(blocks)
    self._counts.update(requests=1, queries=num_tokens, hits=len(blocks) * BLOCK_SIZE)
    return blocks

  def store(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
    """Makes room for every block of a chain not held yet and records it.

    Blocks already held are touched; new ones take free blocks, then the least recently used
    ones (never a block of this chain). The caller copies the new blocks into the pool.

    Args:
      hashes: a prompt's `block_hashes` (every block already written in its slot).

    Returns:
      `(block index in the prompt, pool block id)` for each block to copy, in prompt order;
      fewer than the missing blocks when the pool is smaller than the chain.
    """
    held = [self._block_of[h] for h in hashes if h in self._block_of]
    self._touch(held)  # most recent: not evicted below
    new: list[tuple[int, int]] = []
    for index, block_hash in enumerate(hashes):
      if block_hash in self._block_of:
        continue
      block = self._allocate(protected=len(held) + len(new))
      if block is None:
        break
      self._block_of[block_hash] = block
      self._lru[block] = block_hash
      new.append((index, block))
    self._touch([self._block_of[h] for h in hashes if h in self._block_of])
    return new

  def reset(self) -> None:
    """Forgets every block (the pool's contents become unreachable)."""
    self._block_of.clear()
    self._lru.clear()
    self._free = list(range(self.num_blocks))
    self._counts.update(resets=1)

  def _allocate(self, protected: int) -> int | None:
    """A free block, else the least recently used one (evicted), unless only the `protected`
    most recent blocks are left."""
    if self._free:
      return self._free.pop(0)
    if len(self._lru) <= protected:
      return None
    block, block_hash = self._lru.popitem(last=False)
    del self._block_of[block_hash]
    self._counts.update(evictions=1)
    return block

  def _touch(self, blocks: Sequence[int]) -> None:
    """Marks a chain's blocks most recently used, its first block the most recent."""
    for block in reversed(blocks):
      self._lru.move_to_end(block)
