"""`LLMEngine`: continuous batching, wiring the input processor, the engine cores and the output
processor together.

A request comes in through `InputProcessor` (validated on the host, nothing queued on an error),
goes to one `EngineCore` (`engine/engine_core.py`: a scheduler, a model runner with its persistent
batch and pool of KV-cache pages, and the step loop), and its tokens become logprob dicts, text
and finish reasons through `OutputProcessor`. Without data parallelism there is one core; with
`data_parallel_size` d > 1 there is one per data-parallel group, each on its own devices with its
own rows, pages and scheduler, and each new request goes to the core with the fewest unfinished
completions (the first such core on a tie; the `n` samples of a request stay together, sharing
their prompt's pages).

`step()` steps every core in turn. With asynchronous scheduling (the default) each core's step
dispatches its next device step before it reads the last one, so the groups' devices compute
at the same time while the host works on one group's tokens. The options: one `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from flax import nnx

from jaxengine.core.kv_cache_manager import KVCacheStats
from jaxengine.core.request import Request
from jaxengine.core.scheduler import Scheduler
from jaxengine.engine.arg_utils import EngineArgs
from jaxengine.engine.engine_core import EngineCore, latest_outputs
from jaxengine.engine.input_processor import InputProcessor
from jaxengine.engine.model_loader import load_model
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine.pause import PausableEngine, PauseState
from jaxengine.engine.structured import StructuredOutputs
from jaxengine.engine_config import EngineConfig, engine_config, with_engine_options
from jaxengine.lora import LoRAAdapter, LoRARequest, check_lora_request
from jaxengine.models.interface import Model, check_model
from jaxengine.outputs import RequestOutput
from jaxengine.params import RequestOutputKind, SamplingParams
from jaxengine.spec_decode.ngram_proposer import SpecDecodingStats
from jaxengine.tokenizer import Tokenizer
from jaxengine.worker import sleep_mode
from jaxengine.worker.model_runner import ModelRunner
from jaxengine.worker.precompile import precompile

#: One request for `LLMEngine.add_requests`: `(request_id or None, prompt, params or None)`,
#: optionally with a fourth item, its `LoRARequest` or None.
RequestSpec = (
  tuple[str | None, object, SamplingParams | None]
  | tuple[str | None, object, SamplingParams | None, LoRARequest | None]
)


class LLMEngine(PausableEngine):
  """Continuous batching over a persistent `InputBatch` and a paged KV cache (pauses: `pause.py`).

  Args:
    model: a `jaxengine.models.Model` (e.g. `jaxengine.models.Llama`), weights loaded.
    tokenizer: its `Tokenizer`, or None (then prompts must be token ids, no text is produced and
      stop strings / bad_words strings are rejected).
    eos_token_id: overrides the tokenizer's / model's EOS id; a list gives the EOS id first and
      more ids that also end generation (a checkpoint's `generation_config.json` lists several):
      like vLLM, those finish with `stop_reason` set to the id, unless `ignore_eos`.
    config: an `EngineConfig`; keywords given as well replace its fields.
    **options: `EngineConfig` fields as keywords (vLLM's names: `max_num_reqs`,
      `max_model_len`, `max_num_logprobs`, `logprobs_mode`, `seed`, `mesh`, ...; a loader-only
      field such as `dtype` has no effect on a built model). Those the engine reads:
    max_num_reqs: rows of the batch (sequences decoded at once; with data parallelism, all
      groups together).
    max_model_len: longest prompt plus output, in tokens; None (default): the model's
      `max_position_embeddings` (`config` then holds the resolved value).
    mesh: None (one device) or a `jax.sharding.Mesh` with axes ``("data", "model")``, or
      `tensor_parallel_size` / `data_parallel_size` to build one: see `ModelRunner` and
      `jaxengine.parallel`. The pages split over key/value heads on the "model" axis; each
      index of the "data" axis is a data-parallel group with its own `EngineCore` (see the
      module): `max_num_reqs / data_parallel_size` rows, its own pool of pages (sized as one
      engine's would be on its devices), scheduler, prefix cache and weights.
    kv_cache_memory_bytes, num_kv_blocks, gpu_memory_utilization, block_size,
      max_num_batched_tokens, enable_chunked_prefill, attention_backend: the paged cache and
      its scheduler; see `EngineConfig` and `worker/model_runner.py`.
    num_decode_steps: `k`, the most decode-and-sample steps one `step()` runs in a single device
      loop (default 1: one token per step). Larger values pay the host round trip once per `k`
      tokens. Tokens, text and finish reasons are those of k = 1 (rows stop on the device at
      EOS, stop ids and the length limits, never before `min_tokens`; stop strings are checked
      on the host afterwards and what follows a match is discarded); logprob values agree to
      float32 rounding (a finished row leaves the row bucket at the end of the dispatch).
      While requests wait for a row, a dispatch ends as soon as some row finishes, so a freed
      row is refilled at once; a request added while the batch runs waits at most one
      dispatch of `k` steps. While a row with structured outputs runs, steps go one at a time
      (its grammar advances on the host after every token). On a mesh too (the loop declares
      its shardings and samples vocabulary-sharded logits). Only a step that only decodes
      loops; it reserves pages for up to k tokens per row (never preempting for them) and
      loops over pages (`worker/multi_step.py`).
    logits_processors: your `jaxengine.LogitsProcessor`s: classes (built with no arguments),
      instances or `"module:Class"` strings.
    speculative_config: None, or vLLM's dict ``{"method": "ngram", "num_speculative_tokens": k,
      "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` (`spec_decode/ngram_proposer.py`) or
      ``{"method": "suffix", ...}`` (`SpeculativeConfig`'s keys, `spec_decode/suffix_proposer.py`:
      suffix trees over the completion, its prompt's other samples and recent outputs): each step
      drafts up to k tokens per running completion, verifies them in one model pass over k + 1
      positions and keeps what the rejection sampler accepts (one to k + 1 tokens per row and step;
      the output distribution is unchanged, greedy output is that of plain decoding up to float
      rounding). A step decodes one token per row as usual when no row has a draft, when a cost
      model expects the rows' drafts (weighed by each row's acceptance so far) to emit too few extra
      tokens to pay for the wider pass (`worth_verifying`, `spec_crossover_tokens`), and while a row
      with structured outputs runs; k must be below `max_model_len`. With `num_decode_steps` > 1
      too: each step verifies when drafts pay, else runs the k-step loop when it only decodes, else
      a plain ragged step. Counters: `spec_decode_stats`. The drafts are query tokens of the ragged step
      (`worker/verify_step.py`), scheduled within the token budget and the free pages (never
      preempting for them).
    enable_prefix_caching: later prompts that start as an earlier one did (running or
      finished) share its full `block_size`-token pages instead of computing them again (vLLM's
      option and hash chain; `core/kv_cache_manager.py`). None (default): on. Requests asking for
      `prompt_logprobs` skip the lookup. The cache is emptied by `load_weights` and
      `reset_prefix_cache`; `kv_cache_stats` counts its queries, hits and evictions. Same
      outputs (logprob values to float32 rounding: the cached prefix was computed in another
      executable).
    async_scheduling: None (default) or True: on, with every other setting; False: off
      (vLLM's name).
      Each `step()` schedules and dispatches a step before it reads the one the last call
      dispatched (the scheduler counts that step's tokens as placeholders; the model reads
      each row's last token from the batch's device state), so the host's work on step t
      (logprob dicts, text, stop rules, freeing rows) runs while step t + 1 computes, and
      `step()` reports a step's tokens one call later. A completion found finished one step
      late has its extra token dropped: tokens, text, finish reasons and logprobs (to float32
      rounding) are those of synchronous steps for greedy and seeded requests. A step is read
      before the next one is scheduled when the next depends on its tokens: a running grammar
      (structured outputs), prompt logprobs it completes, a row reaching `max_tokens` or
      `max_model_len` with it (when `step()` has just read the step before, such a step is
      read first thing in the next call: each call reports one step's tokens); with a
      `speculative_config` every step first reads the one in flight (drafts are looked up in
      the rows' last tokens). A k-step loop
      (`num_decode_steps`) is dispatched while the step before is in flight (it reads each
      row's last token on the device); it and a verify step are read before the next step is
      scheduled: how many tokens each row got is known only from their output.
      `has_unfinished_requests` is False once every request has finished, even with a step
      left in flight for rows that finished since (the next `step` reads and drops it).

  Raises:
    TypeError: a keyword that is not an `EngineConfig` field.
    ValueError: anything `EngineConfig` refuses (naming the field and value), a model that does
      not implement `Model`, or `max_model_len` above the model's `max_position_embeddings`.
  """

  @with_engine_options
  def __init__(
    self,
    model: Model,
    tokenizer: Tokenizer | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    config: EngineConfig | None = None,
    **options: Any,
  ):
    check_model(model)
    config = engine_config(config, options, "LLMEngine")
    self.config = config = config.for_model(model.max_position_embeddings)
    self.speculative_config = config.speculative
    self.num_decode_steps = config.num_decode_steps
    if eos_token_id is None:
      eos_token_id = tokenizer.eos_token_id if tokenizer is not None else model.eos_token_id
    if isinstance(eos_token_id, Sequence):
      eos_token_ids = list(dict.fromkeys(int(t) for t in eos_token_id))
    else:
      eos_token_ids = [] if eos_token_id is None else [int(eos_token_id)]
    self.tokenizer = tokenizer
    self.eos_token_id: int | None = eos_token_ids[0] if eos_token_ids else None
    self.output_processor = OutputProcessor(
      tokenizer,
      self.eos_token_id,
      config.resolved_max_model_len,
      model.vocab_size,
      eos_token_ids[1:],
    )
    self.spec_decode_stats = SpecDecodingStats()
    #: One `EngineCore` per data-parallel group (`EngineConfig.data_parallel_groups`).
    self.cores = [
      EngineCore(
        model, group, tokenizer, eos_token_ids, self.output_processor, self.spec_decode_stats
      )
      for group in config.data_parallel_groups()
    ]
    first = self.cores[0]
    self.max_num_reqs = config.max_num_reqs
    self.max_model_len = first.max_model_len
    self.input_processor = InputProcessor(
      tokenizer,
      self.max_model_len,
      first.runner.input_batch.validate_request,
      None if first.structured is None else first.structured.compile,
    )
    self._requests: dict[str, Request] = {}
    self._ids = itertools.count()
    self._pause = PauseState()

  @classmethod
  def from_engine_args(cls, engine_args: EngineArgs, usage_context: object = None) -> LLMEngine:
    """The engine of vLLM's `EngineArgs`: their `model` loaded as `jaxengine.LLM` loads it, the
    config from the others (`usage_context`, vLLM's, is ignored). Raises as `jaxengine.LLM`."""
    config = engine_args.create_engine_config()
    loaded = load_model(engine_args.model, None, config)
    engine = cls(loaded.model, loaded.tokenizer, eos_token_id=loaded.eos_token_ids, config=config)
    if config.precompile:
      engine.precompile()
    return engine

  @property
  def runner(self) -> ModelRunner:
    """The first core's `ModelRunner` (the only one without data parallelism)."""
    return self.cores[0].runner

  @property
  def scheduler(self) -> Scheduler:
    """The first core's `Scheduler` (the only one without data parallelism)."""
    return self.cores[0].scheduler

  @property
  def structured(self) -> StructuredOutputs | None:
    """The first core's grammar matchers, None without a tokenizer."""
    return self.cores[0].structured

  @property
  def spec_crossover_tokens(self) -> int:
    """The verify decision's cost model (`spec_decode/ngram_proposer.py`), every core's: set it
    high to verify whenever some row has a draft."""
    return self.cores[0].spec_crossover_tokens

  @spec_crossover_tokens.setter
  def spec_crossover_tokens(self, value: int) -> None:
    for core in self.cores:
      core.spec_crossover_tokens = value

  # --- requests -------------------------------------------------------------------------------

  def add_request(
    self,
    request_id: str | None,
    prompt,
    params: SamplingParams | None = None,
    *,
    lora_request: LoRARequest | None = None,
  ) -> str:
    """Queues a prompt (text, token ids or a vLLM prompt dict); returns its request id.

    Args:
      request_id: unique in the engine, or None for a fresh one.
      prompt: text, token ids or a vLLM prompt dict.
      params: its `SamplingParams` (default `SamplingParams()`), of which the engine takes a
        checked copy (`SamplingParams.validated_copy`): later assignments do not reach the
        request. `output_kind` CUMULATIVE or FINAL_ONLY chooses what `step` returns for it.
      lora_request: the LoRA adapter it runs with (`enable_lora`), None for the base model. The
        adapter's directory is read (once: then kept in the host cache) and checked here.

    Raises:
      ValueError: (nothing queued) for a duplicate id or anything `InputProcessor.process`
        refuses (invalid `SamplingParams` values or `output_kind` DELTA, an empty or too long
        prompt, ids outside the vocabulary, text without a tokenizer, parameters the batch
        cannot hold); a `lora_request` without `enable_lora`, with `lora_int_id < 1`, or
        whose directory `jaxengine.lora.load_peft_adapter` refuses (no ``adapter_config.json``,
        a rank above `max_lora_rank`, an unknown target module).
      RuntimeError: (nothing queued) while the engine sleeps (`sleep`: call `wake_up`), or
        after sleep level 2 until `load_weights` has given the weights again.
    """
    return self.add_requests([(request_id, prompt, params, lora_request)])[0]

  def add_requests(self, requests: Sequence[RequestSpec]) -> list[str]:
    """Validates every `(request_id, prompt, params[, lora_request])` first, then queues them
    all.

    Raises:
      ValueError: as `add_request`; if any request is invalid, none is queued. With several
        requests the message starts with the failing one's position.
      RuntimeError: as `add_request` (asleep, or weights discarded by sleep level 2).
    """
    self.runner.check_awake()
    made: list[Request] = []
    for index, spec in enumerate(requests):
      request_id, prompt, params = spec[:3]
      lora_request = cast(LoRARequest | None, spec[3] if len(spec) > 3 else None)
      request_id = str(next(self._ids)) if request_id is None else str(request_id)
      try:
        if request_id in self._requests or any(r.request_id == request_id for r in made):
          raise ValueError(
            f"request_id {request_id!r} is already in the engine (a finished request stays "
            "until step() returns it, or pop_finished())"
          )
        request = self.input_processor.process(request_id, prompt, params or SamplingParams())
        request.lora_request = self._check_lora(lora_request)
        self.cores[0].check_fits(request)  # every core's pool has the same size
        made.append(request)
      except ValueError as error:
        if len(requests) == 1:
          raise
        raise ValueError(f"request {index} (of {len(requests)}): {error}") from None
    for request in made:
      self._requests[request.request_id] = request
      self._admit(request)  # held while paused
    return [r.request_id for r in made]

  def _check_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
    """A request's adapter, read into the host cache and checked (ValueError if refused)."""
    if lora_request is None:
      return None
    if not self.config.enable_lora:
      raise ValueError(f"lora_request={lora_request!r} needs an engine built with enable_lora=True")
    lora_request = check_lora_request(lora_request)
    for core in self.cores:
      cast(Any, core.runner.lora).load(lora_request)
    return lora_request

  @property
  def kv_cache_stats(self) -> KVCacheStats:
    """Occupancy of the paged KV cache (`num_blocks`, `num_used_blocks`, `peak_used_blocks`,
    `peak_running_reqs`, `num_preemptions`, prefix-cache counters; peaks and counters since
    the start or the last `reset_kv_cache_stats`). With data parallelism, every field summed
    over the groups' pools (a peak: the sum of each pool's own peak)."""
    stats = [core.kv_cache_manager.stats for core in self.cores]
    if len(stats) == 1:
      return stats[0]
    return KVCacheStats(
      **{f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(KVCacheStats)}
    )

  def reset_kv_cache_stats(self) -> None:
    """Restarts `kv_cache_stats`' peaks at the current occupancy and its counters at zero."""
    for core in self.cores:
      core.kv_cache_manager.reset_stats()

  def has_unfinished_requests(self) -> bool:
    """Whether any request is waiting or running in a core (not held by a pause), or a request
    the staleness bound dropped has its final output waiting for the next `step`. (A step left
    in flight for completions finished since holds nothing: the next `step` drops it.)"""
    return bool(self._pause.dropped) or any(core.has_unfinished() for core in self.cores)

  def abort_request(self, request_ids: str | Sequence[str]) -> None:
    """Drops requests, waiting or running, and forgets them (vLLM's name); unknown ids are
    ignored. A running completion leaves through the same finish path as one that stops
    (`EngineCore._finish`, finish reason "abort"). `LLM.generate` aborts its own requests when
    a step raises or it is interrupted, so that later calls do not run them again."""
    ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
    for core in self.cores:
      core.abort(ids)
    for request_id in ids:
      self._requests.pop(request_id, None)

  def pop_finished(self) -> list[RequestOutput]:
    """Returns and forgets every finished request `step` has not returned (a caller reading
    only `step`'s outputs, as vLLM's loops do, leaves none)."""
    done = [r for r in self._requests.values() if r.finished]
    for request in done:
      del self._requests[request.request_id]
    return [r.output() for r in done]

  def load_weights(self, weights, weight_version: int | None = None) -> None:
    """New model weights in every core, no recompilation: see `ModelRunner.load_weights`. Also
    while paused. Tokens of steps dispatched after it carry `weight_version` (default: the current
    + 1; `CompletionOutput.weight_versions`); requests past `max_staleness` end (`pause.py`).
    After `sleep(level=2)` and `wake_up`, every weight must be given; while the weights sleep
    (either level, before `wake_up`) it is refused (level 1's host copy is not updated).

    Raises:
      ValueError: (nothing changed) a negative or non-integer `weight_version`, an unknown
        name, or a tensor of the wrong shape or dtype; after sleep level 2, a weight missing.
      RuntimeError: (nothing changed) while the weights sleep (call `wake_up` first).
    """
    version = self.next_weight_version(weight_version)
    if len(self.cores) > 1 and not isinstance(weights, (Mapping, nnx.State, nnx.Module)):
      weights = list(cast(Iterable, weights))  # `(name, array)` pairs, read once per core
    for core in self.cores:  # the first core checks everything before any changes
      core.load_weights(weights)
    self.set_weight_version(version)

  def load_lora_weights(self, lora_request: LoRARequest, adapter: LoRAAdapter) -> None:
    """A LoRA adapter's values from memory in every core (`ModelRunner.load_lora_weights`).

    Raises:
      ValueError: (nothing changed) without `enable_lora`, or an adapter the slots refuse.
    """
    for core in self.cores:  # the first core checks everything before any changes
      core.load_lora_weights(lora_request, adapter)

  # --- sleep and wake ---------------------------------------------------------------------------

  def sleep(self, level: int = 1) -> None:
    """Frees the engine's device memory for another program on the same devices (a trainer in
    RL), every core's, until `wake_up` (vLLM's name).

    Args:
      level: 1: the KV cache's pages are freed and the weights move to pinned host memory
        (memory kind "pinned_host", the same shardings), to come back at `wake_up`. 2: the KV
        cache is freed and the weights are discarded: after `wake_up`, `load_weights` must
        give every weight before anything is generated (an RL weight sync).

    The KV cache's buffers are deleted (the engine alone holds them). The engine lets go of its
    weights rather than deleting them: their device memory is freed unless something else holds
    the same arrays (the module the engine was built from, a trainer's parameters that
    `load_weights` took without a copy), which stay intact: a colocated trainer keeps its
    parameters, and what it shares with the engine costs no second copy anyway. The prefix
    cache is emptied (its pages are gone). A step left in flight by asynchronous scheduling is
    read first. The persistent batch's small sampler state stays on the device. While asleep,
    `add_request`, `generate`, `precompile` and `load_weights` raise RuntimeError. Sleeping
    while asleep frees what is still held (level 2 after level 1 drops the host copy).

    Raises:
      ValueError: a level other than 1 or 2 (nothing changes).
      sleep_mode.UnfinishedRequestsError: (a RuntimeError) requests not finished, waiting,
        running or kept by a "keep" pause (finish or `abort_request` them first, as vLLM
        requires); nothing changes.
    """
    sleep_mode.check_level(level)
    if self.has_unfinished_requests():
      unfinished = sum(core.num_unfinished for core in self.cores)
      raise sleep_mode.UnfinishedRequestsError(
        unfinished,
        'finish them or abort_request them first; those a pause_generation(mode="keep") '
        'kept: resume_generation, or pause_generation(mode="abort") to end them',
      )
    for core in self.cores:
      core.drain()
    for core in self.cores:
      core.sleep(level)

  def free_kv_cache(self) -> int:
    """Frees every core's KV cache alone, the weights staying in place, until
    ``wake_up(tags=["kv_cache"])`` (a fresh, empty cache of the same pages; nothing compiles):
    room for a weight sync (`ModelRunner.free_kv_cache`).

    Returns:
      The device bytes freed, all cores together.

    Raises:
      RuntimeError: unfinished requests (nothing changes).
    """
    if self.has_unfinished_requests():
      raise RuntimeError("free_kv_cache needs no unfinished requests (finish or abort them first)")
    for core in self.cores:
      core.drain()
    return sum(core.free_kv_cache() for core in self.cores)

  def wake_up(self, tags: Sequence[str] | None = None) -> None:
    """Puts back what `sleep` freed, in every core (vLLM's name): the weights on their devices,
    placed as before (after level 1; after level 2 they wait for `load_weights`), and a fresh,
    empty KV cache of the same pages. Nothing compiles: the steps reuse their executables, and
    outputs are those of before the sleep (greedy and seeded requests).

    Args:
      tags: the parts to wake, of ``["weights", "kv_cache"]`` (vLLM's tags); None (default):
        both. E.g. after level 2: ``wake_up(tags=["weights"])``, `load_weights`, then
        ``wake_up(tags=["kv_cache"])``, so the KV cache is not held during the sync.

    Raises:
      ValueError: an unknown tag (nothing changes).
    """
    tags = sleep_mode.check_tags(tags)
    for core in self.cores:
      core.runner.wake_up(tags)

  def is_sleeping(self) -> bool:
    """Whether the engine sleeps: `sleep` was called and some part (weights or KV cache) is not
    woken yet (vLLM's name)."""
    return self.runner.is_sleeping()

  def reset_prefix_cache(self) -> bool:
    """Forgets every prefix hash (running requests keep their pages); returns True."""
    return all([core.reset_prefix_cache() for core in self.cores])

  def precompile(self, use_tqdm: bool = True) -> int:
    """Compiles every step shape of every core (`worker/precompile.py`); returns how many
    step shapes ran.

    Raises:
      ValueError: if requests are running (precompile before adding any).
      RuntimeError: while the engine sleeps, or after sleep level 2 before `load_weights`.
    """
    return sum(
      precompile(core.runner, self.num_decode_steps, use_tqdm, self.config.num_speculative_tokens)
      for core in self.cores
    )

  def step(self) -> list[RequestOutput]:
    """One step of every core (`EngineCore.step`): each runs the scheduler's decodes, prefill
    chunks and admissions, the model once over all their tokens, the sampler on the rows that
    finish, then the stop rules.

    Returns:
      A cumulative `RequestOutput` per request advanced in the steps read (FINAL_ONLY: finished),
      those `max_staleness` dropped first. One returned finished is forgotten (vLLM's way).
    """
    outputs = latest_outputs(self.take_dropped() + [o for core in self.cores for o in core.step()])
    final = RequestOutputKind.FINAL_ONLY
    shown = [o for o in outputs if o.finished or self._kind(o) is not final]
    for request_id in [o.request_id for o in shown if o.finished]:  # forgotten (vLLM's)
      self._requests.pop(request_id, None)
    return shown

  def _kind(self, output: RequestOutput) -> RequestOutputKind | None:
    request = self._requests.get(output.request_id)
    return None if request is None else request.params.output_kind
