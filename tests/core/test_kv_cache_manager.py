"""The paged KV cache's host bookkeeping (`core/block_pool.py`, `core/kv_cache_manager.py`):
reference counts, the LRU free queue of cached prefix blocks, prefix hits, forks, preemption, and a
stateful model in which no block ever leaks or is handed to two owners by mistake."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from jaxengine.core.block_pool import (
  NULL_BLOCK_ID,
  BlockPool,
  extend_block_hashes,
  hash_block_tokens,
)
from jaxengine.core.kv_cache_groups import KVCacheGroups, kv_cache_groups, single_group
from jaxengine.core.kv_cache_manager import ComputedBlocks, KVCacheManager

BS = 4  # a small block size keeps the examples short


def test_hash_chain_covers_full_blocks_each_hash_over_its_parent():
  tokens = list(range(3, 40))
  whole = extend_block_hashes([], tokens, 16)
  assert whole == [
    hash_block_tokens(b"", tokens[:16]),
    hash_block_tokens(hash_block_tokens(b"", tokens[:16]), tokens[16:32]),
  ]  # 37 tokens: two full blocks, the partial third is not hashed
  chain = extend_block_hashes([], tokens[:20], 4)  # grown in two steps: the same chain
  assert extend_block_hashes(chain, tokens, 4) == extend_block_hashes([], tokens, 4)
  changed = extend_block_hashes([], [0, *tokens[1:]], 4)  # a first-block change reaches all
  assert all(a != b for a, b in zip(changed, extend_block_hashes([], tokens, 4), strict=True))
  assert hash_block_tokens(b"", [1, 2]) != hash_block_tokens(b"", [2, 1])


def test_pool_never_hands_out_the_null_block_and_refuses_bad_sizes():
  pool = BlockPool(4)
  assert pool.num_usable_blocks == 3 and pool.num_free_blocks == 3
  assert sorted(pool.get_new_blocks(3)) == [1, 2, 3]
  with pytest.raises(ValueError, match="cannot take 1 blocks: 0 free"):
    pool.get_new_blocks(1)
  with pytest.raises(ValueError, match="block id 0 is not a usable block"):
    pool.free_blocks([NULL_BLOCK_ID])
  for bad in (1, 0, 2.0, True):
    with pytest.raises(ValueError, match="num_blocks"):
      BlockPool(bad)  # type: ignore[arg-type]
  with pytest.raises(ValueError, match="block_size"):
    KVCacheManager(8, block_size=0)


def test_pool_free_queue_is_lru_and_eviction_drops_the_hash():
  pool = BlockPool(5)
  a, b, c, d = pool.get_new_blocks(4)
  pool.cache_full_block(a, b"ha")
  pool.cache_full_block(b, b"hb")
  pool.free_blocks([b, a])  # b first: b is evicted before a
  assert pool.free_block_ids() == [b, a]
  assert pool.get_cached_block(b"ha") == a
  pool.touch([a])  # a prefix hit takes a back without evicting anything
  assert pool.ref_cnt[a] == 1 and pool.free_block_ids() == [b]
  assert pool.get_new_blocks(1) == [b] and pool.get_cached_block(b"hb") is None
  assert pool.num_evictions == 1
  with pytest.raises(ValueError, match="not in use"):
    pool.free_blocks([a, a])
  assert c and d


def test_allocate_grow_and_refuse_without_changing_anything():
  manager = KVCacheManager(6, block_size=BS)  # 5 usable blocks
  assert manager.allocate_slots("a", 6) == [1, 2]
  assert manager.allocate_slots("a", 2, num_computed_tokens=6) == []  # 8 tokens: still 2 blocks
  assert manager.allocate_slots("a", 1, num_computed_tokens=8) == [3]
  before = (manager.get_block_ids("a"), manager.block_pool.free_block_ids())
  assert manager.allocate_slots("b", 9) is None  # 3 blocks, 2 free
  assert manager.allocate_slots("a", 1, num_computed_tokens=9, num_lookahead_tokens=12) is None
  assert (manager.get_block_ids("a"), manager.block_pool.free_block_ids()) == before
  assert manager.get_block_ids("b") == ()
  assert manager.stats.num_used_blocks == 3 and manager.stats.num_running_reqs == 1
  with pytest.raises(ValueError, match="num_computed_tokens=13 exceeds the 3 blocks"):
    manager.allocate_slots("a", 1, num_computed_tokens=13)
  with pytest.raises(ValueError, match="num_new_tokens must be an int >= 0"):
    manager.allocate_slots("a", -1)
  assert manager.free("a") == 3 and manager.free("a") == 0
  assert manager.stats.num_used_blocks == 0 and manager.stats.peak_used_blocks == 3


def test_check_fits_names_the_numbers():
  manager = KVCacheManager(5, block_size=BS)
  manager.check_fits(16)
  with pytest.raises(ValueError, match=r"17 tokens needs 5 KV cache blocks of 4 tokens.*has 4"):
    manager.check_fits(17)
  # Each group of layers (here three) holds pages of its own: the message adds them up.
  grouped = KVCacheManager(9, block_size=BS, groups=kv_cache_groups(3, 4, (0, 2)))
  with pytest.raises(ValueError, match=r"needs 15 KV cache blocks of 4 tokens in all of its 3 "):
    grouped.check_fits(17)


def test_prefix_hit_shares_blocks_and_keeps_the_last_token_to_compute():
  manager = KVCacheManager(10, block_size=BS)
  prompt = list(range(10, 22))  # 12 tokens: 3 full blocks
  assert manager.allocate_slots("a", 12, token_ids=prompt) == [1, 2, 3]
  hit = manager.get_computed_blocks(prompt)  # the last token is recomputed: 2 blocks
  assert hit == ComputedBlocks((1, 2), 8)
  assert manager.allocate_slots("b", 4, token_ids=prompt, new_computed_blocks=hit) == [1, 2, 4]
  assert manager.block_pool.ref_cnt[1:5] == [2, 2, 1, 1]
  other = [*prompt[:4], 99, *prompt[5:]]
  assert manager.get_computed_blocks(other) == ComputedBlocks((1,), 4)
  stats = manager.stats
  assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (24, 12)
  manager.free("a")
  manager.free("b")
  assert manager.stats.num_used_blocks == 0
  assert manager.get_computed_blocks(prompt + [7]) == ComputedBlocks((1, 2, 3), 12)  # still cached
  manager.allocate_slots("c", 1)
  with pytest.raises(ValueError, match="already holds"):
    manager.allocate_slots("c", 1, new_computed_blocks=hit)


def test_a_prefix_hit_on_free_blocks_is_not_evicted_by_the_same_allocation():
  manager = KVCacheManager(6, block_size=BS)  # 5 usable blocks
  prompt = list(range(8))
  assert manager.allocate_slots("a", 8, token_ids=prompt) == [1, 2]
  assert manager.allocate_slots("c", 12, token_ids=list(range(50, 62))) == [3, 4, 5]
  manager.free("a")
  manager.free("c")
  assert manager.block_pool.free_block_ids() == [2, 1, 5, 4, 3]  # each request's tail first
  assert manager.allocate_slots("d", 1) == [2]  # evicts a's second block
  hit = manager.get_computed_blocks([*prompt[:4], 9])
  assert hit.block_ids == (1,) and manager.block_pool.free_block_ids()[0] == 1
  # The hit leaves the free queue before new blocks are taken from its head.
  assert manager.allocate_slots("b", 1, new_computed_blocks=hit) == [1, 5]
  assert manager.stats.num_evictions == 2  # a's second block, c's third
  manager.free("b")
  manager.free("d")
  hit = manager.get_computed_blocks([*prompt[:4], 9])
  assert manager.allocate_slots("e", 17, new_computed_blocks=hit) is None  # 1 hit + 5 new > 5


def test_fork_shares_full_prompt_blocks_and_preempt_counts():
  manager = KVCacheManager(12, block_size=BS)
  prompt = list(range(10))  # 2 full blocks and 2 tokens
  manager.allocate_slots("r", 10, token_ids=prompt)
  shared = manager.fork("r", "r#1", 10)
  assert shared == ComputedBlocks((1, 2), 8)
  assert manager.allocate_slots("r#1", 3, num_computed_tokens=8, token_ids=prompt) == [4]
  assert manager.block_pool.ref_cnt[1:5] == [2, 2, 1, 1]
  with pytest.raises(ValueError, match="already holds"):
    manager.fork("r", "r#1", 10)
  with pytest.raises(ValueError, match="holds no 40 tokens"):
    manager.fork("r", "r#2", 40)
  assert manager.preempt("r") == 3
  assert manager.stats.num_preemptions == 1 and manager.block_pool.ref_cnt[1:3] == [1, 1]
  manager.reset_stats()
  stats = manager.stats
  assert (stats.num_preemptions, stats.peak_used_blocks, stats.peak_running_reqs) == (0, 3, 1)


def test_reset_prefix_cache_forgets_hashes_but_not_owners():
  manager = KVCacheManager(8, block_size=BS)
  prompt = list(range(9))
  manager.allocate_slots("a", 9, token_ids=prompt)
  assert manager.reset_prefix_cache() == 2
  assert manager.get_computed_blocks(prompt) == ComputedBlocks()
  assert manager.get_block_ids("a") == (1, 2, 3)
  manager.allocate_slots("a", 4, num_computed_tokens=9, token_ids=[*prompt, 1, 2, 3, 4])
  assert manager.get_computed_blocks([*prompt, 1, 2, 3, 4, 5]).block_ids == ()  # chain head gone
  assert manager.stats.num_cached_blocks == 0  # a block computed over stale blocks is stale too
  manager.allocate_slots("b", 9, token_ids=prompt)  # a new request registers again
  assert manager.get_computed_blocks(prompt).block_ids == (5, 6)


def test_caching_off_registers_nothing():
  manager = KVCacheManager(8, block_size=BS, enable_caching=False)
  prompt = list(range(9))
  manager.allocate_slots("a", 9, token_ids=prompt)
  assert manager.get_computed_blocks(prompt) == ComputedBlocks()
  assert manager.stats.num_cached_blocks == 0


# -- stateful model --------------------------------------------------------------------------

TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=12)
CHUNKS = st.integers(1, 12)  # prefill chunk sizes (a token budget)  # few values: prefixes collide


class BlockBookkeeping(RuleBasedStateMachine):
  """A scheduler's moves against a plain-Python model of what each request holds.

  The model writes each computed token into a simulated page (`pages[block][offset]`); every
  request must read back exactly its own tokens from its block table at all times, so a block
  evicted or handed out while in use shows up as a wrong token.
  """

  reqs = Bundle("reqs")
  #: The KV cache groups (None: one) and the pool's size (5 usable blocks: pressure is common).
  GROUPS: KVCacheGroups | None = None
  NUM_BLOCKS = 6

  def __init__(self) -> None:
    super().__init__()
    self.manager = KVCacheManager(self.NUM_BLOCKS, block_size=BS, groups=self.GROUPS)
    self.tokens: dict[str, list[int]] = {}  # every known token of a request
    self.computed: dict[str, int] = {}
    self.pages: dict[int, list[int | None]] = {}
    self.count = 0
    self.preemptions = 0
    self.prompts: list[list[int]] = []  # every prompt so far, for prefix hits

  def _write(self, req_id: str, start: int, stop: int) -> None:
    for blocks in self.manager.get_group_block_ids(req_id):
      for pos in range(start, stop):
        assert blocks[pos // BS] != NULL_BLOCK_ID  # a position computed now has its page
        page = self.pages.setdefault(blocks[pos // BS], [None] * BS)
        page[pos % BS] = self.tokens[req_id][pos]

  def _step(self, req_id: str, num_new: int) -> bool:
    done = self.computed[req_id]
    appended = self.manager.allocate_slots(
      req_id, num_new, num_computed_tokens=done, token_ids=self.tokens[req_id]
    )
    if appended is None:
      return False
    self._write(req_id, done, done + num_new)
    self.computed[req_id] = done + num_new
    return True

  @rule(target=reqs, prompt=TOKENS, chunk=CHUNKS)
  def add(self, prompt, chunk):
    return self._add(prompt, chunk)

  @rule(target=reqs, data=st.data(), own=TOKENS, chunk=CHUNKS)
  def add_with_a_known_prefix(self, data, own, chunk):
    if not self.prompts:
      return "none"
    known = data.draw(st.sampled_from(self.prompts))
    cut = data.draw(st.integers(0, len(known)))
    return self._add(known[:cut] + own, chunk)

  def _add(self, prompt: list[int], chunk: int) -> str:
    """Admits a request with a first prefill chunk of up to `chunk` tokens after its hit."""
    self.prompts.append(list(prompt))
    self.count += 1
    req_id = f"r{self.count}"
    hit = self.manager.get_computed_blocks(prompt)
    for blocks in hit.groups(self.manager.num_groups):  # a hit holds exactly the prompt's tokens
      for index, block in enumerate(blocks):
        assert block == NULL_BLOCK_ID or self.pages[block] == prompt[index * BS : (index + 1) * BS]
    num_new = min(chunk, len(prompt) - hit.num_computed_tokens)
    appended = self.manager.allocate_slots(
      req_id, num_new, token_ids=prompt, new_computed_blocks=hit
    )
    if appended is None:
      assert self.manager.get_block_ids(req_id) == ()
      return req_id  # never admitted: the other rules skip it
    self.tokens[req_id] = list(prompt)
    self.computed[req_id] = hit.num_computed_tokens
    self._write(req_id, hit.num_computed_tokens, hit.num_computed_tokens + num_new)
    self.computed[req_id] = hit.num_computed_tokens + num_new
    return req_id

  @rule(req_id=reqs, new=st.lists(st.integers(0, 2), min_size=1, max_size=5))
  def grow(self, req_id, new):
    """The next prefill chunk (`len(new)` tokens), or decode / draft tokens once prefilled."""
    if req_id not in self.tokens:
      return
    remaining = len(self.tokens[req_id]) - self.computed[req_id]
    if remaining:
      self._step(req_id, min(remaining, len(new)))
      return
    self.tokens[req_id].extend(new)
    if not self._step(req_id, len(new)):
      del self.tokens[req_id][-len(new) :]

  @rule(req_id=consumes(reqs))
  def finish(self, req_id):
    self._drop(req_id)

  @rule(req_id=reqs)
  def abort_during_prefill(self, req_id):
    if req_id in self.tokens and self.computed[req_id] < len(self.tokens[req_id]):
      self._drop(req_id)

  @rule(req_id=consumes(reqs))
  def preempt(self, req_id):
    if req_id in self.tokens:
      self.preemptions += 1
      self.manager.preempt(req_id)
      del self.tokens[req_id], self.computed[req_id]

  @rule(target=reqs, req_id=reqs)
  def fork(self, req_id):
    if req_id not in self.tokens:
      return "gone"
    self.count += 1
    child = f"r{self.count}"
    shared = self.manager.fork(req_id, child, self.computed[req_id])
    self.tokens[child] = list(self.tokens[req_id])
    self.computed[child] = shared.num_computed_tokens
    if not self._step(child, len(self.tokens[child]) - shared.num_computed_tokens):
      self.manager.free(child)
      del self.tokens[child], self.computed[child]
    return child

  @rule()
  def reset_prefix_cache(self):
    self.manager.reset_prefix_cache()

  def _drop(self, req_id: str) -> None:
    if req_id in self.tokens:
      self.manager.free(req_id)
      del self.tokens[req_id], self.computed[req_id]

  @invariant()
  def every_request_reads_its_own_tokens(self):
    for req_id, tokens in self.tokens.items():
      computed = self.computed[req_id]
      for group, blocks in enumerate(self.manager.get_group_block_ids(req_id)):
        assert len(blocks) == -(-computed // BS)
        first = self.manager.first_window_block(group, computed)  # 0 for a full group
        assert NULL_BLOCK_ID not in blocks[first:]  # the next token's window is all there
        for pos in range(first * BS, computed):
          assert self.pages[blocks[pos // BS]][pos % BS] == tokens[pos]

  @invariant()
  def refcounts_match_the_block_tables(self):
    pool = self.manager.block_pool
    expected = [0] * pool.num_blocks
    for req_id in self.tokens:
      for blocks in self.manager.get_group_block_ids(req_id):
        for block in blocks:
          expected[block] += block != NULL_BLOCK_ID
    assert pool.ref_cnt == expected
    free = pool.free_block_ids()
    assert sorted(free) == [b for b in range(1, pool.num_blocks) if expected[b] == 0]
    stats = self.manager.stats
    assert stats.num_used_blocks == sum(count > 0 for count in expected)
    assert stats.num_running_reqs == len(self.tokens)
    assert stats.num_preemptions == self.preemptions
    assert stats.peak_used_blocks >= stats.num_used_blocks

  def teardown(self):
    for req_id in list(self.tokens):
      self._drop(req_id)
    pool = self.manager.block_pool
    assert pool.ref_cnt == [0] * pool.num_blocks
    assert sorted(pool.free_block_ids()) == list(range(1, pool.num_blocks))
    assert self.manager.stats.num_used_blocks == 0


BlockBookkeeping.TestCase.settings = settings(
  max_examples=150, stateful_step_count=40, deadline=None,
  suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
test_block_bookkeeping = BlockBookkeeping.TestCase


class WindowBookkeeping(BlockBookkeeping):
  """The same moves with a global layer and a layer with a window of 5 (two tables per
  request): window pages are freed as requests advance, hits and forks are shortened to what
  is still cached, and every request still reads its tokens back in each table's window."""

  GROUPS = kv_cache_groups(2, 5, (1,))
  NUM_BLOCKS = 10


