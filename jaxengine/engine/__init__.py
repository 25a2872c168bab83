"""The engine, split by job as vLLM's V1 engine is.

core.py               `LLMEngine`, which wires the others together: one step, one lifecycle
                      (`_update_from_output` applies a step's tokens, `_finish` the one finish path)
engine_config.py      `EngineConfig`: the engine's options, validated once (`LLM`, the CLI)
requests.py           host records: a `Request` and its `Completion`s
input_processor.py    prompts and `SamplingParams` -> validated `Request`s
structured.py         structured outputs: llguidance grammars, matchers and the token bitmask
buckets.py            bucket sizes of every step (rows, tokens)
placement.py          placing weights, KV-cache pages and batch state on a mesh
speculative.py        n-gram speculative decoding: the config, the host proposer, the stats
speculative_policy.py when a step verifies drafts: the cost policy
output_processor.py   tokens -> logprob dicts, text and stop rules
block_pool.py         the paged KV cache: blocks, reference counts, prefix hashes, eviction
kv_cache_manager.py   the paged KV cache: per-request block tables, prefix hits, `KVCacheStats`
kv_cache_size.py      the paged KV cache: its default size (pages for the rows, memory limit)
paged_scheduler.py    the scheduler: token budget, chunked prefill, preemption, the queues
paged_inputs.py       the paged KV cache: a ragged step's positions, slots, attention metadata
ragged_step.py        the model once over a ragged step's tokens, then the sampler
paged_runner.py       `PagedModelRunner`: weights, KV-cache pages, persistent batch, the jitted
                      steps (one ragged step per call), precompile
paged_multi_step.py   k ragged decode steps in one device loop over pages (num_decode_steps),
                      rows stopping on the device
paged_verify.py       speculative decoding: drafts as query tokens, the verify step
"""

from jaxengine.engine.core import LLMEngine
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.output_processor import find_stop_string
from jaxengine.engine.paged_runner import PagedModelRunner

__all__ = ["EngineConfig", "LLMEngine", "PagedModelRunner", "find_stop_string"]
