"""Host bookkeeping of the engine: requests, KV-cache pages and the scheduler (vLLM V1's `core/`).

Nothing here touches a device: the worker (`jaxengine/worker/`) runs what the scheduler plans.

request.py            host records: a `Request` and its `Completion`s (one per sample of `n`)
block_pool.py         the pages: blocks, reference counts, prefix hashes, eviction
kv_cache_groups.py    KV cache groups: which layers share a block table, each layer's page slot
kv_cache_stats.py     `KVCacheStats`: the paged cache's occupancy, peaks and prefix-cache counters
kv_cache_manager.py   per-request block tables (one per group), prefix hits, the stats
state_slots.py        a hybrid model's recurrent state slots, one per running completion
state_snapshots.py    a hybrid model's states saved at block boundaries (its prefix caching)
scheduler.py          `Scheduler`: token budget, chunked prefill, preemption, the queues
"""
