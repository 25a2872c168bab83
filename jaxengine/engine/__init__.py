"""The engine, split by job as vLLM's V1 engine is.

core.py               `LLMEngine`, which wires the others together: one step, one lifecycle
                      (`_update_from_output` applies a step's tokens, `_finish` the one finish path)
engine_config.py      `EngineConfig`: the engine's options, validated once (`LLM`, the CLI)
requests.py           host records: a `Request` and its `Completion`s
input_processor.py    prompts and `SamplingParams` -> validated `Request`s
scheduler.py          which completions run (first come, first served, within the batch's rows)
structured.py         structured outputs: llguidance grammars, matchers and the token bitmask
runner.py             `ModelRunner`: weights, KV cache, persistent batch, the device steps
steps.py              `RunnerSteps`: the runner's jitted steps, built once
buckets.py            bucket sizes of every step (rows, prompt lengths, attention, copies)
placement.py          placing weights, KV cache and batch state on a mesh
prefill.py            the prefill steps (prompt KV, optional prompt logprobs)
decode.py             the fused decode-and-sample step; the step outputs the engine reads
multi_step.py         k decode-and-sample steps in one device loop, rows stopping on the device
shared_prefill.py     one prefill for the n samples of a request (KV copied between slots)
precompile.py         compiling every bucket ahead of the first request
speculative.py        n-gram speculative decoding: the config, the host proposer, the stats
speculative_policy.py when a step verifies drafts: the cost policy
verify.py             the verify step: the model over k + 1 positions, then rejection_sample
output_processor.py   tokens -> logprob dicts, text and stop rules
block_pool.py         the paged KV cache: blocks, reference counts, prefix hashes, eviction
kv_cache_manager.py   the paged KV cache: per-request block tables, prefix hits, `KVCacheStats`
kv_cache_size.py      the paged KV cache: its default size (pages for the rows, memory limit)
paged_scheduler.py    the paged engine's scheduler: token budget, chunked prefill, preemption
paged_inputs.py       the paged KV cache: a ragged step's positions, slots, attention metadata
ragged_step.py        the model once over a ragged step's tokens, then the sampler
paged_runner.py       `PagedModelRunner`: the runner over pages, one ragged step per call
paged_multi_step.py   k ragged decode steps in one device loop over pages (num_decode_steps)
paged_verify.py       speculative decoding on pages: drafts as query tokens, the verify step
"""

from jaxengine.engine.core import LLMEngine
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.output_processor import find_stop_string
from jaxengine.engine.runner import ModelRunner

__all__ = ["EngineConfig", "LLMEngine", "ModelRunner", "find_stop_string"]
