"""Prefix caching on the device: a pool of cached prompt blocks, copied into slots instead of
recomputed (`enable_prefix_caching`).

Design. The KV cache stays contiguous per slot (`models/kv_cache.py`); the prefix cache is a
separate device pool of `num_blocks` blocks, ``[L, num_blocks, 16, K, D]`` keys and values (a
`KVCache` whose "slots" are blocks of 16 positions). After a prefill, every full 16-token block of
each prompt that the pool does not hold yet is copied from the slot into the pool
(`save_blocks`); before a prefill, the longest chain of cached blocks that starts the prompt
(`engine/prefix_cache.py`) is copied from the pool into the slot (`load_blocks`) and the prefill
runs from the first uncached position, attending to the copied prefix through the cache (the
model reads a slot's cached positions below the call's own, see `models/llama.py`). The prompt's
last token is always computed (by the first decode step, which feeds it). Requests asking for
`prompt_logprobs` skip the lookup (their logprobs need every position), as vLLM does, but store
their blocks.

Why a pool with copies rather than matching prefixes in live and finished slots in place:
- a finished request's slot is handed to the next waiting request at once (the scheduler fills
  every free row each step), so in a busy batch (an RL rollout: hundreds of samples for a few
  dozen rows) the KV of finished requests would be gone before anyone could reuse it; the pool
  keeps blocks by recency, independent of slot reuse, and evicts true LRU;
- nothing is pinned or shared: a slot owns its copy, so eviction and `reset_prefix_cache` are
  always safe and the decode step, the sampler, the k-step loop and the mesh code are untouched;
- the copies are cheap next to the prefill they replace. Measured on the 2-core CPU under heavy
  load from other processes (SmolLM2-135M float32: 30 layers, 3 key/value heads of 64, so 45 KiB
  of keys and values per token, 720 KiB per block): 12 blocks (a 192-token shared prefix,
  8.4 MiB) copy from the pool into a slot in 16.7 ms and from a slot into the pool in 12.0 ms,
  against 1,056 ms to prefill those 192 tokens in the same run (`benchmarks/bench_generate.py
  --grpo`, benchmarks/README.md); on the GRPO-shaped workload the rollout ran 1.8x faster and
  the first token came 2x sooner than with one prefill per request alone.
The price is memory: the pool (by default a quarter of the slot cache's positions, at least one
`max_model_len`) holds a second copy of cached prompts, and each new block is written once more.

Shapes are static: the number of block copies of one call is padded to a power-of-two bucket
(padding copies are dropped writes), the cache and the pool are donated, and the prefill of a
remainder is bucketed by its length and by the attention length (a power of two above its last
position). Compiles: one `load_blocks` and one `save_blocks` per copy bucket reached, and one
prefill per (row bucket, length bucket, attention bucket >= the length bucket) reached.

Requests admitted in the same step that share blocks not yet cached are prefilled in waves: the
first of them computes the shared blocks, stores them, then the others load them (a request whose
next uncached block another request of the wave will store waits for the next wave).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.engine.buckets import buckets
from jaxengine.engine.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes
from jaxengine.engine.requests import Completion
from jaxengine.models.kv_cache import KVCache, KVCacheSpec

#: Smallest bucket of block copies per call.
MIN_COPY_BUCKET = 8


def default_num_blocks(max_num_reqs: int, max_model_len: int) -> int:
  """A quarter of the slot cache's positions, at least one `max_model_len`, in blocks."""
  return max(max_num_reqs * max_model_len // 4, max_model_len) // BLOCK_SIZE or 1


def create_pool(spec: KVCacheSpec, num_blocks: int) -> KVCache:
  """A zero pool of `num_blocks` blocks: keys and values ``[L, num_blocks, 16, K, D]``."""
  return KVCache.create(spec, num_blocks, BLOCK_SIZE)


def _block_positions(starts: jax.Array) -> jax.Array:
  """``[P]`` first positions -> ``[P, 16]`` positions of each block."""
  return starts[:, None] + jnp.arange(BLOCK_SIZE, dtype=jnp.int32)


@functools.partial(jax.jit, donate_argnames=("kv_cache",))
def load_blocks(kv_cache: KVCache, pool: KVCache, block_ids, slots, starts) -> KVCache:
  """Copies pool blocks into cache slots.

  Args:
    kv_cache: the slot cache ``[L, num_slots, S, K, D]`` (donated).
    pool: the block pool ``[L, num_blocks, 16, K, D]``.
    block_ids: ``[P] int32`` pool blocks to read.
    slots: ``[P] int32`` target slots; ``num_slots`` marks a padding copy (dropped).
    starts: ``[P] int32`` first target position of each block.

  Returns:
    The cache with positions ``starts[p] .. starts[p] + 15`` of ``slots[p]`` overwritten.
  """
  positions = _block_positions(starts)

  def copy(cache, blocks):
    return cache.at[:, slots[:, None], positions].set(blocks[:, block_ids], mode="drop")

  return jax.tree.map(copy, kv_cache, pool)


@functools.partial(jax.jit, donate_argnames=("pool",))
def save_blocks(pool: KVCache, kv_cache: KVCache, block_ids, slots, starts) -> KVCache:
  """Copies blocks of cache slots into the pool (`load_blocks` the other way).

  Args:
    pool: the block pool (donated).
    kv_cache: the slot cache.
    block_ids: ``[P] int32`` pool blocks to write; ``num_blocks`` marks a padding copy.
    slots: ``[P] int32`` source slots.
    starts: ``[P] int32`` first source position of each block.
  """
  positions = _block_positions(starts)

  def copy(blocks, cache):
    return blocks.at[:, block_ids].set(cache[:, slots[:, None], positions], mode="drop")

  return jax.tree.map(copy, pool, kv_cache)


def copy_arrays(
  copies: Sequence[tuple[int, int, int]], sizes: list[int], pad_block: int, pad_slot: int
):
  """`(block id, slot, block index)` copies as three ``[P] int32`` arrays, `P` the smallest of
  `sizes` holding them, padded with `(pad_block, pad_slot, 0)`."""
  size = next(s for s in sizes if s >= len(copies))
  block_ids = np.full((size,), pad_block, np.int32)
  slots = np.full((size,), pad_slot, np.int32)
  starts = np.zeros((size,), np.int32)
  for i, (block, slot, index) in enumerate(copies):
    block_ids[i], slots[i], starts[i] = block, slot, index * BLOCK_SIZE
  return block_ids, slots, starts


def prefill_end(completion: Completion) -> int:
  """Where the prefill of a prompt ends with the cache on: before the last token (the first decode
  step feeds it), or at the end of a prompt of whole blocks, so its last block can be stored (the
  decode step then writes the last position again, with the same keys and values)."""
  length = len(completion.request.prompt_token_ids)
  if _skips_cache(completion):
    return length - 1  # prompt logprobs cover positions 1 .. length - 1
  return max(length - 1, length // BLOCK_SIZE * BLOCK_SIZE)


def _skips_cache(completion: Completion) -> bool:
  """Prompt logprobs need every position computed (vLLM skips the cache for them too)."""
  return completion.index == 0 and completion.params.prompt_logprobs is not None


@dataclasses.dataclass(frozen=True)
class PrefillWave:
  """The completions one prefill call handles after a prefix cache lookup.

  Attributes:
    completions: those prefilled now.
    starts: each one's first uncached position (by `seq_id`), a multiple of 16.
    slots: each one's KV-cache slot (by `seq_id`).
    loads: `(pool block, cache slot, block index)` copies that fill the cached prefixes first.
    deferred: completions that wait for the next wave (a block they need is stored by this one).
    hashes: the block hashes of every prompt of the prefill, by `seq_id`.
  """

  completions: list[Completion]
  starts: dict[str, int]
  slots: dict[str, int]
  loads: list[tuple[int, int, int]]
  deferred: list[Completion]
  hashes: Mapping[str, list[bytes]]


class PrefixPrefill:
  """The prefix cache of one runner: host index, device pool, and the prefill in waves.

  The runner owns the KV cache; this class plans waves and copies blocks between the cache it is
  handed and its own pool:

      for wave in prefix.waves(completions, cache_slot):
        kv_cache = prefix.load(kv_cache, wave)
        ...prefill wave.completions from wave.starts...
        prefix.store(kv_cache, wave)

  Args:
    spec: the model's `KVCacheSpec`.
    num_blocks: pool size in blocks.
    max_blocks_per_call: most block copies one call makes (rows x blocks per slot).
  """

  def __init__(self, spec: KVCacheSpec, num_blocks: int, max_blocks_per_call: int) -> None:
    # The device pool first: a pool too large for the device fails there, with a clear
    # RESOURCE_EXHAUSTED, before the host index builds a free list of that many blocks.
    self.pool = create_pool(spec, num_blocks)
    self.index = PrefixCache(num_blocks)
    self.copy_buckets = buckets(max_blocks_per_call, min(MIN_COPY_BUCKET, max_blocks_per_call))

  def waves(
    self, completions: Sequence[Completion], cache_slot: Callable[[str], int]
  ) -> Iterator[PrefillWave]:
    """The waves that prefill `completions` (each already holds a row) through the cache.

    A generator: each wave is planned when the caller asks for it, so after the caller stored
    the previous one (`store`), whose blocks it may then load.

    Args:
      completions: the completions to prefill.
      cache_slot: the KV-cache slot of a `seq_id` (`InputBatch.cache_slot`).
    """
    hashes = {c.seq_id: block_hashes(c.request.prompt_token_ids) for c in completions}
    pending = list(completions)
    while pending:
      wave = self._plan_wave(pending, hashes, cache_slot)
      yield wave
      pending = wave.deferred

  def load(self, kv_cache: KVCache, wave: PrefillWave) -> KVCache:
    """Copies the wave's cached prefixes from the pool into their slots of `kv_cache` (donated);
    returns the new cache."""
    for chunk in self._chunks(wave.loads):
      arrays = copy_arrays(chunk, self.copy_buckets, 0, kv_cache.num_slots)
      kv_cache = load_blocks(kv_cache, self.pool, *arrays)
    return kv_cache

  def store(self, kv_cache: KVCache, wave: PrefillWave) -> None:
    """Copies the wave's new full prompt blocks from `kv_cache` (read, after the wave's prefill)
    into the pool."""
    writes: dict[int, tuple[int, int]] = {}  # a block reused within the wave: the last owner
    for completion in wave.completions:
      slot = wave.slots[completion.seq_id]
      written = prefill_end(completion) // BLOCK_SIZE
      for index, block in self.index.store(wave.hashes[completion.seq_id][:written]):
        writes[block] = (slot, index)
    copies = [(block, slot, index) for block, (slot, index) in writes.items()]
    for chunk in self._chunks(copies):
      arrays = copy_arrays(chunk, self.copy_buckets, self.index.num_blocks, 0)
      self.pool = save_blocks(self.pool, kv_cache, *arrays)

  def precompile_copy(self, kv_cache: KVCache, size: int) -> KVCache:
    """Compiles the block copies of one copy bucket with `size` padding copies (nothing is
    written); returns the cache (donated, unchanged)."""
    drop = np.full((size,), kv_cache.num_slots, np.int32)
    zeros = np.zeros((size,), np.int32)
    kv_cache = load_blocks(kv_cache, self.pool, zeros, drop, zeros)
    pad = np.full((size,), self.index.num_blocks, np.int32)
    self.pool = save_blocks(self.pool, kv_cache, pad, zeros, zeros)
    return kv_cache

  def _chunks(self, copies: list) -> list[list]:
    """Copies in calls of at most the largest copy bucket."""
    size = self.copy_buckets[-1]
    return [copies[i : i + size] for i in range(0, len(copies), size)]

  def _plan_wave(
    self,
    pending: list[Completion],
    hashes: Mapping[str, list[bytes]],
    cache_slot: Callable[[str], int],
  ) -> PrefillWave:
    """Which pending completions prefill now, from which position, after which block loads."""
    wave, deferred, starts, slots, loads = [], [], {}, {}, []
    produced: set[bytes] = set()
    for completion in pending:
      chain = hashes[completion.seq_id]
      if _skips_cache(completion):
        blocks: list[int] = []
      else:
        matched = 0
        while matched < len(chain) and chain[matched] in self.index:
          matched += 1
        if matched < len(chain) and chain[matched] in produced:
          deferred.append(completion)  # the next wave finds more of it cached
          continue
        blocks = self.index.match(chain, len(completion.request.prompt_token_ids))
      produced.update(chain[len(blocks) : prefill_end(completion) // BLOCK_SIZE])
      wave.append(completion)
      starts[completion.seq_id] = len(blocks) * BLOCK_SIZE
      slot = slots[completion.seq_id] = cache_slot(completion.seq_id)
      loads += [(block, slot, i) for i, block in enumerate(blocks)]
    return PrefillWave(wave, starts, slots, loads, deferred, hashes)
