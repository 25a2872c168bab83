"""`KVCacheStats`: the occupancy report of the paged KV cache (pages, requests, preemptions,
prefix-cache hits, evictions), as `KVCacheManager.stats` and `LLMEngine.kv_cache_stats` return it.

Host integers only; counters and peaks run from the last `reset_stats`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVCacheStats:
  """Occupancy of the paged KV cache (vLLM-like names). Peaks and counters run from the last
  reset: `reset_stats`, which `LLMEngine.reset_kv_cache_stats` calls.

  Attributes:
    num_blocks: blocks requests can hold (the pool less the null block).
    num_used_blocks: blocks held by at least one request now.
    peak_used_blocks: the most blocks held at once since the last reset.
    num_running_reqs: requests holding blocks now.
    peak_running_reqs: the most requests holding blocks at once since the last reset.
    num_preemptions: requests preempted (blocks freed, to be recomputed) since the last reset.
    num_cached_blocks: blocks registered under a prefix hash now (in use or evictable).
    prefix_cache_queries: prompt tokens looked up in the prefix cache since the last reset.
    prefix_cache_hits: those found cached (whole blocks).
    num_evictions: cached blocks reused for other contents since the last reset.
  """

  num_blocks: int
  num_used_blocks: int
  peak_used_blocks: int
  num_running_reqs: int
  peak_running_reqs: int
  num_preemptions: int
  num_cached_blocks: int
  prefix_cache_queries: int
  prefix_cache_hits: int
  num_evictions: int