WindowBookkeeping.TestCase.settings = settings(
  max_examples=100, stateful_step_count=40, deadline=None,
  suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
test_window_bookkeeping = WindowBookkeeping.TestCase


def test_layers_split_into_kv_cache_groups_of_equal_size():
  assert kv_cache_groups(4, None, None) == single_group(4)  # no window: one group, as before
  assert kv_cache_groups(4, 8, (1, 3), enabled=False) == single_group(4)
  assert kv_cache_groups(4, 8, None).group_windows == (8,)  # Mistral: one window group
  full = (5, 11, 17, 23, 29)  # Gemma 3 4B: 34 layers, 5 global
  groups = kv_cache_groups(34, 1024, [i for i in range(34) if i not in full])
  assert groups.group_windows == (None,) + (1024,) * 6 and groups.group_size == 5
  assert [groups.layer_groups[i] for i in (5, 29, 0, 4, 6, 33)] == [
    (0, 0), (0, 4), (1, 0), (1, 4), (2, 0), (6, 3)
  ]  # fmt: skip


def test_window_groups_free_slid_out_pages_and_shorten_prefix_hits_and_forks():
  """Layer 1 global, layers 0 and 2 with a window of 4 (`kv_cache_groups`): three tables per
  request from one pool; a window group frees the pages before `p0 - W` and a prefix hit or a
  fork needs the window's pages of its first computed token."""
  manager = KVCacheManager(
    41, block_size=BS, groups=kv_cache_groups(3, 4, (0, 2)), max_num_batched_tokens=8
  )
  assert manager.num_blocks_needed(64) == 16 + 2 * 4  # full: 16; each window: (4 + 8) / 4 + 1
  prompt = list(range(10, 22))
  assert manager.allocate_slots("a", 8, token_ids=prompt) == [1, 2]
  manager.allocate_slots("a", 4, num_computed_tokens=8, token_ids=prompt)
  assert manager.get_group_block_ids("a") == ((1, 2, 7), (0, 4, 8), (0, 6, 9))  # 3, 5 freed
  assert [manager.num_held_blocks("a", g) for g in range(3)] == [3, 2, 2]
  manager.free("a")
  manager.allocate_slots("x", 44)  # 33 pages: the 31 never used, then 3 and 5 (evicted)
  assert manager.get_computed_blocks(prompt[:5]) == ComputedBlocks()  # window pages gone
  hit = manager.get_computed_blocks(prompt[:9])
  assert hit == ComputedBlocks((1, 2), 8, ((1, 2), (0, 4), (0, 6)))
  assert manager.allocate_slots("b", 1, token_ids=prompt[:9], new_computed_blocks=hit) == [1, 2, 7]
  assert manager.fork("b", "b#1", 9) == ComputedBlocks((1, 2), 8)
  assert manager.get_group_block_ids("b#1") == ((1, 2), (0, 4), (0, 6))
  manager.allocate_slots("b", 4, num_computed_tokens=12, token_ids=prompt)  # frees 4, 6 of b
  assert manager.fork("b", "b#2", 9) == ComputedBlocks()  # b lost the window's pages
  assert manager.block_pool.ref_cnt[4] == 1 and manager.free("b#1") == 4
