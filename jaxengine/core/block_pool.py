"""The paged KV cache's host side: a pool of fixed-size blocks with reference counts.

The device cache is `num_blocks` pages of `block_size` token positions each (`[num_blocks,
block_size, K, D]` per layer, `models/paged_attention.py`). This module decides which request owns
which page; it never touches the device.

Behaviour follows vLLM V1's block pool:

* Block 0 is the null block: never handed out, never freed. Padding tokens of a step write their
  keys and values into it and unused block-table entries point at it, so the device side needs no
  bounds checks.
* Every other block is either in use (`ref_cnt > 0`: listed in the block table of that many
  requests) or in the free queue (`ref_cnt == 0`). A block in use is never in the free queue, and
  blocks are only taken from the free queue, so evicting a block in use is impossible by
  construction.
* A full block whose tokens are known may be registered under its block hash (the hash chain of
  `hash_block_tokens`). When its last user frees it, it keeps its hash and contents and goes to the
  tail of the free queue: a later request with the same prefix takes it back (`touch`) instead of
  recomputing it. New blocks come from the head of the queue (least recently freed first); taking
  a block that still has a hash evicts it from the hash map.
* Freeing a request's blocks in reverse order (its last block first) makes the tail of a prompt,
  the part fewest requests share, the first to be evicted.

Shapes and sizes are host integers.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

#: Tokens per block (vLLM's default `block_size`).
DEFAULT_BLOCK_SIZE = 16

#: The reserved block: padding tokens write here, unused block-table entries point here.
NULL_BLOCK_ID = 0


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
  """One link of vLLM V1's hash chain: a full block's hash covers its parent's and its tokens.

  BLAKE2b with a 128-bit digest over the parent digest and the tokens' int32 bytes, so equal
  hashes mean equal token sequences from the start of the prompt to the end of this block
  (collisions are not a practical concern). The same digests as
  `engine.prefix_cache.block_hashes`.

  Args:
    parent_hash: the previous block's hash, `b""` for a sequence's first block.
    token_ids: the block's `block_size` token ids.

  Returns:
    A 16-byte digest.
  """
  data = parent_hash + np.asarray(token_ids, np.int32).tobytes()
  return hashlib.blake2b(data, digest_size=16).digest()


def extend_block_hashes(
  block_hashes: list[bytes],
  token_ids: Sequence[int],
  block_size: int = DEFAULT_BLOCK_SIZE,
  root: bytes = b"",
) -> list[bytes]:
  """Appends the hashes of the full blocks of `token_ids` not hashed yet, in place.

  Args:
    block_hashes: the chain so far (entry `i` covers tokens `0 .. (i + 1) * block_size`).
    token_ids: every known token of the sequence, the hashed ones included.
    root: the first block's parent hash: `b""`, or a key that keeps sequences apart whose
      keys and values differ for the same tokens (a LoRA adapter's, `KVCacheManager`).
    block_size: tokens per block.

  Returns:
    `block_hashes`, now `len(token_ids) // block_size` long.
  """
  for index in range(len(block_hashes), len(token_ids) // block_size):
    parent = block_hashes[-1] if block_hashes else root
    start = index * block_size
    block_hashes.append(hash_block_tokens(parent, token_ids[start : start + block_size]))
  return block_hashes


class BlockPool:
  """Which blocks of the device cache are free, in use, or cached for prefix reuse.

  Args:
    num_blocks: pages of the device cache, the null block included (`>= 2`).
    enable_caching: register full blocks under their hashes for prefix reuse.

  Raises:
    ValueError: `num_blocks < 2`.
  """

  def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
      raise ValueError(f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}")
    self.num_blocks = num_blocks
    self.enable_caching = enable_caching
    self.ref_cnt = [0] * num_blocks
    self.block_hash: list[bytes | None] = [None] * num_blocks
    # Free blocks, least recently freed first; a dict keeps order and removes in O(1).
    self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
      (block, None) for block in range(1, num_blocks)
    )
    self._cached: dict[bytes, int] = {}
    self.num_evictions = 0

  @property
  def num_usable_blocks(self) -> int:
    """Blocks requests can hold (all but the null block)."""
    return self.num_blocks - 1

  @property
  def num_free_blocks(self) -> int:
    """Blocks a request could take now (free, cached ones included)."""
    return len(self._free)

  @property
  def num_used_blocks(self) -> int:
    """Blocks held by at least one request."""
    return self.num_usable_blocks - len(self._free)

  @property
  def num_cached_blocks(self) -> int:
    """Blocks registered under a hash (in use or free)."""
    return len(self._cached)

  def free_block_ids(self) -> list[int]:
    """The free queue, next to be taken first."""
    return list(self._free)

  def get_cached_block(self, block_hash: bytes) -> int | None:
    """The block registered under `block_hash`, or None."""
    return self._cached.get(block_hash)

  def get_new_blocks(self, num_blocks: int) -> list[int]:
    """Takes `num_blocks` blocks from the head of the free queue, each with `ref_cnt` 1.

    A taken block that still had a hash is evicted from the hash map first.

    Raises:
      ValueError: fewer free blocks than asked for (callers check `num_free_blocks` first).
    """
    if num_blocks > len(self._free):
      raise ValueError(f"cannot take {num_blocks} blocks: {len(self._free)} free")
    blocks = []
    for _ in range(num_blocks):
      block, _ = self._free.popitem(last=False)
      self._evict(block)
      self.ref_cnt[block] = 1
      blocks.append(block)
    return blocks

  def touch(self, blocks: Iterable[int]) -> None:
    """Adds a user to each block (a prefix hit or a fork); a free block leaves the free queue."""
    for block in blocks:
      self._check_block(block)
      if self.ref_cnt[block] == 0:
        del self._free[block]
      self.ref_cnt[block] += 1

  def free_blocks(self, ordered_blocks: Iterable[int]) -> None:
    """Drops a user from each block; blocks left unused join the free queue's tail in this order.

    Callers pass a request's blocks last first, so its tail is evicted before its head.

    Raises:
      ValueError: a block not in use.
    """
    for block in ordered_blocks:
      self._check_block(block)
      if self.ref_cnt[block] <= 0:
        raise ValueError(f"block {block} is freed but not in use")
      self.ref_cnt[block] -= 1
      if self.ref_cnt[block] == 0:
        self._free[block] = None

  def cache_full_block(self, block: int, block_hash: bytes) -> None:
    """Registers a full block in use under its hash (no-op with caching off).

    If another block already holds the same hash (two requests computed the same prefix at
    once), the first one stays registered and this one stays unregistered: both remain valid
    for their owners, and this one is simply not shared.
    """
    if not self.enable_caching or self.block_hash[block] is not None:
      return
    if block_hash in self._cached:
      return
    self.block_hash[block] = block_hash
    self._cached[block_hash] = block

  def reset_prefix_cache(self) -> int:
    """Forgets every hash (after new weights the cached keys and values are stale).

    Blocks in use stay with their requests; free blocks simply lose their hash.

    Returns:
      The number of hashes dropped.
    """
    dropped = len(self._cached)
    for block in self._cached.values():
      self.block_hash[block] = None
    self._cached.clear()
    return dropped

  def _evict(self, block: int) -> None:
    block_hash = self.block_hash[block]
    if block_hash is None:
      return
    self.block_hash[block] = None
    del self._cached[block_hash]
    self.num_evictions += 1

  def _check_block(self, block: int) -> None:
    if not 0 < block < self.num_blocks:
      raise ValueError(f"block id {block} is not a usable block of a pool of {self.num_blocks}")
