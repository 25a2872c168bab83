"""Per-request block tables over the paged KV cache, in the manner of vLLM V1's KV cache manager.

The scheduler asks this manager three things each step, for each request it schedules:

1. `get_computed_blocks(token_ids)` (a new request only): the longest prefix of the prompt whose
   full blocks are already cached. At least one token is always left to compute, so the step
   that admits the request produces its next-token logits.
2. `allocate_slots(req_id, num_new_tokens, ...)`: enough blocks for the tokens computed so far,
   the prefix hit, this step's new tokens and any lookahead (speculative) slots. Returns the block
   ids appended to the request's block table, or None, changing nothing, when the pool cannot
   supply them: the scheduler then preempts (`preempt`) and retries, or leaves the request waiting.
3. `free(req_id)` when a request finishes or is aborted.

Full blocks of known tokens are registered under their hash-chain digests as they are allocated,
so requests admitted later share them by reference (`block_pool.BlockPool`). The `n` samples of
one request share the prompt's full blocks through `fork`. Host integers: no device work here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxengine.core.block_pool import (
  DEFAULT_BLOCK_SIZE,
  NULL_BLOCK_ID,
  BlockPool,
  extend_block_hashes,
)
from jaxengine.core.kv_cache_groups import KVCacheGroups, max_group_blocks, single_group
from jaxengine.core.kv_cache_stats import KVCacheStats

__all__ = ["ComputedBlocks", "KVCacheManager", "KVCacheStats"]


@dataclasses.dataclass(frozen=True)
class ComputedBlocks:
  """A prefix found in the cache (or shared by a fork).

  Attributes:
    block_ids: the cached blocks of the first KV cache group, in order (possibly empty).
    num_computed_tokens: tokens they hold (`len(block_ids) * block_size`).
    group_block_ids: every group's blocks (`NULL_BLOCK_ID` where a window group needs no page:
      before the window of the first token to compute), or empty with a single group that
      frees nothing (then `block_ids` is all).
  """

  block_ids: tuple[int, ...] = ()
  num_computed_tokens: int = 0
  group_block_ids: tuple[tuple[int, ...], ...] = ()

  def groups(self, num_groups: int) -> tuple[tuple[int, ...], ...]:
    """The hit's blocks per group (`num_groups` tables)."""
    if self.group_block_ids:
      return self.group_block_ids
    return (self.block_ids,) + ((),) * (num_groups - 1)


@dataclasses.dataclass
class _RequestBlocks:
  """One request's block tables (one per KV cache group, equally long; `NULL_BLOCK_ID` where a
  window group freed a page) and how much of them is registered in the prefix cache."""

  block_ids: list[list[int]]
  block_hashes: list[bytes]
  num_cached_blocks: int = 0
  cacheable: bool = True  # False once its contents predate a `reset_prefix_cache`
  cache_key: bytes = b""  # the root of its hash chain (`extend_block_hashes`)


class KVCacheManager:
  """Block tables of the running requests over one `BlockPool`.

  With several KV cache groups (`core/kv_cache_groups.py`: a model with sliding-window layers) a
  request holds one block table per group, all drawn from the one pool and all as long as its
  tokens need; a window group's table frees the pages that slid out of its window (below).

  Sliding windows. A query at position `p` of a window-`W` layer reads keys `p - W < s <= p`.
  When a request's step starts at position `p0` (`num_computed_tokens` of `allocate_slots`),
  every later query sits at `p0` or after, so a window group frees its pages entirely before
  `p0 - W` (one position of slack: draft and lookahead allocations pass `num_computed_tokens`
  one past the step's decode token, whose window starts at `p0 - W + 1`). A freed page's
  table entry becomes `NULL_BLOCK_ID`, which attention masks anyway. A window group therefore
  holds at most `ceil((W + chunk) / block_size) + 1` pages per request for a `chunk`-token step
  (plus any lookahead). Freed full pages keep their prefix hash in the free queue until evicted;
  a prefix hit needs every group's pages cached back to the window of its first computed token
  (full groups: all of them), else it is shortened (`get_computed_blocks`).

  Args:
    num_blocks: pages of the device cache, the null block included (`>= 2`).
    block_size: token positions per page (`>= 1`).
    enable_caching: share full blocks between requests with the same prefix.
    groups: the KV cache groups (None: one group that frees nothing).
    max_num_batched_tokens: the most tokens of one step (bounds a window group's pages in
      `check_fits`); None: no bound.

  Raises:
    ValueError: `num_blocks < 2` or `block_size < 1`.
  """

  def __init__(
    self,
    num_blocks: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    enable_caching: bool = True,
    groups: KVCacheGroups | None = None,
    max_num_batched_tokens: int | None = None,
  ) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
      raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    self.block_pool = BlockPool(num_blocks, enable_caching)
    self.block_size = block_size
    self.enable_caching = enable_caching
    self.groups = groups or single_group(1)
    #: Each group's window `W`, or None (full attention).
    self.windows = self.groups.group_windows
    self.max_num_batched_tokens = max_num_batched_tokens
    self._frees_pages = self.groups.frees_pages  # read every allocation
    self._reqs: dict[str, _RequestBlocks] = {}
    self._counts = dict.fromkeys(("preemptions", "queries", "hits"), 0)
    self._evictions_at_reset = 0
    self._peak_used_blocks = 0
    self._peak_running_reqs = 0

  # -- queries -------------------------------------------------------------------------------

  @property
  def num_groups(self) -> int:
    """KV cache groups `G` (block tables per request)."""
    return len(self.windows)

  @property
  def frees_pages(self) -> bool:
    """Whether a window group frees pages that slid out of its window."""
    return self._frees_pages

  @property
  def stats(self) -> KVCacheStats:
    """The counters now."""
    pool = self.block_pool
    return KVCacheStats(
      num_blocks=pool.num_usable_blocks,
      num_used_blocks=pool.num_used_blocks,
      peak_used_blocks=self._peak_used_blocks,
      num_running_reqs=len(self._reqs),
      peak_running_reqs=self._peak_running_reqs,
      num_preemptions=self._counts["preemptions"],
      num_cached_blocks=pool.num_cached_blocks,
      prefix_cache_queries=self._counts["queries"],
      prefix_cache_hits=self._counts["hits"],
      num_evictions=pool.num_evictions - self._evictions_at_reset,
    )

  def num_blocks_for(self, num_tokens: int) -> int:
    """Blocks that hold `num_tokens` token positions (`ceil(num_tokens / block_size)`)."""
    return -(-num_tokens // self.block_size)

  def num_blocks_needed(self, num_tokens: int) -> int:
    """Pages of all groups one request of `num_tokens` tokens holds at most
    (`kv_cache_groups.max_group_blocks`)."""
    return sum(
      max_group_blocks(window, num_tokens, self.block_size, self.max_num_batched_tokens)
      for window in self.windows
    )

  def check_fits(self, num_tokens: int) -> None:
    """Refuses a request that could never run, even alone in an empty pool.

    Args:
      num_tokens: the most tokens the request can hold (prompt plus `max_tokens`).

    Raises:
      ValueError: naming the tokens, the blocks they need (in all groups) and the pool's.
    """
    needed = self.num_blocks_needed(num_tokens)
    if needed > self.block_pool.num_usable_blocks:
      groups = f" in all of its {self.num_groups} layer groups" if self.num_groups > 1 else ""
      raise ValueError(
        f"a request of up to {num_tokens} tokens needs {needed} KV cache blocks of "
        f"{self.block_size} tokens{groups}, but the pool has {self.block_pool.num_usable_blocks}; "
        "raise kv_cache_memory_bytes / num_kv_blocks or lower max_tokens"
      )

  def get_block_ids(self, req_id: str) -> tuple[int, ...]:
    """The request's block table of the first group (empty for a request holding no blocks)."""
    req = self._reqs.get(req_id)
    return tuple(req.block_ids[0]) if req else ()

  def get_group_block_ids(self, req_id: str) -> tuple[tuple[int, ...], ...]:
    """The request's block table of every group (`NULL_BLOCK_ID` for freed pages); empty
    tables for a request holding no blocks."""
    req = self._reqs.get(req_id)
    if req is None:
      return ((),) * self.num_groups
    return tuple(tuple(table) for table in req.block_ids)

  def num_held_blocks(self, req_id: str, group: int = 0) -> int:
    """Pages (not null) the request holds in `group`."""
    req = self._reqs.get(req_id)
    return 0 if req is None else sum(b != NULL_BLOCK_ID for b in req.block_ids[group])

  def get_computed_blocks(self, token_ids: Sequence[int], cache_key: bytes = b"") -> ComputedBlocks:
    """The longest cached prefix of a new request's tokens, counted as a prefix-cache query.

    The last token is never taken from the cache (its logits are needed), so a hit covers at
    most `(len(token_ids) - 1) // block_size` blocks. With several groups, every full group
    needs all the hit's blocks cached and every window group those from the window of the
    first token after the hit on (`first_window_block`); the hit is the longest prefix all
    groups have. The blocks are not reserved: pass the result to `allocate_slots` before
    allocating anything else.

    Args:
      token_ids: the request's known tokens (the prompt, or prompt and output on resumption).
      cache_key: what else its keys and values depend on (`b""`: nothing; a LoRA adapter's key
        otherwise): only blocks registered under the same key match.

    Returns:
      The cached blocks; empty with caching off.
    """
    if not self.enable_caching or not token_ids:
      return ComputedBlocks()
    usable = (len(token_ids) - 1) // self.block_size
    hashes = extend_block_hashes(
      [], token_ids[: usable * self.block_size], self.block_size, cache_key
    )
    self._counts["queries"] += len(token_ids)
    if self.num_groups == 1 and not self._frees_pages:
      blocks = self._cached_run(hashes, 0)
      hit = ComputedBlocks(tuple(blocks), len(blocks) * self.block_size)
    else:
      hit = self._group_hit(hashes)
    self._counts["hits"] += hit.num_computed_tokens
    return hit

  def uncount_hit_tokens(self, num_tokens: int) -> None:
    """Takes back hit tokens the caller did not use (`core/state_snapshots.py`)."""
    self._counts["hits"] -= num_tokens

  def first_window_block(self, group: int, num_computed_tokens: int) -> int:
    """The first block a group still needs when `num_computed_tokens` are computed: 0 for a
    full group, `(num_computed_tokens - W) // block_size` (at least 0) for a window group."""
    window = self.windows[group]
    if window is None:
      return 0
    return max(0, (num_computed_tokens - window) // self.block_size)

  # -- changes -------------------------------------------------------------------------------

  def allocate_slots(
    self,
    req_id: str,
    num_new_tokens: int,
    *,
    num_computed_tokens: int = 0,
    token_ids: Sequence[int] = (),
    new_computed_blocks: ComputedBlocks | None = None,
    num_lookahead_tokens: int = 0,
    cache_key: bytes = b"",
  ) -> list[int] | None:
    """Grows a request's block tables to hold this step's tokens.

    Window groups first free the pages before the window of the step's first token (class
    docstring): those are freed even when the call then returns None (no later query reads
    them).

    Args:
      req_id: the request (new, or holding blocks from earlier steps).
      num_new_tokens: tokens computed this step (a prefill chunk, a decode token, draft tokens).
      num_computed_tokens: tokens whose keys and values the request's blocks already hold.
      token_ids: the request's known tokens (prompt, then accepted output; never draft tokens):
        full blocks among the first `num_computed_tokens + hit + num_new_tokens` of them are
        registered for prefix sharing. Empty: nothing is registered.
      new_computed_blocks: a prefix hit from `get_computed_blocks`, for a request holding no
        blocks yet; its tokens come after `num_computed_tokens` (normally 0).
      num_lookahead_tokens: extra slots reserved beyond this step's tokens (speculative decoding).
      cache_key: the key its full blocks are registered under (`get_computed_blocks`), taken
        when the request gets its first blocks.

    Returns:
      The block ids appended to the first group's table (the prefix hit's, then new ones), or
      None when the pool cannot supply them; then nothing else changed.

    Raises:
      ValueError: a negative count, `num_computed_tokens` beyond the request's blocks, or a
        prefix hit for a request that already holds blocks.
    """
    hit = new_computed_blocks or ComputedBlocks()
    req = self._reqs.get(req_id)
    held = len(req.block_ids[0]) if req else 0
    self._check_allocation(req_id, num_new_tokens, num_computed_tokens, num_lookahead_tokens)
    if num_computed_tokens > held * self.block_size:
      raise ValueError(
        f"num_computed_tokens={num_computed_tokens} exceeds the {held} blocks of {req_id!r}"
      )
    if hit.block_ids and held:
      raise ValueError(f"a prefix hit for {req_id!r}, which already holds {held} blocks")
    if req is not None and self._frees_pages:
      self._free_outside_windows(req, num_computed_tokens)
    hit_groups = hit.groups(self.num_groups)
    num_tokens = num_computed_tokens + hit.num_computed_tokens + num_new_tokens
    wanted = self.num_blocks_for(num_tokens + num_lookahead_tokens)
    num_new = max(0, wanted - held - len(hit.block_ids))
    pool = self.block_pool
    hit_blocks = (
      [b for table in hit_groups for b in table if b != NULL_BLOCK_ID] if hit.block_ids else []
    )
    num_revived = sum(pool.ref_cnt[block] == 0 for block in hit_blocks)
    if num_new * self.num_groups + num_revived > pool.num_free_blocks:
      return None
    if req is None:
      req = self._reqs[req_id] = _RequestBlocks(
        block_ids=[[] for _ in self.windows], block_hashes=[], cache_key=cache_key
      )
    pool.touch(hit_blocks)  # first: taking new blocks must not evict the hit
    appended = []
    for table, hit_table in zip(req.block_ids, hit_groups):
      new = [*hit_table, *pool.get_new_blocks(num_new)]
      table.extend(new)
      appended.append(new)
    req.num_cached_blocks = max(req.num_cached_blocks, len(hit.block_ids))
    self._cache_full_blocks(req, token_ids[:num_tokens])
    self._update_peaks()
    return appended[0]

  def fork(self, parent_req_id: str, child_req_id: str, num_tokens: int) -> ComputedBlocks:
    """Shares the parent's full blocks of its first `num_tokens` tokens with a new request.

    For the `n` samples of one request: the parent's prompt is computed once and each other
    sample starts from its full blocks (a partial last block is not shared; the child computes
    those tokens into a block of its own). With window groups the shared prefix is shortened
    to one whose window's pages the parent still holds (`get_computed_blocks`), possibly to
    nothing.

    Args:
      parent_req_id: a request holding the blocks of at least `num_tokens` tokens.
      child_req_id: a request holding no blocks.
      num_tokens: the shared tokens (normally the prompt's length).

    Returns:
      The blocks the child now holds and the tokens they cover (`num_computed_tokens` for its
      first `allocate_slots`).

    Raises:
      ValueError: the child already holds blocks, or the parent holds too few.
    """
    if child_req_id in self._reqs:
      raise ValueError(f"cannot fork into {child_req_id!r}: it already holds blocks")
    parent = self._reqs.get(parent_req_id)
    num_shared = num_tokens // self.block_size
    if parent is None or num_tokens < 0 or len(parent.block_ids[0]) < num_shared:
      raise ValueError(f"{parent_req_id!r} holds no {num_tokens} tokens to fork")
    while num_shared and not self._has_window_blocks(parent.block_ids, num_shared):
      num_shared -= 1
    shared = [self._needed(g, table[:num_shared]) for g, table in enumerate(parent.block_ids)]
    self.block_pool.touch(b for table in shared for b in table if b != NULL_BLOCK_ID)
    self._reqs[child_req_id] = _RequestBlocks(
      block_ids=[list(table) for table in shared],
      block_hashes=parent.block_hashes[:num_shared],
      num_cached_blocks=min(parent.num_cached_blocks, num_shared),
      cacheable=parent.cacheable,
      cache_key=parent.cache_key,
    )
    self._update_peaks()
    return ComputedBlocks(tuple(shared[0]), num_shared * self.block_size)

  def free(self, req_id: str) -> int:
    """Releases a finished or aborted request's blocks (last block first; cached ones stay
    reusable until evicted). A request holding no blocks is a no-op.

    Returns:
      The number of blocks the request held (of all groups).
    """
    req = self._reqs.pop(req_id, None)
    if req is None:
      return 0
    # Last position first, every group's page of it together: a prompt's tail is evicted first.
    rows = reversed(list(zip(*req.block_ids)))
    held = [block for row in rows for block in row if block != NULL_BLOCK_ID]
    self.block_pool.free_blocks(held)
    return len(held)

  def preempt(self, req_id: str) -> int:
    """Frees a running request's blocks to make room (it is recomputed later), counted in
    `num_preemptions`.

    Returns:
      The number of blocks freed.
    """
    self._counts["preemptions"] += 1
    return self.free(req_id)

  def reset_prefix_cache(self) -> int:
    """Forgets every prefix hash (new weights make cached keys and values stale).

    Returns:
      The number of hashes dropped.
    """
    for req in self._reqs.values():
      # Keys and values computed before (and attending to) the old contents are stale too.
      req.cacheable = False
    return self.block_pool.reset_prefix_cache()

  def reset_stats(self) -> None:
    """Restarts the peaks at the current occupancy and the counters at zero."""
    self._counts = dict.fromkeys(self._counts, 0)
    self._evictions_at_reset = self.block_pool.num_evictions
    self._peak_used_blocks = self.block_pool.num_used_blocks
    self._peak_running_reqs = len(self._reqs)

  # -- helpers -------------------------------------------------------------------------------

  def _key(self, group: int, block_hash: bytes) -> bytes:
    """The pool's key of a group's block: its hash, with the group's index past group 0 (the
    groups' pages hold different layers of the same tokens)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

  def _cached_run(self, hashes: Sequence[bytes], group: int) -> list[int]:
    """The group's cached blocks of the leading `hashes`, up to the first one not cached."""
    blocks = []
    for block_hash in hashes:
      block = self.block_pool.get_cached_block(self._key(group, block_hash))
      if block is None:
        break
      blocks.append(block)
    return blocks

  def _group_hit(self, hashes: Sequence[bytes]) -> ComputedBlocks:
    """The longest prefix of `hashes` every group has cached (`get_computed_blocks`)."""
    num_hit = len(hashes)
    for group, window in enumerate(self.windows):
      if window is None:
        num_hit = min(num_hit, len(self._cached_run(hashes, group)))
    for num in range(num_hit, 0, -1):
      tables: list[tuple[int, ...]] = []
      for group in range(self.num_groups):
        first = self.first_window_block(group, num * self.block_size)
        cached = [self.block_pool.get_cached_block(self._key(group, h)) for h in hashes[first:num]]
        if None in cached:
          break
        tables.append((NULL_BLOCK_ID,) * first + tuple(b for b in cached if b is not None))
      else:
        return ComputedBlocks(tables[0], num * self.block_size, tuple(tables))
    return ComputedBlocks()

  def _has_window_blocks(self, tables: Sequence[Sequence[int]], num_blocks: int) -> bool:
    """Whether every group's `tables` hold the pages the first token after `num_blocks`
    blocks needs."""
    for group, table in enumerate(tables):
      first = self.first_window_block(group, num_blocks * self.block_size)
      if NULL_BLOCK_ID in table[first:num_blocks]:
        return False
    return True

  def _needed(self, group: int, table: Sequence[int]) -> list[int]:
    """`table` (a prefix of `len(table)` blocks) with the blocks before the window of the
    first token after it nulled."""
    first = self.first_window_block(group, len(table) * self.block_size)
    return [NULL_BLOCK_ID] * first + list(table[first:])

  def _free_outside_windows(self, req: _RequestBlocks, num_computed_tokens: int) -> None:
    """Frees each window group's pages before the window of the step's first token (class
    docstring), last first."""
    freed = []
    for group, table in enumerate(req.block_ids):
      first = self.first_window_block(group, num_computed_tokens)
      for index in range(min(first, len(table)) - 1, -1, -1):
        if table[index] == NULL_BLOCK_ID:
          break  # earlier ones were freed by an earlier step
        freed.append(table[index])
        table[index] = NULL_BLOCK_ID
    self.block_pool.free_blocks(freed)

  def _cache_full_blocks(self, req: _RequestBlocks, token_ids: Sequence[int]) -> None:
    """Registers the request's full blocks among `token_ids` not registered yet."""
    if not (self.enable_caching and req.cacheable):
      return
    num_full = min(len(token_ids) // self.block_size, len(req.block_ids[0]))
    if num_full <= req.num_cached_blocks:
      return
    extend_block_hashes(
      req.block_hashes, token_ids[: num_full * self.block_size], self.block_size, req.cache_key
    )
    for index in range(req.num_cached_blocks, num_full):
      for group, table in enumerate(req.block_ids):
        if table[index] != NULL_BLOCK_ID:
          key = self._key(group, req.block_hashes[index])
          self.block_pool.cache_full_block(table[index], key)
    req.num_cached_blocks = num_full

  def _update_peaks(self) -> None:
    self._peak_used_blocks = max(self._peak_used_blocks, self.block_pool.num_used_blocks)
    self._peak_running_reqs = max(self._peak_running_reqs, len(self._reqs))

  @staticmethod
  def _check_allocation(req_id: str, *counts: int) -> None:
    names = ("num_new_tokens", "num_computed_tokens", "num_lookahead_tokens")
    for name, value in zip(names, counts):
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 for {req_id!r}, got {value!r}")
